"""`python -m bench.varlen_bench`: a packed batch of sequences of different lengths on the CPU.

Eight sequences of lengths drawn from 64…2048 (a fixed seed), H=8, D=64, interleaved in one process
with the same inputs and threads:

- `varlen`: `fused_attn.attention_varlen` on the packed (total, H, D) tensors;
- `padded`: `fused_attn.attention` on the batch padded to the longest sequence, the padding given as
  `key_padding_mask` (target: padded / varlen ≥ 1.2);
- `sdpa_padded`: `scaled_dot_product_attention` on the padded batch with the padding as a bool mask.

Non-causal and causal (padding on the right, so top-left causal is each sequence's own), forward
alone and forward+backward, fp32 and bf16; medians over rounds of each time ratio. The work ratio
Σ L_max·L_b / Σ L_b² (causal: of the visible scores) is printed beside each row.

    python -m bench.varlen_bench [--dtypes fp32 bf16] [--rounds 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import fused_attn

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH, HEADS, DIM, SHORTEST, LONGEST = 8, 8, 64, 64, 2048


def draw_lengths(seed: int) -> list[int]:
    return torch.randint(SHORTEST, LONGEST + 1, (BATCH,), generator=torch.Generator().manual_seed(seed)).tolist()


def work_ratio(lengths: list[int], causal: bool) -> float:
    """Scores the padded call computes over those the packed one does (padding skipped on keys only)."""
    longest = max(lengths)
    if causal:
        padded = sum(n * (n + 1) / 2 + (longest - n) * n for n in lengths)
        return padded / sum(n * (n + 1) / 2 for n in lengths)
    return sum(longest * n for n in lengths) / sum(n * n for n in lengths)


def padded_of(packed: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Packed (total, H, D) -> (B, H, L_max, D), zeros on the right of each sequence."""
    out = packed.new_zeros(len(lengths), packed.shape[1], max(lengths), packed.shape[2])
    for b, chunk in enumerate(packed.split(lengths)):
        out[b, :, :chunk.shape[0]] = chunk.transpose(0, 1)
    return out


def candidates(dtype, lengths, causal, backward):
    generator = torch.Generator().manual_seed(1)
    total = sum(lengths)
    q, k, v, grad = (torch.randn(total, HEADS, DIM, generator=generator).to(dtype) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded = [padded_of(t, lengths) for t in (q, k, v, grad)]
    padding = torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]
    attend = ~padding[:, None, None, :]
    if causal:
        attend = attend & torch.ones(max(lengths), max(lengths), dtype=torch.bool).tril()
    for t in (q, k, v, *padded[:3]):
        t.requires_grad_(backward)

    def run(fn, inputs, grad_out):
        if not backward:
            def forward():
                with torch.no_grad():
                    return fn(*inputs)
            return forward
        return lambda: torch.autograd.grad(fn(*inputs), inputs, grad_out)

    longest = max(lengths)
    return {
        "varlen": run(lambda q, k, v: fused_attn.attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=causal,
                                                                  backend="cpu"), (q, k, v), grad),
        "padded": run(lambda q, k, v: fused_attn.attention(q, k, v, is_causal=causal, key_padding_mask=padding,
                                                           backend="cpu"), padded[:3], padded[3]),
        "sdpa_padded": run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attend), padded[:3], padded[3]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.varlen_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per row before stopping early")
    args = parser.parse_args(argv)
    lengths = draw_lengths(args.seed)
    print(report.machine_description(torch.device("cpu")))
    print(f"\nB={BATCH} sequences of lengths {lengths} (total {sum(lengths)}), H={HEADS}, D={DIM}\n")
    print("| dtype | mask | pass | times (ms) | padded / varlen (target ≥ 1.2) | SDPA padded / varlen | work ratio | rounds |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes:
        for causal in (False, True):
            for backward in (False, True):
                runs = candidates(DTYPES[dtype_name], lengths, causal, backward)
                samples = timing.interleaved_samples(runs, args.rounds, budget_s=args.budget)
                times = ", ".join(f"{name} {statistics.median(values) * 1e3:.1f}" for name, values in samples.items())
                print(f"| {dtype_name} | {'causal' if causal else 'none'} | {'fwd+bwd' if backward else 'fwd'} | "
                      f"{times} | {timing.median_ratio(samples['padded'], samples['varlen']):.2f} | "
                      f"{timing.median_ratio(samples['sdpa_padded'], samples['varlen']):.2f} | "
                      f"{work_ratio(lengths, causal):.2f} | {len(samples['varlen'])} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
