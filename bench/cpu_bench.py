"""`python -m bench.cpu_bench`: the cpu backend against PyTorch's CPU flash attention (SDPA).

For every row, in one process with the same inputs and threads, the candidates run interleaved
(one call each per round) and the table gives the median over rounds of the time ratio
SDPA / cpu (> 1: the cpu backend is faster), the same ratio against the einsum reference, and the
cpu backend's FLOP rate as a fraction of the machine's GEMM rate (a large torch.mm in the same
dtype, timed interleaved with the rest). FLOPs: 4·B·H·L²·D, half for causal, ×3.5 forward+backward.

    python -m bench.cpu_bench [--dtypes fp32 bf16] [--modes fwd fwdbwd] [--rounds 7]
                              [--shapes quick|issue] [--no-reference] [--memory]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import fused_attn
from fused_attn.backends import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (B, H, L, D) of the issue: B=4, H=8, D in {64, 128}, L in {512, 2048}, plus B=1, L=8192.
ISSUE_SHAPES = [(4, 8, 512, 64), (4, 8, 512, 128), (4, 8, 2048, 64), (4, 8, 2048, 128),
                (1, 8, 8192, 64), (1, 8, 8192, 128)]
QUICK_SHAPES = [(4, 8, 512, 64), (4, 8, 2048, 64), (4, 8, 2048, 128)]
# The reference materialises B·H·L² scores several times over; beyond this it only costs memory.
REFERENCE_MAX_SCORES = 4 * 8 * 2048 * 2048


def machine_description() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                  if line.startswith("flags")), [])
    wanted = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16",
                          "amx_tile") if f in flags]
    return (f"{model}; {os.cpu_count()} CPUs; flags {' '.join(wanted)}; torch {torch.__version__} "
            f"(capability {torch.backends.cpu.get_cpu_capability()}); threads {torch.get_num_threads()}; "
            f"python {platform.python_version()}")


def attention_flops(b, h, length, d, causal, backward):
    flops = 4 * b * h * length * length * d
    flops = flops / 2 if causal else flops
    return flops * 3.5 if backward else flops


def make_call(kind, q, k, v, causal, backward, grad):
    """A no-argument callable: forward, or forward then backward, of one implementation."""
    if kind == "cpu":
        def forward():
            return fused_attn.attention(q, k, v, is_causal=causal, backend="cpu")
    elif kind == "sdpa":
        def forward():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        def forward():
            return reference.attention(q, k, v, is_causal=causal)[0]
    if not backward:
        def run():
            with torch.no_grad():
                forward()
        return run

    def run():
        out = forward()
        torch.autograd.grad(out, (q, k, v), grad)
    return run


def timed_rounds(calls: dict, rounds: int, budget_s: float):
    """Interleaved rounds (one call of each per round) until `rounds` or the time budget is spent."""
    for call in calls.values():
        call()  # warm-up: brgemm kernels are generated on first use
    samples = {name: [] for name in calls}
    start = time.perf_counter()
    for index in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - t0)
        if index >= 2 and time.perf_counter() - start > budget_s:
            break
    return samples


def bench_row(dtype, shape, causal, backward, rounds, budget_s, with_reference, gemm_call):
    b, h, length, d = shape
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, generator=generator).to(dtype).requires_grad_(backward)
               for _ in range(3))
    grad = torch.randn(b, h, length, d, generator=generator).to(dtype)
    calls = {"cpu": make_call("cpu", q, k, v, causal, backward, grad),
             "sdpa": make_call("sdpa", q, k, v, causal, backward, grad),
             "gemm": gemm_call}
    if with_reference and b * h * length * length <= REFERENCE_MAX_SCORES:
        calls["reference"] = make_call("reference", q, k, v, causal, backward, grad)
    samples = timed_rounds(calls, rounds, budget_s)
    ours = samples["cpu"]
    row = {
        "rounds": len(ours),
        "cpu_ms": statistics.median(ours) * 1e3,
        "sdpa_ms": statistics.median(samples["sdpa"]) * 1e3,
        "vs_sdpa": statistics.median(s / o for s, o in zip(samples["sdpa"], ours)),
        "vs_reference": (statistics.median(r / o for r, o in zip(samples["reference"], ours))
                         if "reference" in samples else None),
    }
    gemm_rate = statistics.median(gemm_call.flops / t for t in samples["gemm"])
    row["gflops"] = attention_flops(b, h, length, d, causal, backward) / statistics.median(ours) / 1e9
    row["gemm_fraction"] = row["gflops"] * 1e9 / gemm_rate
    return row


def gemm_call_for(dtype, n=2048):
    a = torch.randn(n, n).to(dtype)
    bm = torch.randn(n, n).to(dtype)

    def run():
        torch.mm(a, bm)
    run.flops = 2 * n ** 3
    return run


TARGETS = {("fwd", torch.float32): 1.0, ("fwd", torch.bfloat16): 1.2, ("fwdbwd", torch.float32): 1.0,
           ("fwdbwd", torch.bfloat16): 1.0}


def run_table(args):
    print(machine_description())
    print()
    print("| dtype | B | H | L | D | causal | pass | cpu ms | SDPA ms | ×SDPA (median of ratios) | target "
          "| ×reference | GFLOP/s | of GEMM | rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = ISSUE_SHAPES if args.shapes == "issue" else QUICK_SHAPES
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        gemm = gemm_call_for(dtype)
        for mode in args.modes:
            for shape in shapes:
                for causal in (False, True):
                    row = bench_row(dtype, shape, causal, mode == "fwdbwd", args.rounds, args.budget,
                                    not args.no_reference, gemm)
                    target = TARGETS.get((mode, dtype))
                    verdict = "" if target is None else f"≥{target} {'ok' if row['vs_sdpa'] >= target else 'MISSED'}"
                    ref = "—" if row["vs_reference"] is None else f"{row['vs_reference']:.2f}"
                    b, h, length, d = shape
                    print(f"| {dtype_name} | {b} | {h} | {length} | {d} | {causal} | {mode} | "
                          f"{row['cpu_ms']:.1f} | {row['sdpa_ms']:.1f} | {row['vs_sdpa']:.2f} | {verdict} | "
                          f"{ref} | {row['gflops']:.0f} | {row['gemm_fraction']:.2f} | {row['rounds']} |",
                          flush=True)


MEMORY_SCRIPT = """
import sys, torch, fused_attn
import torch.nn.functional as F
b, h, length, d = 1, 8, 16384, 64
q, k, v = (torch.randn(b, h, length, d) for _ in range(3))
out = torch.empty(b, h, length, d)
# Touch everything the call reads or writes, then take the high-water mark as the baseline.
out.zero_()
small = torch.randn(1, 8, 256, 64)
fused_attn.attention(small, small, small, backend="cpu") if sys.argv[1] == "cpu" else F.scaled_dot_product_attention(small, small, small)
def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
# Resident now (inputs and output touched) against the high-water mark after: an upper bound.
before = status("VmRSS:")
if sys.argv[1] == "cpu":
    torch.ops.fused_attn.flash_forward(q, k, v, None, None, False, d ** -0.5, out)
