"""Shared test setup.

Without a CUDA device, Triton kernels run in Triton's interpreter on CPU tensors; the switch must be
set before any kernel module is imported, hence here. Tests marked `cuda` skip cleanly without a GPU.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def generator():
    """A seeded generator per test: fresh random inputs, reproducible failures."""
    return torch.Generator().manual_seed(0x5EED)


@pytest.fixture(scope="session")
def static_gpu_report():
    """`python -m bench.inspect --json` (every Triton and CUDA kernel compiled for sm_80 and sm_90),
    run once per session in a child process: a bench.inspect.JsonRun."""
    from bench import inspect

    return inspect.run_json()
