"""`python -m bench.models`: a whole transformers model on fused_attn, against `sdpa` and `eager`.

A small model built from its config with random weights, one copy per attention implementation, run in
one process with the same weights, inputs and threads, under inference mode. `--model llama` (the
default): a small Llama (GQA); `--model gpt-oss`: gpt-oss scaled down to hidden 512 and 8 layers
(alternating sliding-window and full attention, attention sinks, a mixture of 4 experts), whose
baseline is `eager` (transformers' sdpa cannot run sinks). Each is timed for:

- prefill: one forward over a prompt of `--length` tokens (logits of the last position only, as
  generation computes them), in tokens per second;
- decoding: `--new-tokens` greedy steps after that prompt, each one token against the key/value cache
  (a DynamicCache, cut back to the prompt before every round), in tokens per second.

Two more rows run the `sdpa` model through fused_attn's routes for code that calls
`F.scaled_dot_product_attention`: `sdpa_redirect` inside `fused_attn.redirect_sdpa()` (a
TorchFunctionMode) and `sdpa_plugin` with fused_attn activated as PyTorch's flash-attention
implementation (`torch.nn.attention.activate_flash_attention_impl("fused_attn")`, which puts our
kernels under SDPA's flash operator). Each timed call enters its route and leaves it (for the plug-in:
activation and restore, well under a millisecond), so the other rows run on PyTorch's kernels.

On the CPU the implementations are timed interleaved, the order rotating per round (bench.timing);
the ratio column is the median over rounds of sdpa's time over the row's; the line under the table
gives the median over rounds of sdpa_redirect's time over sdpa_plugin's. On a GPU each is timed by
`triton.testing.do_bench`. Before timing, the greedy tokens of every implementation are compared with
sdpa's; the exit status is 1 if they differ in fp32. In bf16 and fp16 the implementations round
differently, and a greedy choice between two nearly equal logits may go either way (eager's choices
differ from sdpa's too): there the column informs and the tests (tests/test_transformers.py) judge.

    python -m bench.models [--length 2048] [--new-tokens 32] [--dtypes fp32 bf16] [--rounds 5]
                           [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics

import torch
from transformers import DynamicCache, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

import fused_attn
from fused_attn.integrations import transformers as fused_transformers

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def sdpa_plugin():
    """fused_attn active as PyTorch's flash-attention implementation, within the block."""
    torch.nn.attention.activate_flash_attention_impl("fused_attn")
    try:
        yield
    finally:
        torch.nn.attention.restore_flash_attention_impl()


# The `sdpa` model run inside fused_attn's routes for F.scaled_dot_product_attention.
ROUTES = {"sdpa_redirect": fused_attn.redirect_sdpa, "sdpa_plugin": sdpa_plugin}
IMPLEMENTATIONS = ("sdpa", fused_transformers.DEFAULT_NAME, "eager", *ROUTES)


def small_gpt_oss_config(max_positions: int) -> GptOssConfig:
    """gpt-oss scaled down: 8 query and 2 key/value heads of 64 dims, 8 layers alternating a 128-key
    sliding window and full attention, sinks in every layer, 4 experts of which 2 per token."""
    return GptOssConfig(vocab_size=8192, hidden_size=512, intermediate_size=512, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=128, max_position_embeddings=max_positions,
                        layer_types=["sliding_attention", "full_attention"] * 4)


# --model: (config, model class, the baseline implementation, the implementations it runs).
MODELS = {
    "llama": (lambda n: small_llama_config(n), LlamaForCausalLM, "sdpa", IMPLEMENTATIONS),
    "gpt-oss": (small_gpt_oss_config, GptOssForCausalLM, "eager", (fused_transformers.DEFAULT_NAME, "eager")),
}


def small_llama_config(max_positions: int) -> LlamaConfig:
    """A Llama of 8 query and 2 key/value heads of 64 dims, 4 layers: small enough for a CPU, with
    attention a large share of the work at a few thousand tokens."""
    return LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions)


def build_models(dtype, device, max_positions: int, implementations, model: str = "llama") -> dict:
    """{implementation: model}, all with the same random weights."""
    fused_transformers.register()
    torch.manual_seed(0)
    config, model_class = MODELS[model][:2]
    base = model_class(config(max_positions)).to(device=device, dtype=dtype).eval()
    models = {}
    for name in implementations:
        model = copy.deepcopy(base)
        model.set_attn_implementation("sdpa" if name in ROUTES else name)
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
        route = ROUTES.get(name, contextlib.nullcontext)
        cache = DynamicCache(config=model.config)
        # Sliding-window layers (gpt-oss) keep their past, so that every round can cut back to the prompt.
        cache.activate_past_recording()
        with route():
            first = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
            tokens[name] = [int(first[0, 0])] + greedy_steps(model, cache, first, new_tokens)

        def run_prefill(model=model, route=route):
            with route():
                return model(prompt, use_cache=False, logits_to_keep=1)

        def run_decode(model=model, cache=cache, first=first, route=route):
            cache.crop(-new_tokens)  # back to the prompt: the previous round appended new_tokens
            with route():
                return greedy_steps(model, cache, first, new_tokens)

        prefill[name], decode[name] = run_prefill, run_decode
    return prefill, decode, tokens


