"""The README's "Use it in your model" blocks run as written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks_of(heading: str) -> list[str]:
    """The python blocks under `heading` (a whole heading line, e.g. "## Usage"), up to the next heading
    of its level or above (lines inside code blocks are not headings)."""
    level = len(heading.split(" ")[0])
    blocks, block, inside, in_fence = [], None, False, False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
            if inside and line == "```python":
                block = []
            elif inside and block is not None and not in_fence:
                blocks.append("\n".join(block) + "\n")
                block = None
            continue
        if not in_fence and line.startswith("#"):
            depth = len(line.split(" ")[0])
            if line == heading:
                inside = True
            elif inside and line.strip("#") and depth <= level:
                break
        elif block is not None:
            block.append(line)
    return blocks


BLOCKS = blocks_of("## Use it in your model")


def test_the_section_has_its_four_routes():
    assert len(BLOCKS) == 4


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


@pytest.mark.slow
def test_ring_attention_example_runs_under_torchrun(tmp_path):
    (block,) = blocks_of("### `fused_attn.distributed.ring_attention` — one sequence over several processes")
    script = tmp_path / "ring_example.py"
    script.write_text(block)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script)]
    # In a session of its own, so that a hang ends with every rank killed, not with orphaned workers.
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate()
        pytest.fail(f"the example did not finish in 300 s: {stderr[-3000:]}")
    assert launcher.returncode == 0, stderr[-3000:]
    assert "2 ranks, max |ring - single device|" in stdout
