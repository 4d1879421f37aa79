"""Every feature drawn together on the `cpu` backend: tests/combinations.py draws the problems."""

from __future__ import annotations

import pytest
import torch

from fused_attn import testing
from fused_attn.backends import registry

pytest.importorskip("hypothesis")
import combinations  # noqa: E402
from hypothesis import given  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@combinations.settings(200)
@given(problem=combinations.problems(DTYPES))
def test_cpu_meets_criterion_on_any_combination(problem):
    """Forward and backward through the public call (autograd, the plans, the op) and through the backend's own
    entry points, in small blocks so that rows cross several key blocks."""
    inputs = combinations.inputs_of(problem)
    # One thread: the problems are tiny, and two threads beside other busy workers wait for each other at every
    # parallel region (25.8 s against 10.5 s for 300 short examples beside two busy cores). Their keys are too few for
    # the decode kernels to split (tests/test_cpu.py splits them).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_and_check(inputs)
    finally:
        torch.set_num_threads(threads)


def run_and_check(inputs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FUSED_ATTN_CPU_BLOCK_Q", "16")
        patch.setenv("FUSED_ATTN_CPU_BLOCK_K", "24")
        public = testing.run_attention(inputs, "cpu")
        fresh = combinations.with_fresh_output(inputs)
        own = testing.run_backend(registry.get("cpu"), fresh)
    combinations.check(public, inputs)
    combinations.check(own, fresh)
