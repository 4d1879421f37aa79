"""`python -m bench.training_bench`: one training step of attention on the CPU, with dropout and
with a learned bias.

Dropout: forward + backward with `dropout_p` (default 0.1) at B=4, H=8, L=2048, D=64, fp32 and bf16,
three candidates interleaved in one process with the same inputs and threads: the `cpu` backend with
dropout, the same call without dropout, and `scaled_dot_product_attention` with the same
`dropout_p`. The table gives medians over rounds of the time ratios SDPA / cpu (target ≥ 2) and
cpu with dropout / cpu without (target ≤ 1.25), and peak memory of the step at a longer length
(torch's allocations, replayed from the profiler: the CPU allocator keeps no peak statistic).

Learned bias: the same step with an additive (1, H, L, L) mask that requires grad (gradients of q,
k, v and the bias), the `cpu` backend against `scaled_dot_product_attention` (target ≥ 1).

    python -m bench.training_bench [--dtypes fp32 bf16] [--length 2048] [--memory-length 8192]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import fused_attn

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def step(fn, q, k, v, grad):
    """A no-argument training step of `fn(q, k, v)`: forward, then the gradients of q, k, v."""
    def run():
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)
    return run


def candidates(dropout_p: float) -> dict:
    return {
        "cpu": lambda q, k, v: fused_attn.attention(q, k, v, dropout_p=dropout_p, backend="cpu"),
        "cpu_no_dropout": lambda q, k, v: fused_attn.attention(q, k, v, backend="cpu"),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p),
    }


def inputs(dtype, batch, heads, length, dim):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=generator).to(dtype).requires_grad_()
               for _ in range(3))
    return q, k, v, torch.randn(batch, heads, length, dim, generator=generator).to(dtype)


def time_row(dtype, shape, dropout_p, rounds, budget_s) -> dict:
    q, k, v, grad = inputs(dtype, *shape)
    runs = {name: step(fn, q, k, v, grad) for name, fn in candidates(dropout_p).items()}
    samples = timing.interleaved_samples(runs, rounds, budget_s=budget_s)
    return {
        "rounds": len(samples["cpu"]),
        **{f"{name}_ms": statistics.median(times) * 1e3 for name, times in samples.items()},
        "vs_sdpa": timing.median_ratio(samples["sdpa"], samples["cpu"]),
        "dropout_cost": timing.median_ratio(samples["cpu"], samples["cpu_no_dropout"]),
    }


def bias_row(dtype, shape, rounds, budget_s) -> dict:
    batch, heads, length, _ = shape
    q, k, v, grad = inputs(dtype, *shape)
    bias = torch.randn(1, heads, length, length, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias.requires_grad_()

    def run_with(fn):
        def run():
            out = fn(q, k, v, attn_mask=bias)
            return torch.autograd.grad(out, (q, k, v, bias), grad)
        return run
    runs = {"cpu": run_with(lambda *a, **kw: fused_attn.attention(*a, **kw, backend="cpu")),
            "sdpa": run_with(F.scaled_dot_product_attention)}
    samples = timing.interleaved_samples(runs, rounds, budget_s=budget_s)
    return {"rounds": len(samples["cpu"]), "cpu_ms": statistics.median(samples["cpu"]) * 1e3,
            "sdpa_ms": statistics.median(samples["sdpa"]) * 1e3,
            "vs_sdpa": timing.median_ratio(samples["sdpa"], samples["cpu"])}


def peak_mib(dtype, shape, dropout_p) -> dict:
    q, k, v, grad = inputs(dtype, *shape)
    found = {}
    for name, fn in candidates(dropout_p).items():
        if name == "cpu_no_dropout":
            continue
        found[name] = timing.peak_memory_bytes(step(fn, q, k, v, grad), torch.device("cpu")) / 2 ** 20
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.training_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--dropout-p", type=float, default=0.1)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--memory-length", type=int, default=8192, help="0 to skip the memory rows")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per row before stopping early")
    args = parser.parse_args(argv)
    print(report.machine_description(torch.device("cpu")))
    print(f"\nforward+backward, dropout_p={args.dropout_p}, B=4, H=8, L={args.length}, D=64\n")
    print("| dtype | cpu ms | cpu ms without dropout | SDPA ms | ×SDPA (target ≥ 2) "
          "| dropout cost (target ≤ 1.25) | rounds |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        row = time_row(DTYPES[name], (4, 8, args.length, 64), args.dropout_p, args.rounds, args.budget)
        print(f"| {name} | {row['cpu_ms']:.1f} | {row['cpu_no_dropout_ms']:.1f} | {row['sdpa_ms']:.1f} | "
              f"{row['vs_sdpa']:.2f} | {row['dropout_cost']:.2f} | {row['rounds']} |", flush=True)
    print(f"\nforward+backward with a learned (1, H, L, L) bias, B=4, H=8, L={args.length}, D=64\n")
    print("| dtype | cpu ms | SDPA ms | ×SDPA (target ≥ 1) | rounds |")
    print("|---|---|---|---|---|")
    for name in args.dtypes:
        row = bias_row(DTYPES[name], (4, 8, args.length, 64), args.rounds, args.budget)
        print(f"| {name} | {row['cpu_ms']:.1f} | {row['sdpa_ms']:.1f} | {row['vs_sdpa']:.2f} | {row['rounds']} |",
              flush=True)
    if args.memory_length:
        print(f"\npeak memory of the step, B=1, H=8, L={args.memory_length}, D=64 (MiB allocated by torch "
              "during the step, inputs excluded)\n")
        print("| dtype | cpu | SDPA |")
        print("|---|---|---|")
        for name in args.dtypes:
            found = peak_mib(DTYPES[name], (1, 8, args.memory_length, 64), args.dropout_p)
            print(f"| {name} | {found['cpu']:.1f} | {found['sdpa']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