def measure(candidates: dict, device, rounds: int) -> dict:
    """{name: seconds}: one sample per round on the CPU (interleaved), the median on a GPU, as a list
    of one; medians and `timing.median_ratio` read both alike."""
    if device.type == "cuda":
        return {name: [timing.gpu_median_seconds(fn)] for name, fn in candidates.items()}
    return timing.interleaved_samples(candidates, rounds)


def rows_for(dtype_name: str, length: int, new_tokens: int, rounds: int, device, implementations,
             model: str = "llama") -> list[dict]:
    dtype = DTYPES[dtype_name]
    baseline = MODELS[model][2]
    with torch.inference_mode():
        models = build_models(dtype, device, length + new_tokens + 1, implementations, model)
        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, models[baseline].config.vocab_size, (1, length), generator=generator).to(device)
        prefill, decode, tokens = workloads(models, prompt, new_tokens)
        rows = []
        for phase, candidates, count in (("prefill", prefill, length), ("decode", decode, new_tokens)):
            samples = measure(candidates, device, rounds)
            for name in candidates:
                seconds = statistics.median(samples[name])
                row = dict(dtype=dtype_name, phase=phase, implementation=name, seconds=seconds,
                           tokens_per_s=count / seconds, baseline=baseline,
                           vs_baseline=timing.median_ratio(samples[baseline], samples[name]),
                           same_tokens=tokens[name] == tokens[baseline])
                if name == "sdpa_plugin" and "sdpa_redirect" in samples:
                    row["redirect_over_plugin"] = timing.median_ratio(samples["sdpa_redirect"], samples[name])
                rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    baseline = rows[0]["baseline"] if rows else "sdpa"
    lines = [f"| dtype | phase | implementation | tokens/s | ms | {baseline} time / this | greedy tokens = "
             f"{baseline}'s |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['dtype']} | {row['phase']} | {row['implementation']} | {row['tokens_per_s']:.0f} | "
                     f"{row['seconds'] * 1e3:.1f} | {row['vs_baseline']:.2f} | "
                     f"{'yes' if row['same_tokens'] else 'NO'} |")
    routes = [f"{row['dtype']} {row['phase']} {row['redirect_over_plugin']:.2f}" for row in rows
              if "redirect_over_plugin" in row]
    if routes:
        lines.append("\nsdpa_redirect time / sdpa_plugin time (median over rounds; > 1: the plug-in is faster): "
                     + ", ".join(routes))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy decoding steps timed per round")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None,
                        help="default: fp32 bf16 on cpu, bf16 fp16 on cuda")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds on cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=None,
                        help="default: all the model runs; its baseline (sdpa, or eager for gpt-oss) always runs")
    args = parser.parse_args(argv)
    if args.length < 1 or args.new_tokens < 1 or args.rounds < 1:
        parser.error("--length, --new-tokens and --rounds: expected positive integers")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    dtypes = args.dtypes or (["bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"])
    _, _, baseline, runs = MODELS[args.model]
    requested = args.implementations or runs
    if unknown := [name for name in requested if name not in runs]:
        parser.error(f"--implementations: {args.model} runs {', '.join(runs)}, not {', '.join(unknown)}")
    implementations = [baseline] + [name for name in requested if name != baseline]
    print(report.machine_description(device))
    shape = ("small Llama (hidden 512, 8 query / 2 key-value heads of 64, 4 layers)" if args.model == "llama" else
             "small gpt-oss (hidden 512, 8 query / 2 key-value heads of 64, 8 layers alternating a 128-key window "
             "and full attention, sinks, 4 experts)")
    print(f"\n{shape}, batch 1, prompt {args.length} tokens, {args.new_tokens} greedy steps\n")
    rows = []
    for dtype_name in dtypes:
        rows.extend(rows_for(dtype_name, args.length, args.new_tokens, args.rounds, device, implementations,
                             args.model))
    print(format_rows(rows))
    return 0 if all(row["same_tokens"] for row in rows if row["dtype"] == "fp32") else 1


if __name__ == "__main__":
    raise SystemExit(main())
