"""Static GPU report of the `cuda` backend, made without a GPU.

Every kernel instance the extension ships (FUSED_ATTN_CUDA_FOR_EACH_INSTANCE in
csrc/cuda/flash_kernels.cuh: fp16, bf16 and fp32 at head dims 32, 64, 128, 256; forward, backward
dK/dV and dQ, plus the backward's delta kernel per dtype; and FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE:
the split-KV decode kernel at head dims 32, 64, 128 with tiles of 16 and 64 rows, plus its combine
kernel per dtype) is compiled by nvcc for sm_80 and sm_90
from one generated translation unit that instantiates them explicitly. ptxas's own report
(`-Xptxas -v --resource-usage`) gives registers, stack and spills; the tile configuration and the
dynamic shared memory of each instance come from the same header, printed by the host part of that
translation unit (run on the CPU, it makes no CUDA call); `cuobjdump --dump-sass` (nvcc's, or the
one in the Triton wheel) counts the tensor-core instructions (HMMA; HGMMA would be warpgroup MMA on
sm_90, which WMMA does not use).

Causal masking, dropout, the mask gradient and mask programs (block-sparse masks: the tile skip and the
per-score bit test) are runtime arguments of these kernels, so every instance carries their code and
`causal` is None in every row; `philox_rounds` counts the multiplies
by Philox's first constant in the SASS (ten per Philox4x32-10 block), which shows the dropout stream
is compiled into the forward and both backward tile kernels (and left out of the decode kernel,
which never drops).

    python -m bench.cuda_report            # table
    python -m bench.cuda_report --json     # one JSON object per (kernel instance, target)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .gpu_binaries import SASS_INSTRUCTION, ToolMissing, find_cuobjdump, resource_problems
from .kernel_table import format_table

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIR = ROOT / "csrc" / "cuda"
TARGETS = ("sm_80", "sm_90")
MAX_REGISTERS = 255  # per thread; __launch_bounds__(128, 1) lets ptxas use all of them
TENSOR_CORE_PREFIXES = ("HMMA", "HGMMA")
DTYPE_NAMES = {"__half": "float16", "__nv_bfloat16": "bfloat16", "float": "float32"}
MANGLED_DTYPES = {"6__half": "__half", "13__nv_bfloat16": "__nv_bfloat16", "f": "float"}
# Kernels that regenerate dropout's stream.
DROPOUT_KERNELS = ("forward", "backward_dkdv", "backward_dq")
# Kernels made of tile products: on tensor cores for fp16/bf16, on CUDA cores for fp32.
MATMUL_KERNELS = (*DROPOUT_KERNELS, "decode")
# Every kernel of the report.
KERNELS = (*MATMUL_KERNELS, "backward_delta", "decode_combine")
# One round of Philox4x32 multiplies by 0xD2511F53, which SASS prints as the signed immediate.
PHILOX_MULTIPLY = re.compile(r"IMAD\.WIDE\.U32\b.*(?:0xd2511f53|-0x2daee0ad)\s*,", re.IGNORECASE)
PHILOX_ROUNDS = 10

# The generated translation unit: explicit instantiations of every shipped kernel, and a host
# main() printing each instance's configuration as JSON lines.
INSTANCES_SOURCE = r"""
#include "flash_kernels.cuh"
#include <cstdio>

#define FA_INSTANTIATE(T, D)                                                                    \
  template __global__ void fused_attn_cuda::flash_forward_kernel<T, D>(const fused_attn_cuda::ForwardParams);        \
  template __global__ void fused_attn_cuda::flash_backward_dkdv_kernel<T, D>(const fused_attn_cuda::BackwardParams); \
  template __global__ void fused_attn_cuda::flash_backward_dq_kernel<T, D>(const fused_attn_cuda::BackwardParams);
FUSED_ATTN_CUDA_FOR_EACH_INSTANCE(FA_INSTANTIATE)
#define FA_INSTANTIATE_DECODE(T, D, BM) \
  template __global__ void fused_attn_cuda::flash_decode_kernel<T, D, BM>(const fused_attn_cuda::DecodeParams);
FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE(FA_INSTANTIATE_DECODE)
#define FA_INSTANTIATE_ROWS(T)                                                                                 \
  template __global__ void fused_attn_cuda::flash_backward_delta_kernel<T>(const fused_attn_cuda::DeltaParams); \
  template __global__ void fused_attn_cuda::flash_decode_combine_kernel<T>(const fused_attn_cuda::CombineParams);
FA_INSTANTIATE_ROWS(__half)
FA_INSTANTIATE_ROWS(__nv_bfloat16)
FA_INSTANTIATE_ROWS(float)

// `tile_rows`: the decode instance's template tile (null for the others, which have one per head dim).
static void print_config(const char* kernel, const char* dtype, int head, int m, int n, int shared,
                         const char* tile_rows = "null") {
  std::printf("{\"kernel\": \"%s\", \"dtype\": \"%s\", \"head_dim\": %d, \"block_m\": %d, "
              "\"block_n\": %d, \"threads\": %d, \"dynamic_shared_bytes\": %d, \"tile_rows\": %s}\n",
              kernel, dtype, head, m, n, fused_attn_cuda::kThreads, shared, tile_rows);
}

#define FA_PRINT_ONE(KIND, NAME, T, D)                                                     \
  print_config(NAME, #T, D,                                                                 \
      fused_attn_cuda::Config<fused_attn_cuda::KIND, T, D>::block_m,                        \
      fused_attn_cuda::Config<fused_attn_cuda::KIND, T, D>::block_n,                        \
      fused_attn_cuda::Config<fused_attn_cuda::KIND, T, D>::shared_bytes);
#define FA_PRINT(T, D)                                       \
  FA_PRINT_ONE(kForwardKernel, "forward", T, D)              \
  FA_PRINT_ONE(kBackwardKVKernel, "backward_dkdv", T, D)     \
  FA_PRINT_ONE(kBackwardQKernel, "backward_dq", T, D)

