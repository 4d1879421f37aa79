# `make bench` (the main job) and `make test`. Each bootstraps .venv with the pinned requirements
# and the package itself, so a fresh clone needs nothing installed by hand.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.fused_attn-installed
SOURCES := setup.py pyproject.toml requirements.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: test bench install clean

install: $(INSTALLED)

$(INSTALLED): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

test: $(INSTALLED)
	$(PY) -m pytest -q tests

bench: $(INSTALLED)
	$(PY) -m bench --quick

clean:
	rm -rf build fused_attn/*.so $(VENV)
