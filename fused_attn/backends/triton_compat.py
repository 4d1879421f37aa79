"""The Triton releases fused_attn supports, and what differs between them, in one place.

The kernels are written with the language of every supported release (plain pointer arithmetic: no
block pointers, which 3.9 removed), so they need little from here. The tensor-descriptor variants of the
forward and the backward's dK/dV and dQ kernels (`tl.make_tensor_descriptor`, TMA on sm_90 and later; every
supported release has it) are extra candidates where `tensor_descriptors()` finds it, the forward's with
`tl.range`'s warp specialization where `warp_specialization()` does. What else differs is what lies around the kernels: how the static report
specialises a kernel's arguments for ahead-of-time compilation, and where the global scratch memory of
descriptors made on the device comes from (`scratch_allocator`). Each difference is detected by what the
installed Triton offers, not by comparing version numbers, so a release between the tested ones works too; the tiles
some launches take on older releases, whose registers spill at the newer ones', go by `older_than`.

Users have the Triton their torch brought: PyPI's torch 2.13.0 (CUDA 13.0) pins 3.7.1, other
releases of torch pin others. The tests and the static report run on 3.5.1, 3.6.0, 3.7.1, 3.8.0 and
3.9.0 (`make test-triton`).

This module imports nothing of Triton at import time: `unsupported()` reads the installed release
from its metadata, so that choosing a backend stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import importlib.util
import re
import warnings

OLDEST = (3, 5)
NEWEST_TESTED = (3, 9)
# Distributions that install the `triton` module: PyPI's, and the one torch's nightly builds use.
DISTRIBUTIONS = ("triton", "pytorch-triton")


def release() -> tuple[int, int] | None:
    """(major, minor) of the installed Triton, or None when no metadata names it."""
    for distribution in DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = re.match(r"(\d+)\.(\d+)", version)
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


@functools.cache
def unsupported() -> str | None:
    """Why the installed Triton cannot run the kernels (not installed, too old), or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    found = release()
    if found is not None and found < OLDEST:
        return (f"triton {found[0]}.{found[1]} is installed; the kernels need {OLDEST[0]}.{OLDEST[1]} "
                f"or newer")
    if found is not None and found > NEWEST_TESTED:
        warnings.warn(f"fused_attn: triton {found[0]}.{found[1]} is newer than the releases its kernels "
                      f"are tested on ({OLDEST[0]}.{OLDEST[1]} to {NEWEST_TESTED[0]}.{NEWEST_TESTED[1]})",
                      stacklevel=2)
    return None


def specializer():
    """fn(arg) -> (type, attribute): how a launch specialises one kernel argument (its signature type,
    e.g. "*fp16" or "i32", and its attribute, e.g. "D" for 16-byte divisibility; or "constexpr" and
    the value an integer 1 is folded into), as the JIT itself would for the current backend."""
    from triton.backends.compiler import BaseBackend

    try:  # Triton 3.6 and later: the JIT's routine is native code
        from triton._C.libtriton import native_specialize_impl
    except ImportError:  # 3.5: a Python closure over the backend's attribute rule
        from triton.runtime.jit import create_specialize_impl

        python_impl = create_specialize_impl(BaseBackend.get_arg_specialization)
        return lambda arg: python_impl(arg, False, True, True)
    return lambda arg: native_specialize_impl(BaseBackend, arg, False, True, True)


# The oldest release whose descriptor forward compiles without spills for every launch it is offered for
# (bench/triton_report.py): 3.7.1 and 3.9.0 do; on 3.5.1 the sm_90 build at D = 64 with the score variants and key
# padding spilled (6 local loads/stores); 3.6 has not been compiled. The backward's dK/dV and dQ variants hold the
# same line: 3.7.1, 3.8.0 and 3.9.0 compile every row without spills; on sm_100, 3.6.0 spilled two of them (2 and 36
# local loads/stores) and 3.5.1 three (3 to 20). The decode kernel's compiled without spills on all five; with its
# splits' outputs written through descriptors too, on 3.7.1, 3.8.0 and 3.9.0 (3.5 and 3.6 not compiled since).
DESCRIPTORS_FROM = (3, 7)


