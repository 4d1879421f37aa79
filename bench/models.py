"""`python -m bench.models`: a whole transformers model on fused_attn, against `sdpa` and `eager`.

A small Llama (GQA) built from its config with random weights, one copy per attention implementation,
run in one process with the same weights, inputs and threads, under inference mode:

- prefill: one forward over a prompt of `--length` tokens (logits of the last position only, as
  generation computes them), in tokens per second;
- decoding: `--new-tokens` greedy steps after that prompt, each one token against the key/value cache
  (a DynamicCache, cut back to the prompt before every round), in tokens per second.

On the CPU the implementations are timed interleaved, the order rotating per round (bench.timing);
the ratio column is the median over rounds of sdpa's time over the row's. On a GPU each is timed by
`triton.testing.do_bench`. Before timing, the greedy tokens of every implementation are compared with
sdpa's; the exit status is 1 if they differ in fp32. In bf16 and fp16 the implementations round
differently, and a greedy choice between two nearly equal logits may go either way (eager's choices
differ from sdpa's too): there the column informs and the tests (tests/test_transformers.py) judge.

    python -m bench.models [--length 2048] [--new-tokens 32] [--dtypes fp32 bf16] [--rounds 5]
                           [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from fused_attn.integrations import transformers as fused_transformers

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IMPLEMENTATIONS = ("sdpa", fused_transformers.DEFAULT_NAME, "eager")


def small_llama_config(max_positions: int) -> LlamaConfig:
    """A Llama of 8 query and 2 key/value heads of 64 dims, 4 layers: small enough for a CPU, with
    attention a large share of the work at a few thousand tokens."""
    return LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions)


def build_models(dtype, device, max_positions: int, implementations) -> dict:
    """{implementation: model}, all with the same random weights."""
    fused_transformers.register()
    torch.manual_seed(0)
    base = LlamaForCausalLM(small_llama_config(max_positions)).to(device=device, dtype=dtype).eval()
    models = {}
    for name in implementations:
        model = copy.deepcopy(base)
        model.set_attn_implementation(name)
        models[name] = model
    return models


def greedy_steps(model, cache, token, steps: int) -> list[int]:
    """`steps` greedy decoding steps from `token` (B, 1) onwards, appending to `cache`."""
    tokens = []
    for _ in range(steps):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(token[0, 0]))
    return tokens


def workloads(models: dict, prompt, new_tokens: int):
    """({name: prefill callable}, {name: decode callable}, {name: greedy tokens}); each decode callable
    cuts its cache back to the prompt first."""
    prefill, decode, tokens = {}, {}, {}
    for name, model in models.items():
        cache = DynamicCache(config=model.config)
        first = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        tokens[name] = [int(first[0, 0])] + greedy_steps(model, cache, first, new_tokens)

        def run_prefill(model=model):
            return model(prompt, use_cache=False, logits_to_keep=1)

        def run_decode(model=model, cache=cache, first=first):
            cache.crop(-new_tokens)  # back to the prompt: the previous round appended new_tokens
            return greedy_steps(model, cache, first, new_tokens)

        prefill[name], decode[name] = run_prefill, run_decode
    return prefill, decode, tokens


def measure(candidates: dict, device, rounds: int) -> tuple[dict, dict]:
    """({name: median seconds}, {name: median over rounds of sdpa's time / name's})."""
    if device.type == "cuda":
        seconds = {name: timing.gpu_median_seconds(fn) for name, fn in candidates.items()}
        return seconds, {name: seconds["sdpa"] / value for name, value in seconds.items()}
    samples = timing.interleaved_samples(candidates, rounds)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return medians, {name: timing.median_ratio(samples["sdpa"], values) for name, values in samples.items()}


def rows_for(dtype_name: str, length: int, new_tokens: int, rounds: int, device, implementations) -> list[dict]:
    dtype = DTYPES[dtype_name]
    with torch.inference_mode():
        models = build_models(dtype, device, length + new_tokens + 1, implementations)
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, models["sdpa"].config.vocab_size, (1, length), generator=generator).to(device)
        prefill, decode, tokens = workloads(models, prompt, new_tokens)
        rows = []
        for phase, candidates, count in (("prefill", prefill, length), ("decode", decode, new_tokens)):
            seconds, vs_sdpa = measure(candidates, device, rounds)
            for name in candidates:
                rows.append(dict(dtype=dtype_name, phase=phase, implementation=name, seconds=seconds[name],
                                 tokens_per_s=count / seconds[name], vs_sdpa=vs_sdpa[name],
                                 same_tokens=tokens[name] == tokens["sdpa"]))
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| dtype | phase | implementation | tokens/s | ms | sdpa time / this | greedy tokens = sdpa's |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['dtype']} | {row['phase']} | {row['implementation']} | {row['tokens_per_s']:.0f} | "
                     f"{row['seconds'] * 1e3:.1f} | {row['vs_sdpa']:.2f} | {'yes' if row['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy decoding steps timed per round")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None,
                        help="default: fp32 bf16 on cpu, bf16 fp16 on cuda")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds on cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS),
                        help="sdpa always runs: it is the baseline")
    args = parser.parse_args(argv)
    if args.length < 1 or args.new_tokens < 1 or args.rounds < 1:
        parser.error("--length, --new-tokens and --rounds: expected positive integers")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    dtypes = args.dtypes or (["bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"])
    implementations = ["sdpa"] + [name for name in args.implementations if name != "sdpa"]
    print(report.machine_description(device))
    print(f"\nsmall Llama (hidden 512, 8 query / 2 key-value heads of 64, 4 layers), batch 1, prompt "
          f"{args.length} tokens, {args.new_tokens} greedy steps\n")
    rows = []
    for dtype_name in dtypes:
        rows.extend(rows_for(dtype_name, args.length, args.new_tokens, args.rounds, device, implementations))
    print(format_rows(rows))
    return 0 if all(row["same_tokens"] for row in rows if row["dtype"] == "fp32") else 1


if __name__ == "__main__":
    raise SystemExit(main())
