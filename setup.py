"""Builds fused_attn and its C++ extension fused_attn._C (CPU kernels; CUDA kernels when possible).

The CUDA kernels are compiled when the installed torch was built with CUDA and nvcc is found; the
target architectures come from TORCH_CUDA_ARCH_LIST (default 8.0;8.6;9.0). No GPU is queried.
Set FUSED_ATTN_BUILD_EXTENSION=0 to install the pure-Python package (Triton and reference backends).
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

DEFAULT_CUDA_ARCHS = "8.0;8.6;9.0"


def cuda_build_possible() -> bool:
    return torch.version.cuda is not None and CUDA_HOME is not None


def extensions():
    if os.environ.get("FUSED_ATTN_BUILD_EXTENSION", "1") == "0":
        return []
    # Files compiled for the baseline instruction set come first (kernel_isa_* sort last): where an
    # instruction-set copy instantiates the same inline function, the linker keeps the first
    # definition, which must run on every CPU. torch's build adds its own -std (C++20).
    sources = ["csrc/ops.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    cxx_flags = ["-O3", "-fopenmp"]
    if not cuda_build_possible():
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
