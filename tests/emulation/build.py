"""Builds the emulated `cuda` backend (flash_emulated.cpp) with the host compiler, at test time.

The kernels of csrc/cuda are compiled here, unchanged, against cuda_emulation.h, so a kernel change
that breaks the emulated run breaks this build. The build is cached in the temporary directory (ninja rebuilds
what changed), one builder at a time; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pathlib
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KERNELS = ROOT / "csrc" / "cuda"


def cuda_include_dir() -> pathlib.Path | None:
    """A directory with cuda_fp16.h / cuda_bf16.h / mma.h: the CUDA toolkit's, else the Triton wheel's."""
    candidates = []
    try:
        from torch.utils.cpp_extension import CUDA_HOME
        if CUDA_HOME:
            candidates.append(pathlib.Path(CUDA_HOME) / "include")
    except ImportError:
        pass
    candidates += [pathlib.Path("/usr/local/cuda/include")]
    try:
        import triton
        candidates.append(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "include")
    except ImportError:
        pass
    for directory in candidates:
        if (directory / "cuda_fp16.h").is_file() and (directory / "cuda_bf16.h").is_file():
            return directory
    return None


def _nvcc_type_flags() -> list[str]:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    return [flag for flag in COMMON_NVCC_FLAGS if flag.startswith("-D__CUDA_NO_")]


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module, with `forward` and `backward` on CPU tensors (see flash_emulated.cpp)."""
    from torch.utils import cpp_extension

    include = cuda_include_dir()
    if include is None:
        raise FileNotFoundError("no cuda_fp16.h/cuda_bf16.h found (CUDA toolkit or triton wheel)")
    build_directory = pathlib.Path(tempfile.gettempdir()) / "fused_attn_cuda_emulation"
    build_directory.mkdir(parents=True, exist_ok=True)
    with _builder_alone(build_directory):
        return cpp_extension.load(
            name="fused_attn_cuda_emulated",
            sources=[str(HERE / "flash_emulated.cpp")],
            extra_include_paths=[str(HERE), str(KERNELS), str(include)],
            # As strict about fp16/bf16 as torch's CUDA builds: no implicit conversions or operators.
            extra_cflags=["-std=c++20", "-O2", "-Wno-unused-parameter", *_nvcc_type_flags()],
            extra_ldflags=["-pthread"],
            build_directory=str(build_directory),
            verbose=os.environ.get("FUSED_ATTN_VERBOSE_BUILD") == "1",
        )


@contextlib.contextmanager
def _builder_alone(directory: pathlib.Path):
    """This process alone builds in `directory` (the workers and the runs of this machine share it). The lock is
    the system's, released when its holder dies: cpp_extension's own, a `lock` file, outlives a killed build, and
    every later load would wait on it forever. Under this lock any such file is a dead build's, and is removed."""
    with open(directory / "builder.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


SANITIZERS = {
    # A shared-memory race (a missing __syncthreads) is a data race between emulated threads.
    "thread": ["-fsanitize=thread"],
    # Reads and writes outside the tensors' memory; undefined behaviour.
    "address,undefined": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"],
}


def build_sanitized(sanitizer: str, directory: pathlib.Path) -> pathlib.Path:
    """sanitized_run.cpp (every kernel, no torch) built with a sanitizer of SANITIZERS into `directory`."""
    import subprocess

    include = cuda_include_dir()
    if include is None:
        raise FileNotFoundError("no cuda_fp16.h/cuda_bf16.h found (CUDA toolkit or triton wheel)")
    binary = directory / f"sanitized_run_{sanitizer.replace(',', '_')}"
    command = [os.environ.get("CXX", "g++"), "-std=c++20", "-O1", "-g", "-pthread",
               "-Wno-unknown-pragmas", *_nvcc_type_flags(), *SANITIZERS[sanitizer],
               f"-I{HERE}", f"-I{KERNELS}", f"-I{include}", str(HERE / "sanitized_run.cpp"),
               "-o", str(binary)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-6000:]}")
    return binary