def _installed_name(found: tuple[int, int] | None) -> str:
    return f"triton {found[0]}.{found[1]}" if found else "the installed triton"


def tensor_descriptors() -> str | None:
    """Why the tensor-descriptor variants (forward, dK/dV, dQ) are not offered with the installed Triton, or None: it
    has no tensor descriptors made on the device (`tl.make_tensor_descriptor`), or is older than DESCRIPTORS_FROM."""
    import triton.language as tl

    found = release()
    name = _installed_name(found)
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"{name} has no tl.make_tensor_descriptor"
    if found is not None and found < DESCRIPTORS_FROM:
        return (f"{name}: the descriptor variants are offered from triton "
                f"{DESCRIPTORS_FROM[0]}.{DESCRIPTORS_FROM[1]} on (the forward's spilled registers on {name})")
    return None


# The oldest release whose warp-specialized forward compiles without spills for every launch it is offered for
# (bench/triton_report.py): 3.9.0. On 3.7.1 the causal one spilled on sm_100 (7 to 9 local loads/stores);
# 3.8 has not been compiled. The warp-specialized backward (dK/dV and dQ) has been compiled on 3.9.0 only. The
# warp-specialized decode kernel compiles on 3.9.0; on 3.7.1 and 3.8.0 its sm_100 builds failed in Triton's
# automatic warp specialization (an assertion of the NVWSInsertAref pass).
WARP_SPECIALIZED_FROM = (3, 9)


def warp_specialization_missing() -> str | None:
    """Why the warp-specialized variants (forward, dK/dV, dQ) are not offered with the installed Triton, or None:
    its `tl.range` takes no warp_specialize (automatic warp specialization of a loop), or it is not known to be
    WARP_SPECIALIZED_FROM or newer."""
    import triton.language as tl

    found = release()
    name = _installed_name(found)
    if "warp_specialize" not in inspect.signature(tl.range.__init__).parameters:
        return f"{name}'s tl.range takes no warp_specialize"
    if found is None or found < WARP_SPECIALIZED_FROM:
        return (f"{name}: the warp-specialized variants are offered from triton {WARP_SPECIALIZED_FROM[0]}."
                f"{WARP_SPECIALIZED_FROM[1]} on, the oldest release whose builds compiled without spills")
    return None


def warp_specialization() -> bool:
    """Whether the warp-specialized variants (forward, dK/dV, dQ) are offered (`warp_specialization_missing`)."""
    return warp_specialization_missing() is None


@functools.cache
def older_than(version: tuple[int, int]) -> bool:
    """Whether the installed Triton is older than `version`, (major, minor): some launches then take tiles of their own
    (`triton_kernels._OLD_RELEASE_DEFAULTS` and `_FLOAT32_OLD_RELEASE_DEFAULTS`, where its register allocation spills
    at the tiles chosen on newer releases). A Triton no metadata names counts as new."""
    found = release()
    return found is not None and found < version


@contextlib.contextmanager
def scratch_allocator(device):
    """Within the block, kernels that need global scratch memory (tensor descriptors made on the device: 128 bytes
    each per program) get it from torch's allocator on `device`, unless the caller set an allocator of its own
    (`triton.set_allocator`), which is left in place. Triton keeps the allocator in a context variable (3.5 to
    3.9), set here for the block only."""
    import torch
    from triton.runtime import _allocation

    def allocate(size: int, alignment: int, stream):  # torch's CUDA blocks are aligned to 512 bytes
        return torch.empty(size, dtype=torch.int8, device=device)

    if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        yield
        return
    token = _allocation._allocator.set(allocate)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)
