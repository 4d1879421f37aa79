# `make bench` (the main job) and `make test`. Each bootstraps .venv with the pinned requirements
# and the package itself, so a fresh clone needs nothing installed by hand.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.fused_attn-installed
SOURCES := setup.py pyproject.toml requirements.txt $(shell find csrc -type f 2>/dev/null)

# Python versions a GPU runner may have, each resolved by an interpreter of that version where this
# machine has one (`make check-gpu-install`); Triton releases the kernels are tested on (`make test-triton`).
RUNNER_PYTHONS ?= 3.10 3.11 3.12 3.13
TRITON_VERSIONS ?= 3.5.1 3.6.0 3.7.1 3.8.0 3.9.0
TRITON_TESTS ?= tests/test_triton.py

.PHONY: test test-full bench install clean check-gpu-install check-gpu-install-full test-triton gpu-check

PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check

install: $(INSTALLED)

# QUIET (empty: each command is echoed) is `@` where the install runs for `make gpu-check`.
$(INSTALLED): $(SOURCES)
	$(QUIET)test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(QUIET)$(PIP_INSTALL) -r requirements.txt
	$(QUIET)$(PIP_INSTALL) --no-build-isolation --no-deps -e .
	$(QUIET)touch $@

# One pytest-xdist worker per core, up to 4 (TEST_WORKERS=0: all in this process); the static GPU report is compiled
# once per run and shared by the workers (tests/conftest.py). The slowest 25 tests are listed at the end: where the
# suite's time goes. `make test` (what CI runs) leaves out the cases marked slow, among them all but a sample of the
# most parametrized tests' cases (SAMPLED_ONE_IN, tests/conftest.py), and compiles the static report's sample
# (bench/triton_report.py, FUSED_ATTN_STATIC_REPORT); `make test-full` runs every case against the whole report.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup --durations 25

test: $(INSTALLED)
	FUSED_ATTN_STATIC_REPORT=sample $(PYTEST) -m "not slow" tests

test-full: $(INSTALLED)
	FUSED_ATTN_STATIC_REPORT=full $(PYTEST) tests

bench: $(INSTALLED)
	$(PY) -m bench --quick

# On a CUDA machine: the GPU tests, the correctness check and the timing grid against each SDPA kernel,
# FlexAttention and flash-attn, into one report in bench/results (exit 1 on a correctness failure).
# Without a GPU: one line, exit 0 (`$(PY) -m bench.gpu_check --dry-run` runs the pipeline on the CPU), the install
# of a fresh clone included: its commands are not echoed, and pip prints its errors alone.
gpu-check: QUIET := @
gpu-check: PIP_INSTALL += --quiet
gpu-check: $(INSTALLED)
	@$(PY) -m bench.gpu_check

# Fast (CI runs it): requirements.txt resolves as on a Linux GPU runner, whose pip sees PyPI's CUDA
# build of torch, with the Triton that torch pins.
check-gpu-install:
	$(PYTHON) scripts/check_gpu_install.py --python-versions $(RUNNER_PYTHONS)

# Slow (minutes, several GB): also installs that CUDA torch in .venv-cuda, builds the CUDA extension
# with nvcc from a copy of the tree, checks the import and runs the test suite there.
check-gpu-install-full:
	$(PYTHON) scripts/check_gpu_install.py --full --python-versions $(RUNNER_PYTHONS)

# The Triton tests (interpreter) and the static sm_80/sm_90/sm_100 report (exit 1 unless every kernel compiles,
# fits and uses tensor cores) on each supported Triton release, installed side by side in
# .triton/<version> and put first on PYTHONPATH for the venv's interpreter.
test-triton: $(INSTALLED)
	set -e; for version in $(TRITON_VERSIONS); do \
	  test -d .triton/$$version || $(PIP_INSTALL) --no-deps --target .triton/$$version triton==$$version; \
	  echo "== triton $$version"; \
	  PYTHONPATH=.triton/$$version $(PY) -m pytest -q $(TRITON_TESTS) $(PYTEST_ARGS); \
	  PYTHONPATH=.triton/$$version $(PY) -m bench.triton_report; \
	done

clean:
	rm -rf build fused_attn/*.so $(VENV) .venv-cuda .venv-resolve .triton