#define FA_PRINT_DECODE(T, D, BM)                                                           \
  print_config("decode", #T, D, BM, fused_attn_cuda::DecodeConfig<T, D, BM>::block_n,       \
               fused_attn_cuda::DecodeConfig<T, D, BM>::shared_bytes, #BM);

int main() {
  FUSED_ATTN_CUDA_FOR_EACH_INSTANCE(FA_PRINT)
  FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE(FA_PRINT_DECODE)
  for (const char* kernel : {"backward_delta", "decode_combine"})
    for (const char* dtype : {"__half", "__nv_bfloat16", "float"})  // one row (a warp) per warp
      std::printf("{\"kernel\": \"%s\", \"dtype\": \"%s\", \"head_dim\": null, \"block_m\": %d, "
                  "\"block_n\": 0, \"threads\": %d, \"dynamic_shared_bytes\": 0, \"tile_rows\": null}\n",
                  kernel, dtype, fused_attn_cuda::kWarps, fused_attn_cuda::kThreads);
  std::printf("{\"max_shared_bytes\": %d}\n", fused_attn_cuda::kMaxSharedBytes);
  return 0;
}
"""


def build_flags() -> list[str]:
    """The nvcc flags of the real build: setup.py's -O3, torch's C++ standard (C++20) and the flags
    torch's BuildExtension adds to every .cu file (no implicit half/bfloat16 conversions or operators,
    relaxed constexpr)."""
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
    except ImportError:
        COMMON_NVCC_FLAGS = []
    return ["-std=c++20", "-O3", *COMMON_NVCC_FLAGS]


def find_nvcc() -> str:
    candidates = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise ToolMissing("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")


def _parse_mangled(name: str) -> tuple[str, str, int | None, int | None] | None:
    """('forward', '__half', 64, None) style identity of a kernel from its mangled name: kernel, element
    type, head dim and, for the decode kernel, its tile rows."""
    match = re.search(r"fused_attn_cuda\d+flash_(\w+?)_kernelI(6__half|13__nv_bfloat16|f)(?:Li(\d+)E)?(?:Li(\d+)E)?E",
                      name)
    if match is None:
        return None
    kernel, dtype, head, rows = match.groups()
    return kernel, MANGLED_DTYPES[dtype], int(head) if head else None, int(rows) if rows else None


def parse_ptxas(log: str) -> dict:
    """{mangled name: {registers, stack_bytes, spill_bytes, static_shared_bytes}} from ptxas -v."""
    functions, current = {}, None
    for line in log.splitlines():
        match = re.search(r"Compiling entry function '([^']+)'", line)
        if match:
            current = functions.setdefault(match.group(1), {"registers": 0, "stack_bytes": 0,
                                                             "spill_bytes": 0, "static_shared_bytes": 0})
            continue
        match = re.search(r"Function properties for (\S+)", line)
        if match:
            current = functions.setdefault(match.group(1), {"registers": 0, "stack_bytes": 0,
                                                             "spill_bytes": 0, "static_shared_bytes": 0})
            continue
        if current is None:
            continue
        match = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match:
            current["stack_bytes"] = int(match.group(1))
            current["spill_bytes"] = int(match.group(2)) + int(match.group(3))
        match = re.search(r"Used (\d+) registers", line)
        if match:
            current["registers"] = int(match.group(1))
            shared = re.search(r"(\d+) bytes smem", line)
            current["static_shared_bytes"] = int(shared.group(1)) if shared else 0
    return functions


def parse_sass(sass: str) -> dict:
    """{mangled name: {tensor-core mnemonic: count, "philox_rounds": count}} from cuobjdump --dump-sass."""
    counts, current = {}, None
    for line in sass.splitlines():
        match = re.match(r"\s*Function : (\S+)", line)
        if match:
            current = counts.setdefault(match.group(1), {"philox_rounds": 0})
            continue
        if current is None:
            continue
        match = SASS_INSTRUCTION.match(line)
        if match and match.group(1).startswith(TENSOR_CORE_PREFIXES):
            current[match.group(1)] = current.get(match.group(1), 0) + 1
        if PHILOX_MULTIPLY.search(line):
            current["philox_rounds"] += 1
    return counts


def _run(command, cwd, timeout):
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return done


def _row(target, identity, config, resources, instructions) -> dict:
    kernel, dtype, head_dim, _ = identity
    tensor_cores = {name: count for name, count in instructions.items() if name != "philox_rounds"}
    dynamic = config["dynamic_shared_bytes"]
    row = {
        "backend": "cuda",
        "kernel": kernel,
        "target": target,
        "dtype": DTYPE_NAMES[dtype],
        "head_dim": head_dim,
        "causal": None,
        "config": (f"BLOCK_M={config['block_m']},BLOCK_N={config['block_n']},threads={config['threads']}"
                   if config["block_n"] else f"rows={config['block_m']},threads={config['threads']}"),
        "registers": resources["registers"],
        "spill_bytes": resources["spill_bytes"],
        "stack_bytes": resources["stack_bytes"],
        "shared_bytes": resources["static_shared_bytes"] + dynamic,
        "tensor_core_instructions": tensor_cores,
        "philox_rounds": instructions.get("philox_rounds", 0),
    }
    problems = resource_problems(target, row["spill_bytes"], row["stack_bytes"], row["shared_bytes"])
    if row["registers"] > MAX_REGISTERS:
        problems.append(f"{row['registers']} registers > {MAX_REGISTERS}")
    uses_tensor_cores = sum(tensor_cores.values()) > 0
    if kernel in MATMUL_KERNELS and dtype != "float" and not uses_tensor_cores:
        problems.append("no tensor-core instruction in an fp16/bf16 tile-product kernel")
    if (kernel not in MATMUL_KERNELS or dtype == "float") and uses_tensor_cores:
        problems.append("tensor-core instructions where CUDA cores were meant (fp32 or no products)")
    if kernel in DROPOUT_KERNELS and row["philox_rounds"] < PHILOX_ROUNDS:
        problems.append(f"{row['philox_rounds']} Philox rounds: the dropout stream is not compiled in")
    if kernel not in DROPOUT_KERNELS and row["philox_rounds"]:
        problems.append(f"{row['philox_rounds']} Philox rounds in a kernel that never drops")
    row["fits"] = not problems
    row["problems"] = problems
    return row


def report(targets=TARGETS, timeout=1800, workdir: str | None = None) -> list[dict]:
    """One dict per (kernel instance, target): resources, instructions, verdict.

    Keys: backend, kernel, target, dtype, head_dim, causal, config, registers, spill_bytes,
    stack_bytes, shared_bytes, tensor_core_instructions ({mnemonic: count}), philox_rounds, fits,
    problems.
    Raises ToolMissing when nvcc (or cuobjdump) is not installed.
    """
    nvcc = find_nvcc()
    cuobjdump = find_cuobjdump(nvcc)
    with tempfile.TemporaryDirectory(prefix="fused_attn_cuda_report_", dir=workdir) as tmp:
        source = Path(tmp) / "flash_instances.cu"
        source.write_text(INSTANCES_SOURCE)
        rows, configs = [], None
        for target in targets:
            binary = Path(tmp) / f"flash_instances_{target}"
            compiled = _run([nvcc, *build_flags(), f"-arch={target}", "-Xptxas", "-v",
                             "--resource-usage", "-I", str(KERNEL_DIR), "-o", str(binary), str(source)],
                            tmp, timeout)
            if configs is None:  # the configuration is host-side and the same for every target
                lines = _run([str(binary)], tmp, timeout).stdout.splitlines()
                configs = {(c["kernel"], c["dtype"], c["head_dim"], c["tile_rows"]): c
                           for c in map(json.loads, lines) if "kernel" in c}
            resources = parse_ptxas(compiled.stdout + compiled.stderr)
            sass = parse_sass(_run([cuobjdump, "--dump-sass", str(binary)], tmp, timeout).stdout)
            for name, usage in sorted(resources.items()):
                identity = _parse_mangled(name)
                if identity is None:
                    continue
                rows.append(_row(target, identity, configs[identity], usage, sass.get(name, {})))
        order = {name: i for i, name in enumerate(("forward", "decode", "decode_combine", "backward_delta",
                                                   "backward_dkdv", "backward_dq"))}
        return sorted(rows, key=lambda r: (r["target"], order.get(r["kernel"], 9), r["dtype"], r["head_dim"] or 0,
                                           r["config"]))


def compile_glue(target: str = "sm_80", timeout=1800) -> str:
    """Compiles csrc/cuda/flash_cuda.cu (torch glue + every instance) to an object file.

    A CPU build of torch ships the c10/cuda headers but not the configure-generated
    c10/cuda/impl/cuda_cmake_macros.h; an empty stand-in is supplied for it here (it only
    defines export macros for building torch itself). Returns ptxas's log; raises on failure.
    """
    import torch.utils.cpp_extension as cpp_extension

    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="fused_attn_cuda_glue_") as tmp:
        stub = Path(tmp) / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        generated = Path(cpp_extension.include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        if not generated.is_file():
            (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
        includes = [f"-I{Path(tmp) / 'stub'}"] + [f"-I{path}" for path in cpp_extension.include_paths()]
        command = [nvcc, *build_flags(), f"-arch={target}", "-Xptxas", "-v", "-c",
                   str(KERNEL_DIR / "flash_cuda.cu"), "-o", str(Path(tmp) / "flash_cuda.o"),
                   "-diag-suppress", "3306", "-DTORCH_EXTENSION_NAME=_C", *includes]
        done = _run(command, tmp, timeout)
        return done.stdout + done.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_report", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        rows = report(tuple(args.targets))
    except ToolMissing as missing:
        print(f"cuda report skipped: {missing}", file=sys.stderr)
        return 0
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_table(rows))
        print(f"{len(rows)} kernel instances, {sum(not r['fits'] for r in rows)} with problems, "
              f"compiled in {time.perf_counter() - start:.0f} s")
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
