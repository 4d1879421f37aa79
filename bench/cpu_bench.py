"""`python -m bench.cpu_bench`: the cpu backend against PyTorch's CPU flash attention (SDPA).

For every row, in one process with the same inputs and threads, the candidates run interleaved
(one call each per round) and the table gives the median over rounds of the time ratio
SDPA / cpu (> 1: the cpu backend is faster), the same ratio against the einsum reference, and the
cpu backend's FLOP rate as a fraction of the machine's GEMM rate (a large torch.mm in the same
dtype, or in float32 where the kernels convert its operands to float, timed right after each row's
rounds, as many calls as the row had rounds: interleaved with the attention calls it would evict
their inputs from the caches before whichever ran next).
FLOPs: 4·B·H·L²·D, half for causal, ×3.5 forward+backward.

    python -m bench.cpu_bench [--dtypes fp32 bf16] [--modes fwd fwdbwd] [--rounds 21]
                              [--shapes quick|issue] [--no-reference] [--memory]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import torch

from . import report, sweep, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (B, H, L, D) of the issue: B=4, H=8, D in {64, 128}, L in {512, 2048}, plus B=1, L=8192.
ISSUE_SHAPES = [(4, 8, 512, 64), (4, 8, 512, 128), (4, 8, 2048, 64), (4, 8, 2048, 128),
                (1, 8, 8192, 64), (1, 8, 8192, 128)]
QUICK_SHAPES = [(4, 8, 512, 64), (4, 8, 2048, 64), (4, 8, 2048, 128)]
# The reference materialises B·H·L² scores several times over; beyond this it only costs memory.
REFERENCE_MAX_SCORES = 4 * 8 * 2048 * 2048


def bench_row(dtype, shape, causal, backward, rounds, budget_s, with_reference, gemm_call):
    b, h, length, d = shape
    problem = sweep.Shape(b, h, length, d, causal, dtype)
    direction = "fwd+bwd" if backward else "fwd"
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, generator=generator).to(dtype).requires_grad_(backward)
               for _ in range(3))
    grad = torch.randn(b, h, length, d, generator=generator).to(dtype)
    wanted = ("cpu", "sdpa", "reference") if with_reference and b * h * length ** 2 <= REFERENCE_MAX_SCORES \
        else ("cpu", "sdpa")
    implementations = sweep.implementations(torch.device("cpu"), problem)
    calls = {name: sweep.runner(implementations[name], q, k, v, causal, direction, grad) for name in wanted}
    samples = timing.interleaved_samples(calls, rounds, budget_s=budget_s)
    ours = samples["cpu"]
    gemm_seconds = timing.interleaved_samples({"gemm": gemm_call}, len(ours))["gemm"]
    gemm_rate = statistics.median(gemm_call.flops / t for t in gemm_seconds)
    gflops = problem.flops(direction) / statistics.median(ours) / 1e9
    return {
        "rounds": len(ours),
        "cpu_ms": statistics.median(ours) * 1e3,
        "sdpa_ms": statistics.median(samples["sdpa"]) * 1e3,
        "vs_sdpa": timing.median_ratio(samples["sdpa"], ours),
        "vs_reference": timing.median_ratio(samples["reference"], ours) if "reference" in samples else None,
        "gflops": gflops,
        "gemm_fraction": gflops * 1e9 / gemm_rate,
    }


def gemm_dtype(dtype):
    """The dtype whose torch.mm rate is the cpu backend's limit: the call's own, or float32 where the kernels convert
    its operands to float (`cpu_kernels` says so; there, as on an AVX2-only CPU, torch.mm in bf16 is a slow
    reference path, and timing it took a minute a row)."""
    return torch.float32 if "converted to float" in torch.ops.fused_attn.cpu_kernels(dtype) else dtype


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
    print(report.machine_description(torch.device("cpu")))
    for dtype_name in args.dtypes:  # the kernels' instruction-set copy and what computes the products
        dtype = DTYPES[dtype_name]
        print(f"cpu backend, {dtype_name}: {torch.ops.fused_attn.cpu_kernels(dtype)} "
              f"(of GEMM: of torch.mm's {gemm_dtype(dtype)} rate)")
    print()
    print("| dtype | B | H | L | D | causal | pass | cpu ms | SDPA ms | ×SDPA (median of ratios) | target "
          "| ×reference | GFLOP/s | of GEMM | rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    shapes = ISSUE_SHAPES if args.shapes == "issue" else QUICK_SHAPES
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        gemm = gemm_call_for(gemm_dtype(dtype))
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
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds per row (at most)")
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
