"""The README's "Use it in your model" blocks run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks_of(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {section}\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


BLOCKS = blocks_of("Use it in your model")


def test_the_section_has_its_three_routes():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_as_written(index, tmp_path):
    """As a script of its own, in a fresh interpreter, as a reader would paste it."""
    block = BLOCKS[index]
    if "import transformers" in block:
        pytest.importorskip("transformers")
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(block)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
