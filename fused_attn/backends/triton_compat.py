"""The Triton releases fused_attn supports, and what differs between them, in one place.

The kernels are written with the language of every supported release (plain pointer arithmetic: no
block pointers, which 3.9 removed; no tensor descriptors, which 3.5 lacks), so they need nothing
from here. What differs is what lies around them: how the static report specialises a kernel's
arguments for ahead-of-time compilation. Each difference is detected by what the installed Triton
offers, not by comparing version numbers, so a release between the tested ones works too.

Users have the Triton their torch brought: PyPI's torch 2.13.0 (CUDA 13.0) pins 3.7.1, other
releases of torch pin others. The tests and the static report run on 3.5.1, 3.6.0, 3.7.1, 3.8.0 and
3.9.0 (`make test-triton`).

This module imports nothing of Triton at import time: `unsupported()` reads the installed release
from its metadata, so that choosing a backend stays cheap.
"""

from __future__ import annotations

import functools
import importlib.metadata
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
