"""`python -m bench.call_cost`: the fixed cost of a small call, `fused_attn.attention` against SDPA.

Small calls are where the Python between the public function and the kernel shows: at B=1, H=4,
L=64, D=32 the kernel takes tens of microseconds, and every microsecond of checks, backend choice
and allocation counts. Per row, `fused_attn.attention(q, k, v)` and
`torch.nn.functional.scaled_dot_product_attention(q, k, v)` run on the same inputs, interleaved in one
process (no autograd: the inputs do not require grad), each sample a loop of `--inner` calls, and the
table gives the median time of one call and the median over rounds of the ratio SDPA / fused
(> 1: fused_attn is faster; the target of the "small" call is ≥ 1). Two measures:

- wall: wall clock (`time.perf_counter`) at the default number of torch threads;
- cpu 1t: CPU time of the calling thread (`time.thread_time`) with one torch thread, which other jobs
  on the machine barely disturb (the kernels then run in the calling thread).

    python -m bench.call_cost [--dtypes fp32 bf16] [--rounds 41] [--inner 50]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

import fused_attn

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# name: (B, H, L_q, L_k, D). "small" is the call with a target (at least SDPA's speed); "decode" one
# generated token against a short cache; "tiny" a call with next to no arithmetic, whose time is the
# fixed cost alone.
SHAPES = {"small": (1, 4, 64, 64, 32), "decode": (1, 4, 1, 256, 32), "tiny": (1, 1, 1, 1, 8)}
# measure name: (clock, torch threads; None keeps the default)
MEASURES = {"wall": (time.perf_counter, None), "cpu 1t": (time.thread_time, 1)}


@contextlib.contextmanager
def torch_threads(count: int | None):
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def inputs(dtype, shape):
    batch, heads, len_q, len_k, dim = shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, len_q, dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, heads, len_k, dim, generator=generator).to(dtype) for _ in range(2))
    return q, k, v


def candidates(q, k, v, inner: int):
    """{name: a loop of `inner` calls}; both compute the same attention (checked by the caller)."""
    def fused():
        for _ in range(inner):
            fused_attn.attention(q, k, v)

    def sdpa():
        for _ in range(inner):
            F.scaled_dot_product_attention(q, k, v)

    return {"fused": fused, "sdpa": sdpa}


def time_row(dtype, shape, measure: str, rounds: int, inner: int, budget_s: float) -> dict:
    q, k, v = inputs(dtype, shape)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused_attn.attention(q, k, v), F.scaled_dot_product_attention(q, k, v),
                               rtol=tolerance, atol=tolerance)  # or the timing compares nothing
    clock, threads = MEASURES[measure]
    with torch_threads(threads):
        samples = timing.interleaved_samples(candidates(q, k, v, inner), rounds, warmup=2, budget_s=budget_s,
                                             clock=clock)
    return {
        "rounds": len(samples["fused"]),
        "fused_us": statistics.median(samples["fused"]) / inner * 1e6,
        "sdpa_us": statistics.median(samples["sdpa"]) / inner * 1e6,
        "vs_sdpa": timing.median_ratio(samples["sdpa"], samples["fused"]),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.call_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--measures", nargs="+", choices=list(MEASURES), default=list(MEASURES))
    parser.add_argument("--rounds", type=int, default=41, help="interleaved rounds per row (at most)")
    parser.add_argument("--inner", type=int, default=50, help="calls per sample")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per row before stopping early")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(report.machine_description(torch.device("cpu")))
    print()
    print("| dtype | shape | B, H, L_q, L_k, D | measure | fused µs | SDPA µs | SDPA / fused | target | rounds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        for shape_name in args.shapes:
            shape = SHAPES[shape_name]
            for measure in args.measures:
                row = time_row(DTYPES[dtype_name], shape, measure, args.rounds, args.inner, args.budget)
                verdict = "" if shape_name != "small" else "≥1 ok" if row["vs_sdpa"] >= 1.0 else "≥1 MISSED"
                print(f"| {dtype_name} | {shape_name} | {', '.join(map(str, shape))} | {measure} | "
                      f"{row['fused_us']:.1f} | {row['sdpa_us']:.1f} | {row['vs_sdpa']:.2f} | {verdict} | "
                      f"{row['rounds']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
