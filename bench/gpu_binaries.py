"""What both static GPU reports read from compiled kernels: the tools, the SASS instruction pattern
and the resource limits a kernel must fit."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from fused_attn.backends.triton_kernels import SHARED_MEMORY_LIMIT

# One SASS instruction line of `cuobjdump --dump-sass`: /*offset*/, an optional predicate, the opcode.
SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)
# The architecture a cubin's code was built for, from the header of its `cuobjdump --dump-sass`: "code for sm_90a".
SASS_ARCHITECTURE = re.compile(r"^\s*code for (sm_\w+)", re.MULTILINE)


class ToolMissing(FileNotFoundError):
    """A CUDA toolkit program (nvcc, cuobjdump) is not installed here."""


def find_cuobjdump(nvcc: str | None = None) -> str:
    """cuobjdump next to nvcc, on PATH, or the one shipped in the Triton wheel."""
    candidates = [str(Path(nvcc).resolve().parent / "cuobjdump") if nvcc else None, shutil.which("cuobjdump")]
    try:
        import triton
        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise ToolMissing("cuobjdump not found (next to nvcc, on PATH, or in the triton wheel)")


def resource_problems(target: str, spill_bytes: int, stack_bytes: int, shared_bytes: int,
                      local_accesses: int = 0) -> list[str]:
    """Why a kernel's resources would not do on `target`: spills, a stack frame, too much shared memory."""
    problems = []
    if local_accesses or spill_bytes:
        problems.append(f"register spills: {local_accesses} local loads/stores, {spill_bytes} bytes local")
    if stack_bytes:
        problems.append(f"stack frame of {stack_bytes} bytes")
    if shared_bytes > SHARED_MEMORY_LIMIT[target]:
        problems.append(f"shared memory {shared_bytes} B > {SHARED_MEMORY_LIMIT[target]} B on {target}")
    return problems
