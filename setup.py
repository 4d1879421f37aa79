"""Builds fused_attn and its C++ extension fused_attn._C (CPU kernels; CUDA kernels when possible).

The CUDA kernels are compiled when the installed torch was built with CUDA and a CUDA toolkit is
found (torch's rule: CUDA_HOME, else the directory above the `nvcc` on PATH, else /usr/local/cuda); the
target architectures come from TORCH_CUDA_ARCH_LIST (default 8.0;8.6;9.0;10.0;12.0+PTX: Ampere, Hopper, Blackwell,
and PTX that the driver compiles for later devices). The extension records them (fused_attn._C.cuda_architectures),
and the cuda backend refuses a device none of them runs on. No GPU is queried.

    FUSED_ATTN_BUILD_EXTENSION=0   the pure-Python package (Triton and reference backends)
    FUSED_ATTN_BUILD_CUDA=auto     CUDA kernels when possible, else a warning that says why (default)
    FUSED_ATTN_BUILD_CUDA=1        CUDA kernels or a build error that says why
    FUSED_ATTN_BUILD_CUDA=0        CPU kernels only (a quick build on a GPU machine without nvcc)
"""

import glob
import os
import warnings

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension, _get_cuda_arch_flags
import torch

# nvcc 13.0 (CUDA 13.0, which PyPI's torch 2.13.0 is built with) compiles for compute_75 to compute_121. A cubin runs
# on its major's later minors too (8.6: 8.7 and 8.9; 10.0: 10.3; 12.0: 12.1), PTX on every later device.
DEFAULT_CUDA_ARCHS = "8.0;8.6;9.0;10.0;12.0+PTX"
# Before CUDA 12.8 (torch 2.4-2.6) neither nvcc nor torch's arch flags know 10.0 and 12.0.
PRE_BLACKWELL_CUDA_ARCHS = "8.0;8.6;9.0+PTX"


def default_cuda_archs() -> str:
    version = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return DEFAULT_CUDA_ARCHS if version >= (12, 8) else PRE_BLACKWELL_CUDA_ARCHS


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


def cuda_architectures() -> str:
    """What nvcc builds the kernels for, read from the -gencode flags torch's own routine makes of
    TORCH_CUDA_ARCH_LIST for the build: "sm_XY" for a cubin, "compute_XY" for PTX, comma-separated (a preprocessor
    token list: fused_attn._C.cuda_architectures)."""
    codes = {flag.split(",code=")[1] for flag in _get_cuda_arch_flags()}
    return ",".join(sorted(codes, key=lambda code: (int("".join(filter(str.isdigit, code))), code)))


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
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", default_cuda_archs())
    sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    cxx_flags.append(f"-DFUSED_ATTN_CUDA_ARCHITECTURES={cuda_architectures()}")
    return [CUDAExtension("fused_attn._C", sources,
                          extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
                          extra_link_args=["-fopenmp"])]


setup(
    packages=find_packages(include=["fused_attn", "fused_attn.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
