"""Builds fused_attn and its C++ extension fused_attn._C (CPU kernels; CUDA kernels when possible).

The CUDA kernels are compiled when the installed torch was built with CUDA and a CUDA toolkit is
found (torch's rule: CUDA_HOME, else the directory above the `nvcc` on PATH, else /usr/local/cuda); the
target architectures come from TORCH_CUDA_ARCH_LIST (default 8.0;8.6;9.0). No GPU is queried.

    FUSED_ATTN_BUILD_EXTENSION=0   the pure-Python package (Triton and reference backends)
    FUSED_ATTN_BUILD_CUDA=auto     CUDA kernels when possible, else a warning that says why (default)
    FUSED_ATTN_BUILD_CUDA=1        CUDA kernels or a build error that says why
    FUSED_ATTN_BUILD_CUDA=0        CPU kernels only (a quick build on a GPU machine without nvcc)
"""

import glob
import os
import warnings

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

DEFAULT_CUDA_ARCHS = "8.0;8.6;9.0"


def cuda_build_problem() -> str | None:
    """Why the CUDA kernels cannot be compiled here, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (no nvcc on PATH; set CUDA_HOME to the toolkit's root)"
    # torch guesses CUDA_HOME from the nvcc on PATH; a wrapper script in /usr/local/bin, say, makes
    # the guess /usr/local, where the compile would fail for want of CUDA's headers.
    if not os.path.isfile(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        return (f"CUDA_HOME={CUDA_HOME} has no include/cuda_runtime.h (set CUDA_HOME to the CUDA "
                "toolkit's root, e.g. /usr/local/cuda)")
    return None


def build_cuda() -> bool:
    wanted = os.environ.get("FUSED_ATTN_BUILD_CUDA", "auto").lower()
    if wanted not in ("auto", "0", "1"):
        raise ValueError(f"FUSED_ATTN_BUILD_CUDA: expected auto, 0 or 1, got {wanted!r}")
    if wanted == "0":
        return False
    problem = cuda_build_problem()
    if problem is None:
        return True
    if wanted == "1":
        raise RuntimeError(f"FUSED_ATTN_BUILD_CUDA=1, but the CUDA kernels cannot be built: {problem}")
    if torch.version.cuda is not None:  # a GPU user may have expected them: say why they are missing
        warnings.warn(f"fused_attn: building the CPU kernels only: {problem}", stacklevel=1)
    return False


def extensions():
    if os.environ.get("FUSED_ATTN_BUILD_EXTENSION", "1") == "0":
        return []
    # Files compiled for the baseline instruction set come first (kernel_isa_* sort last): where an
    # instruction-set copy instantiates the same inline function, the linker keeps the first
    # definition, which must run on every CPU. torch's build adds its own -std (C++20).
    sources = ["csrc/ops.cpp", "csrc/plain_call.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    cxx_flags = ["-O3", "-fopenmp"]
    if not build_cuda():
        return [CppExtension("fused_attn._C", sources, extra_compile_args={"cxx": cxx_flags},
                             extra_link_args=["-fopenmp"])]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    return [CUDAExtension("fused_attn._C", sources,
                          extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
                          extra_link_args=["-fopenmp"])]


setup(
    packages=find_packages(include=["fused_attn", "fused_attn.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
