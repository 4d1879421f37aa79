"""`python -m bench.mask_bench`: mask programs on the CPU (fused_attn.masks) against the ways the same masks
run elsewhere, interleaved in one process with the same inputs and threads. B=1, H=8, D=64, L=8192 by default.

- documents: 8 causal documents of random lengths. Our call with the program, against our call and SDPA given
  the same mask as a dense bool tensor (targets ≥ 5× and ≥ 6×), and against FlexAttention compiled with its
  BlockMask (forward only: it has no CPU backward; target ≥ 3×).
- prefix_lm (prefix 1024) and chunks (1024, causal): the program's time over the work it keeps, measured by
  our plain causal call scaled by the program's visible fraction of the causal pairs (target ≤ 1.15).
- build: building the program (from a mask_mod, from `documents(ids)`, from a FlexAttention BlockMask) against one
  forward call (target < 10%), and its memory against a dense bool mask (target < 1/16).

    python -m bench.mask_bench [--dtypes fp32 bf16] [--length 8192] [--rounds 5] [--only documents build]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import fused_attn
from fused_attn import masks

from . import report, timing
from .variants_bench import DTYPES, print_rows, runner, tensors

HEADS, DIM, DOCUMENTS, PREFIX, CHUNK = 8, 64, 8, 1024, 1024


def document_ids(length: int, count: int = DOCUMENTS) -> torch.Tensor:
    """`count` documents of random lengths (fixed seed) over `length` tokens."""
    generator = torch.Generator().manual_seed(7)
    cuts = torch.sort(torch.randperm(length - 1, generator=generator)[:count - 1] + 1).values
    return torch.searchsorted(cuts, torch.arange(length), right=True)


def dense_of(mask_mod, length: int) -> torch.Tensor:
    """The (L, L) bool mask the dense calls are given."""
    index = torch.arange(length)
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, index[:, None], index[None, :])


def causal_pairs(length: int) -> int:
    return length * (length + 1) // 2


def compiled_flex(mask_mod, length: int):
    """torch.compile(flex_attention) with the mask's BlockMask, or None where FlexAttention cannot run."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    block_mask = create_block_mask(lambda b, h, q, kv: mask_mod(b, h, q, kv), None, None, length, length, device="cpu")
    flex = torch.compile(flex_attention)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def documents_candidates(length, backward):
    mask_mod = masks.documents(document_ids(length)) & masks.causal()
    program = masks.mask_program(mask_mod, len_q=length)
    dense = dense_of(mask_mod, length)
    candidates = {
        "program": lambda q, k, v: fused_attn.attention(q, k, v, attn_mask=program, backend="cpu"),
        "dense_mask": lambda q, k, v: fused_attn.attention(q, k, v, attn_mask=dense, backend="cpu"),
        "sdpa_mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dense),
    }
    if not backward:
        flex = compiled_flex(mask_mod, length)
        if flex is not None:
            candidates["flex_compiled"] = flex
    ratios = [("dense_mask", "program", "ours dense / program (target ≥ 5)"),
              ("sdpa_mask", "program", "SDPA dense / program (target ≥ 6)")]
    if "flex_compiled" in candidates:
        ratios.append(("flex_compiled", "program", "FlexAttention compiled / program (target ≥ 3)"))
    return candidates, ratios, {}


def kept_work_candidates(mask_mod, label):
    def make(length, backward):
        program = masks.mask_program(mask_mod, len_q=length)
        visible = int(program.dense().sum()) if length <= 8192 else None
        work = visible / causal_pairs(length)
        candidates = {
            label: lambda q, k, v: fused_attn.attention(q, k, v, attn_mask=program, backend="cpu"),
            "causal": lambda q, k, v: fused_attn.attention(q, k, v, is_causal=True, backend="cpu"),
        }
        return candidates, [(label, "causal", f"{label} / causal, over the kept work {work:.3f} (target ≤ 1.15)")], \
            {"work": work}
    return make


EXPERIMENTS = {
    "documents": documents_candidates,
    "prefix_lm": kept_work_candidates(masks.prefix_lm(PREFIX), "prefix_lm"),
    "chunks": kept_work_candidates(masks.chunks(CHUNK) & masks.causal(), "chunks"),
}


def measure(name, dtype, length, backward, rounds, budget_s):
    q, k, v, grad = tensors(dtype, 1, HEADS, length, length, DIM, requires_grad=backward)
    candidates, ratios, extra = EXPERIMENTS[name](length, backward)
    runs = {label: runner(fn, q, k, v, grad, backward) for label, fn in candidates.items()}
    samples = timing.interleaved_samples(runs, rounds, budget_s=budget_s)
    times = {label: statistics.median(values) * 1e3 for label, values in samples.items()}
    results = []
    for a, b, text in ratios:
        ratio = timing.median_ratio(samples[a], samples[b])
        results.append((text, ratio / extra["work"] if "work" in extra else ratio))
    return times, results, len(samples[next(iter(samples))])


def build_rows(length: int, rounds: int) -> list[str]:
    """Build times (median of `rounds`) against one fp32 forward of the program, and the program's memory."""
    ids = document_ids(length)
    causal_documents = masks.documents(ids) & masks.causal()

    def as_function(b, h, q_idx, kv_idx):  # the same mask as a plain mask_mod (tiles found from index ranges)
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    builds = {"documents(ids) & causal()": lambda: masks.mask_program(causal_documents, len_q=length),
              "mask_mod (documents, causal)": lambda: masks.mask_program(as_function, len_q=length)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask
        block_mask = create_block_mask(as_function, None, None, length, length, device="cpu")

        # A copy per round: the conversion is timed, not its cache (kept per BlockMask object).
        builds["FlexAttention BlockMask (converted)"] = lambda: masks.program_of_block_mask(copy.copy(block_mask))
        builds["create_block_mask itself"] = lambda: create_block_mask(as_function, None, None, length, length,
                                                                       device="cpu")
    except ImportError:
        pass
    program = builds["documents(ids) & causal()"]()
    q, k, v, _ = tensors(torch.float32, 1, HEADS, length, length, DIM, requires_grad=False)

    def forward():
        with torch.no_grad():
            fused_attn.attention(q, k, v, attn_mask=program, backend="cpu")

    rows = []
    forward_ms = median_ms(forward, rounds)
    for label, build in builds.items():
        ms = median_ms(build, rounds)
        rows.append(f"| {label} | {ms:.1f} | {forward_ms:.1f} | {ms / forward_ms:.3f} |")
    dense_bytes = length * length
    rows.append(f"\nprogram memory: {program.nbytes / 1024:.0f} KiB ({program.counts()}), a dense bool mask "
                f"{dense_bytes / 2 ** 20:.0f} MiB: {program.nbytes / dense_bytes:.4f} of it (target < 1/16)")
    return rows


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mask_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--only", nargs="+", choices=sorted(EXPERIMENTS) + ["build"],
                        default=list(EXPERIMENTS) + ["build"])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per row before stopping early")
    args = parser.parse_args(argv)
    print(report.machine_description(torch.device("cpu")))
    print(f"\nB=1, H={HEADS}, L={args.length}, D={DIM}")
    for name in args.only:
        if name == "build":
            print("\nbuild\n\n| program from | build (ms) | one forward (ms) | build / forward |\n|---|---|---|---|")
            print("\n".join(build_rows(args.length, args.rounds)), flush=True)
            continue
        print(f"\n{name}\n")
        print_rows(lambda dtype, backward: measure(name, dtype, args.length, backward, args.rounds, args.budget),
                   args.dtypes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