else:
    out = F.scaled_dot_product_attention(q, k, v)
after = status("VmHWM:")
print((after - before) / 1024)
"""


def measure_memory():
    """Peak resident memory added by one forward at B=1, H=8, L=16384, D=64, fp32, in a fresh process."""
    print("\nforward at B=1, H=8, L=16384, D=64, fp32: peak RSS added beyond inputs and outputs")
    for kind in ("cpu", "sdpa"):
        result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, kind], capture_output=True, text=True,
                                check=True)
        note = "" if kind == "cpu" else " (allocates its output inside the call: 32 MiB of it is the output)"
        print(f"  {kind}: {float(result.stdout.strip()):.1f} MiB{note}")
    einsum_scores = 8 * 16384 * 16384 * 4 / 2 ** 30
    print(f"  reference (einsum): the score matrix alone is {einsum_scores:.0f} GiB (not run)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--modes", nargs="+", choices=("fwd", "fwdbwd"), default=["fwd", "fwdbwd"])
    parser.add_argument("--shapes", choices=("quick", "issue"), default="issue")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row (at most)")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds per row before stopping early")
    parser.add_argument("--no-reference", action="store_true", help="skip the einsum reference")
    parser.add_argument("--memory", action="store_true", help="also measure the memory target")
    parser.add_argument("--memory-only", action="store_true", help="only measure the memory target")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not args.memory_only:
        run_table(args)
    if args.memory or args.memory_only:
        measure_memory()


if __name__ == "__main__":
    main()
