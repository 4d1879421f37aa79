"""`python -m bench.variants_bench`: the score variants on the CPU (fused_attn.scores), each against the
call it should be measured by, interleaved in one process with the same inputs and threads.

- Sliding window (256, 0) at B=1, H=8, L=8192, D=64: against our own full causal call (target ≥ 5×)
  and against `scaled_dot_product_attention` given the equivalent boolean mask (target ≥ 10×).
- A narrow window, (128, 0) at L=4096: against our own full causal call (target ≥ 10×; the work ratio,
  L / 2W, is 16).
- Bottom-right causal at L_q=512, L_k=4096: against top-left causal at the same shape, and against
  the non-causal call, whose work it nearly has (top-left causal at L_q < L_k sees only the first L_q
  keys, ~15× less work here).
- Softcap (30) and ALiBi slopes at B=4, H=8, L=2048, D=64: against the plain call (target ≤ 1.15).
- Attention sinks (a learned logit per head, requiring grad) at B=4, H=8, L=2048, D=64: against the
  plain call (target ≤ 1.05); causal, as gpt-oss runs them.
- Padding passed as a bool attn_mask (B, 1, 1, L_k) at B=2, H=8, L=1024, D=64 (the second sequence
  right-padded to 700 keys): against SDPA given the same mask, and against our key_padding_mask.

Forward alone and forward+backward, fp32 and bf16. Medians over rounds of each time ratio.

    python -m bench.variants_bench [--dtypes fp32 bf16] [--rounds 5] [--only window narrow_window bottom_right cap_alibi]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import fused_attn

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tensors(dtype, batch, heads, len_q, len_k, dim, requires_grad):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, len_q, dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, heads, len_k, dim, generator=generator).to(dtype) for _ in range(2))
    grad = torch.randn(batch, heads, len_q, dim, generator=generator).to(dtype)
    return (*(t.requires_grad_(requires_grad) for t in (q, k, v)), grad)


def runner(fn, q, k, v, grad, backward):
    def run():
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad) if backward else out
    if not backward:
        def run_no_grad():
            with torch.no_grad():
                return fn(q, k, v)
        return run_no_grad
    return run


def window_candidates(len_q, len_k, left):
    cpu = dict(backend="cpu")
    distance = torch.arange(len_k)[None, :] - torch.arange(len_q)[:, None]
    band = (distance <= 0) & (distance >= -left)
    return {
        "window": lambda q, k, v: fused_attn.attention(q, k, v, window_size=(left, 0), **cpu),
        "causal": lambda q, k, v: fused_attn.attention(q, k, v, is_causal=True, **cpu),
        "sdpa_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, band),
    }


def alignment_candidates():
    cpu = dict(backend="cpu")
    return {
        "bottom_right": lambda q, k, v: fused_attn.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                                             **cpu),
        "top_left": lambda q, k, v: fused_attn.attention(q, k, v, is_causal=True, **cpu),
        "full": lambda q, k, v: fused_attn.attention(q, k, v, **cpu),
    }


def cap_alibi_candidates(heads):
    cpu = dict(backend="cpu")
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)  # BLOOM's slopes
    return {
        "softcap": lambda q, k, v: fused_attn.attention(q, k, v, softcap=30.0, **cpu),
        "alibi": lambda q, k, v: fused_attn.attention(q, k, v, alibi_slopes=slopes, **cpu),
        "plain": lambda q, k, v: fused_attn.attention(q, k, v, **cpu),
    }


def sink_candidates(heads):
    cpu = dict(backend="cpu", is_causal=True)
    # Requiring grad: the forward+backward rows include the sinks' own gradient.
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(1)).requires_grad_()
    return {
        "sinks": lambda q, k, v: fused_attn.attention(q, k, v, sinks=sinks, **cpu),
        "plain": lambda q, k, v: fused_attn.attention(q, k, v, **cpu),
    }


def padding_candidates(batch, length):
    cpu = dict(backend="cpu")
    valid = torch.tensor([length, 700])[:batch]
    attend = (torch.arange(length)[None, :] < valid[:, None])[:, None, None, :]
    return {
        "bool_mask": lambda q, k, v: fused_attn.attention(q, k, v, attend, **cpu),
        "key_padding": lambda q, k, v: fused_attn.attention(q, k, v, key_padding_mask=~attend[:, 0, 0], **cpu),
        "sdpa_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attend),
        "unpadded": lambda q, k, v: fused_attn.attention(q, k, v, **cpu),
    }


EXPERIMENTS = {
    # name: (shape B, H, L_q, L_k, D; candidates; [(numerator, denominator, label)])
    "window": ((1, 8, 8192, 8192, 64), lambda: window_candidates(8192, 8192, 256),
               [("causal", "window", "causal / window (target ≥ 5)"),
                ("sdpa_mask", "window", "SDPA with the band mask / window (target ≥ 10)")]),
    "narrow_window": ((1, 8, 4096, 4096, 64), lambda: window_candidates(4096, 4096, 128),
                      [("causal", "window", "causal / window (target ≥ 10, work ratio 16)")]),
    "bottom_right": ((4, 8, 512, 4096, 64), alignment_candidates,
                     [("top_left", "bottom_right", "top-left / bottom-right"),
                      ("full", "bottom_right", "non-causal / bottom-right")]),
    "cap_alibi": ((4, 8, 2048, 2048, 64), lambda: cap_alibi_candidates(8),
                  [("softcap", "plain", "softcap / plain (target ≤ 1.10)"),
                   ("alibi", "plain", "ALiBi / plain (target ≤ 1.15)")]),
    "sinks": ((4, 8, 2048, 2048, 64), lambda: sink_candidates(8),
              [("sinks", "plain", "sinks / plain (target ≤ 1.05)")]),
    "padding_mask": ((2, 8, 1024, 1024, 64), lambda: padding_candidates(2, 1024),
                     [("sdpa_mask", "bool_mask", "SDPA / bool mask"),
                      ("key_padding", "bool_mask", "key_padding_mask / bool mask"),
                      ("unpadded", "bool_mask", "no padding at all / bool mask (work ratio 1.19)")]),
}


def measure(name, dtype, backward, rounds, budget_s):
    shape, make, ratios = EXPERIMENTS[name]
    q, k, v, grad = tensors(dtype, *shape, requires_grad=backward)
    runs = {label: runner(fn, q, k, v, grad, backward) for label, fn in make().items()}
    samples = timing.interleaved_samples(runs, rounds, budget_s=budget_s)
    times = {label: statistics.median(values) * 1e3 for label, values in samples.items()}
    return times, [(text, timing.median_ratio(samples[a], samples[b])) for a, b, text in ratios], len(samples[
        next(iter(samples))])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.variants_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--only", nargs="+", choices=sorted(EXPERIMENTS), default=list(EXPERIMENTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per row before stopping early")
    args = parser.parse_args(argv)
    print(report.machine_description(torch.device("cpu")))
    for name in args.only:
        shape = EXPERIMENTS[name][0]
        print(f"\n{name}: B={shape[0]}, H={shape[1]}, L_q={shape[2]}, L_k={shape[3]}, D={shape[4]}\n")
        print_rows(lambda dtype, backward: measure(name, dtype, backward, args.rounds, args.budget), args.dtypes)
    return 0


def print_rows(measure_row, dtype_names) -> None:
    """The table of one experiment: a row per dtype and pass, `measure_row(dtype, backward)` giving its
    ({label: ms}, [(ratio text, value)], rounds)."""
    print("| dtype | pass | times (ms) | ratios | rounds |")
    print("|---|---|---|---|---|")
    for dtype_name in dtype_names:
        for backward in (False, True):
            times, ratios, rounds = measure_row(DTYPES[dtype_name], backward)
            print(f"| {dtype_name} | {'fwd+bwd' if backward else 'fwd'} | "
                  + ", ".join(f"{label} {ms:.1f}" for label, ms in times.items()) + " | "
                  + "; ".join(f"{text}: {value:.2f}" for text, value in ratios) + f" | {rounds} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
