"""`python -m bench.decode_bench`: generation's attention on the CPU, a few queries against a long cache.

Per row, interleaved in one process with the same inputs and threads (inference, no autograd): the
`cpu` backend, `scaled_dot_product_attention` (with `enable_gqa` where H_q > H_kv), the `cpu` backend's
long-query kernels on the same call (FUSED_ATTN_CPU_DECODE=0, the path before the decode kernels),
and `dst.copy_(src)` of a buffer the size of K and V, `dst` allocated beforehand: the time the
memory takes to move the bytes the call must read. The table gives the medians over rounds of the
time ratios SDPA / cpu (targets: 1.5 at B=1, H_q=32, H_kv=8, L_k=4096; 1.3 at B=4, H=32, L_k=2048)
and cpu / copy (target ≤ 2), and K/V bytes read per second by the call and by the copy. Then the same
calls over 8-bit caches (float8_e4m3fn and int8, per-sequence and per-token scales, bf16 queries),
read in place by `forward_paged`, against the bf16 cache's call of the first table (target: 1.6× faster)
and against a copy of their own bytes (target: read at ≥ 60 % of the copy's rate). Then the same steps through
a model's depth: layers with caches of their own, together twice the CPU's last-level cache, so that each is read
from memory as in serving (the tables before read one cache again and again, from the last-level cache where it
fits), with a paged bf16 cache against the same rows dense. Then one generation step and one chunk of a prefill
through `attention_with_kvcache` against SDPA over the same keys, dense and paged (target: paged within 10 % of
dense).

    python -m bench.decode_bench [--dtypes fp32 bf16] [--caches fp8 int8] [--rounds 30] [--layers N]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics

import torch
import torch.nn.functional as F

import fused_attn
from fused_attn import quantization, testing
from fused_attn.backends import registry

from . import report, timing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CACHES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
PREFILL_CHUNK = 512  # tokens appended at once in the prefill row of attention_with_kvcache
PAGED_BLOCK = 16  # keys per cache block of the paged rows
# (B, H_q, H_kv, L_q, L_k, D)
SHAPES = [(1, 32, 8, 1, 4096, 128), (4, 32, 32, 1, 2048, 128), (1, 32, 8, 4, 4096, 128)]


@contextlib.contextmanager
def long_query_kernels():
    """The cpu backend without its decode path, read by the extension at every call."""
    before = os.environ.get("FUSED_ATTN_CPU_DECODE")
    os.environ["FUSED_ATTN_CPU_DECODE"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["FUSED_ATTN_CPU_DECODE"]
        else:
            os.environ["FUSED_ATTN_CPU_DECODE"] = before


def candidates(q, k, v):
    gqa = q.shape[1] != k.shape[1]
    kv = torch.cat([k.flatten(), v.flatten()])
    destination = torch.empty_like(kv)

    def without_decode():
        with long_query_kernels():
            return fused_attn.attention(q, k, v, enable_gqa=gqa, backend="cpu")

    return {
        "cpu": lambda: fused_attn.attention(q, k, v, enable_gqa=gqa, backend="cpu"),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
        "cpu_long_query": without_decode,
        "copy": lambda: destination.copy_(kv),
    }


def time_row(dtype, shape, rounds, budget_s) -> dict:
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads_q, len_q, dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, heads_kv, len_k, dim, generator=generator).to(dtype) for _ in range(2))
    kv_bytes = 2 * k.numel() * k.element_size()
    with torch.inference_mode():
        samples = timing.interleaved_samples(candidates(q, k, v), rounds, warmup=3, budget_s=budget_s)
    times = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "rounds": len(samples["cpu"]),
        **{f"{name}_us": seconds * 1e6 for name, seconds in times.items()},
        "vs_sdpa": timing.median_ratio(samples["sdpa"], samples["cpu"]),
        "vs_long_query": timing.median_ratio(samples["cpu_long_query"], samples["cpu"]),
        "over_copy": timing.median_ratio(samples["cpu"], samples["copy"]),
        "cpu_gb_s": kv_bytes / times["cpu"] / 1e9,
        "copy_gb_s": kv_bytes / times["copy"] / 1e9,
    }


def quantized_cache(values, cache_dtype, per_token):
    """`values` (B, H_kv, L_k, D) as attention_with_kvcache stores them in an 8-bit cache: a (B, L_k, H_kv, D)
    buffer, passed to forward_paged as one block of L_k keys per sequence, and its scales, per token (B, L_k, H_kv)
    or per sequence and head (B, H_kv)."""
    tokens = values.transpose(1, 2).float()
    if per_token:
        scales = quantization.token_scales(tokens, cache_dtype)
        dense_scales = scales
    else:
        scales = values.abs().amax(dim=(2, 3)).float() / quantization.LARGEST[cache_dtype]
        dense_scales = scales[:, None, :].expand(tokens.shape[:3])
    return quantization.quantize(tokens, dense_scales, cache_dtype), scales


def paged_call(q, k, v, cache_dtype, per_token=False, block_size=None, generator=None):
    """(the cpu backend's call over k and v as a (blocks, block size, H_kv, D) cache, read in place by forward_paged,
    checked once against the reference over the dequantized cache by the criterion; the bytes that call reads,
    values and scales). cache_dtype: bf16 (k and v as they are) or an 8-bit dtype; block_size: the keys of a cache
    block, the blocks in an order `generator` shuffles (per-sequence scales then), or one block a sequence."""
    batch, heads_q, len_q, dim = q.shape
    len_k = k.shape[2]
    if cache_dtype == torch.bfloat16:
        (k_blocks, k_scale), (v_blocks, v_scale) = ((x.transpose(1, 2).contiguous(), None) for x in (k, v))
    else:
        (k_blocks, k_scale), (v_blocks, v_scale) = (quantized_cache(x, cache_dtype, per_token) for x in (k, v))
    table = torch.arange(batch, dtype=torch.int32)[:, None]
    if block_size is not None:
        assert not per_token, "shuffled blocks take per-sequence scales"
        assert len_k % block_size == 0, f"{len_k} keys do not fill blocks of {block_size}"
        per_sequence = len_k // block_size
        table = torch.randperm(batch * per_sequence, generator=generator).view(batch, per_sequence).int()

        def shuffled(tokens):  # (B, L_k, H_kv, D) into the blocks the table names
            blocks = torch.empty(batch * per_sequence, block_size, *tokens.shape[2:], dtype=tokens.dtype)
            blocks[table.long()] = tokens.unflatten(1, (per_sequence, block_size))
            return blocks

        k_blocks, v_blocks = shuffled(k_blocks), shuffled(v_blocks)
    padding = torch.zeros(batch, len_k, dtype=torch.bool)  # every key is a sequence's: forward_paged takes the mask
    out = torch.empty(batch, heads_q, len_q, dim, dtype=torch.bfloat16)
    cpu, reference = registry.get("cpu"), registry.get("reference")

    def call():
        return cpu.forward_paged(q, k_blocks, v_blocks, table, None, padding, False, dim ** -0.5, out,
                                 k_scale=k_scale, v_scale=v_scale)

    with torch.inference_mode():
        # The same attention as the reference's over the dequantized cache, by the criterion, or the timing
        # compares nothing.
        call()
        results = {}
        for dtype in (torch.float64, torch.bfloat16):
            expected = torch.empty(out.shape, dtype=dtype)
            plain = k_scale is None  # a bf16 cache, read by the reference in the query's dtype
            reference.forward_paged(q.to(dtype), k_blocks.to(dtype) if plain else k_blocks,
                                    v_blocks.to(dtype) if plain else v_blocks, table, None, padding, False, dim ** -0.5,
                                    expected, k_scale=k_scale, v_scale=v_scale)
            results[dtype] = expected
    allowed = testing.allowed_error("out", results[torch.float64], results[torch.bfloat16], torch.bfloat16)
    error = testing.max_error(out, results[torch.float64])
    assert error <= allowed, f"{cache_dtype} cache: error {error:.3e} > allowed {allowed:.3e}"
    parts = [t for t in (k_blocks, v_blocks, k_scale, v_scale) if t is not None]
    return call, torch.cat([t.flatten().view(torch.int8) for t in parts])


def bf16_inputs(shape, generator):
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    q = torch.randn(batch, heads_q, len_q, dim, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(batch, heads_kv, len_k, dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def quantized_row(cache_dtype, per_token, shape, rounds, budget_s) -> dict:
    """The cpu backend's call over an 8-bit cache (bf16 queries), interleaved with the same call over the bf16
    cache of time_row and with a copy of the 8-bit call's bytes (values and scales), `dst` allocated beforehand."""
    q, k, v = bf16_inputs(shape, torch.Generator().manual_seed(0))
    call, read = paged_call(q, k, v, cache_dtype, per_token)
    destination = torch.empty_like(read)
    gqa = q.shape[1] != k.shape[1]
    runs = {
        "cpu": call,
        "bf16": lambda: fused_attn.attention(q, k, v, enable_gqa=gqa, backend="cpu"),
        "copy": lambda: destination.copy_(read),
    }
    with torch.inference_mode():
        samples = timing.interleaved_samples(runs, rounds, warmup=3, budget_s=budget_s)
    times = {name: statistics.median(values) for name, values in samples.items()}
    return {"rounds": len(samples["cpu"]), **{f"{name}_us": seconds * 1e6 for name, seconds in times.items()},
            "vs_bf16": timing.median_ratio(samples["bf16"], samples["cpu"]),
            "over_copy": timing.median_ratio(samples["cpu"], samples["copy"]),
            "cpu_gb_s": read.numel() / times["cpu"] / 1e9, "copy_gb_s": read.numel() / times["copy"] / 1e9,
            "copy_share": timing.median_ratio(samples["copy"], samples["cpu"])}


def last_level_cache_bytes() -> int:
    """The size of the CPU's largest cache as sysfs gives it for CPU 0 (0 where it gives none)."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as file:
            text = file.read().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=0)


def layers_past_cache(layer_bytes, cache_bytes) -> int:
    """As many layers as make their caches at least twice the last-level cache (two at the least), so that each
    layer's is read from memory, as in a model whose layers' caches together exceed it."""
    return max(2, -(-2 * cache_bytes // layer_bytes))


def depth_row(shape, layers, rounds, budget_s) -> dict:
    """One generation step through `layers` layers, each with caches of its own: a bf16 cache of time_row's kind, and
    the same keys and values as int8 and fp8 caches (per-sequence scales); each candidate runs once per layer, layer
    after layer, so each layer's cache is read after the others' have passed through the caches of the CPU.
    Interleaved: the cpu backend over each cache, SDPA over the bf16 one, the bf16 cache as (B, L_k, H_kv, D) rows
    (`rows`: the layout of attention_with_kvcache's dense caches) and as shuffled blocks of PAGED_BLOCK keys
    (`paged`), both through forward_paged, and copies of each layer's bf16 bytes and 8-bit bytes (fp8's; int8's are
    as many) into one preallocated destination each. Times are per layer."""
    generator = torch.Generator().manual_seed(0)
    q = bf16_inputs(shape, generator)[0]
    gqa = shape[1] != shape[2]
    steps = {name: [] for name in ("bf16", "sdpa", "int8", "fp8", "bf16_rows", "bf16_paged", "copy_bf16", "copy_8bit")}
    destinations = None  # (bf16 bytes, 8-bit bytes): one preallocated pair that every layer's copies write
    for _layer in range(layers):
        k, v = bf16_inputs(shape, generator)[1:]
        kv = torch.cat([k.flatten(), v.flatten()])
        steps["bf16"].append(lambda k=k, v=v: fused_attn.attention(q, k, v, enable_gqa=gqa, backend="cpu"))
        steps["sdpa"].append(lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa))
        for name in ("int8", "fp8"):
            call, bytes_read = paged_call(q, k, v, CACHES[name])
            steps[name].append(call)
        for name, block_size in (("bf16_rows", None), ("bf16_paged", PAGED_BLOCK)):
            steps[name].append(paged_call(q, k, v, torch.bfloat16, block_size=block_size, generator=generator)[0])
        destinations = destinations or (torch.empty_like(kv), torch.empty_like(bytes_read))
        steps["copy_bf16"].append(lambda src=kv, dst=destinations[0]: dst.copy_(src))
        steps["copy_8bit"].append(lambda src=bytes_read, dst=destinations[1]: dst.copy_(src))
    runs = {name: (lambda calls=calls: [call() for call in calls]) for name, calls in steps.items()}
    with torch.inference_mode():
        samples = timing.interleaved_samples(runs, rounds, warmup=2, budget_s=budget_s)
    seconds = {name: statistics.median(values) / layers for name, values in samples.items()}
    bytes_bf16, bytes_8bit = destinations[0].numel() * 2, destinations[1].numel()
    return {"rounds": len(samples["bf16"]), **{f"{name}_us": t * 1e6 for name, t in seconds.items()},
            "vs_sdpa": timing.median_ratio(samples["sdpa"], samples["bf16"]),
            **{f"{name}_vs_bf16": timing.median_ratio(samples["bf16"], samples[name]) for name in ("int8", "fp8")},
            "paged_vs_rows": timing.median_ratio(samples["bf16_paged"], samples["bf16_rows"]),
            "bf16_copy_share": timing.median_ratio(samples["copy_bf16"], samples["bf16"]),
            **{f"{name}_copy_share": timing.median_ratio(samples["copy_8bit"], samples[name])
               for name in ("int8", "fp8")},
            "bf16_gb_s": bytes_bf16 / seconds["bf16"] / 1e9, "copy_bf16_gb_s": bytes_bf16 / seconds["copy_bf16"] / 1e9,
            "copy_8bit_gb_s": bytes_8bit / seconds["copy_8bit"] / 1e9}


def kvcache_row(dtype, rounds, budget_s, batch=1, heads_q=32, heads_kv=8, capacity=4096, length=4000, dim=128,
                block_size=PAGED_BLOCK, appended=1):
    """One step through `attention_with_kvcache` (append `appended` tokens, attend over the sequence, causally:
    one token is a generation step, more a chunk of a prefill) against SDPA over the same sequence, already
    appended, sliced from the cache (with the causal mask aligned to its end where more than one token is
    appended); the same step over a paged copy of the cache (blocks of `block_size` keys in a shuffled order),
    read in place, and over that copy's blocks gathered into a dense cache first (what a backend without a
    block table does)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads_q, appended, dim, generator=generator).to(dtype)
    k_buffer, v_buffer = (torch.randn(batch, capacity, heads_kv, dim, generator=generator).to(dtype) for _ in range(2))
    k_cache, v_cache = k_buffer.transpose(1, 2), v_buffer.transpose(1, 2)
    k_new, v_new = (torch.randn(batch, heads_kv, appended, dim, generator=generator).to(dtype) for _ in range(2))
    before = torch.full((batch,), length - appended, dtype=torch.int32)
    k_valid, v_valid = k_cache[:, :, :length], v_cache[:, :, :length]
    causal = None
    if appended > 1:  # query i is token length - appended + i: it sees the keys up to itself
        causal = torch.arange(length)[None, :] <= torch.arange(appended)[:, None] + (length - appended)
    max_blocks = capacity // block_size
    block_table = torch.randperm(batch * max_blocks, generator=generator).view(batch, max_blocks).int()
    k_blocks, v_blocks = (torch.empty(batch * max_blocks, block_size, heads_kv, dim, dtype=dtype) for _ in range(2))
    k_blocks[block_table.long()] = k_buffer.unflatten(1, (max_blocks, block_size))
    v_blocks[block_table.long()] = v_buffer.unflatten(1, (max_blocks, block_size))

    def gathered():
        keys, values = (blocks[block_table.long()].flatten(1, 2).transpose(1, 2) for blocks in (k_blocks, v_blocks))
        return fused_attn.attention_with_kvcache(q, keys, values, k_new, v_new, cache_seqlens=before, backend="cpu")

    runs = {
        "kvcache": lambda: fused_attn.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=before,
                                                             backend="cpu"),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k_valid, v_valid, attn_mask=causal, enable_gqa=True),
        "paged": lambda: fused_attn.attention_with_kvcache(q, k_blocks, v_blocks, k_new, v_new, cache_seqlens=before,
                                                           block_table=block_table, backend="cpu"),
        "gathered": gathered,
    }
    with torch.inference_mode():
        # The same attention, or the timing compares nothing: each step (the first appends the token to
        # every cache) by the project's criterion against SDPA over the appended keys in float64. Not
        # against each other: bf16 weights rounded per key block differ with the blocks' sizes.
        results = {name: runs[name]() for name in ("kvcache", "paged", "gathered")}
        exact = F.scaled_dot_product_attention(q.double(), k_valid.double(), v_valid.double(), attn_mask=causal,
                                               enable_gqa=True)
        allowed = testing.allowed_error("out", exact, runs["sdpa"](), dtype)
        for name, out in results.items():
            error = testing.max_error(out, exact)
            assert error <= allowed, f"{name}: error {error:.3e} > allowed {allowed:.3e}"
        samples = timing.interleaved_samples(runs, rounds, warmup=3, budget_s=budget_s)
    return {"rounds": len(samples["sdpa"]), **{f"{name}_us": statistics.median(samples[name]) * 1e6 for name in runs},
            "vs_sdpa": timing.median_ratio(samples["sdpa"], samples["kvcache"]),
            "paged_vs_dense": timing.median_ratio(samples["paged"], samples["kvcache"]),
            "gathered_vs_paged": timing.median_ratio(samples["gathered"], samples["paged"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--caches", nargs="*", choices=sorted(CACHES), default=["fp8", "int8"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per row before stopping early")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the model-depth table (default: enough that their caches are twice the "
                             "last-level cache; 0: no such table)")
    args = parser.parse_args(argv)
    print(report.machine_description(torch.device("cpu")))
    print()
    print("| dtype | B, H_q, H_kv, L_q, L_k, D | cpu µs | SDPA µs | long-query µs | copy µs | SDPA / cpu "
          "| long-query / cpu | cpu / copy | K/V read GB/s (cpu, copy) | rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        for shape in SHAPES:
            row = time_row(DTYPES[name], shape, args.rounds, args.budget)
            print(f"| {name} | {', '.join(map(str, shape))} | {row['cpu_us']:.0f} | {row['sdpa_us']:.0f} | "
                  f"{row['cpu_long_query_us']:.0f} | {row['copy_us']:.0f} | {row['vs_sdpa']:.2f} | "
                  f"{row['vs_long_query']:.2f} | {row['over_copy']:.2f} | {row['cpu_gb_s']:.1f}, "
                  f"{row['copy_gb_s']:.1f} | {row['rounds']} |", flush=True)
    if args.caches:
        print()
        print("8-bit caches, bf16 queries, (B, L_k, H_kv, D) buffers read in place (forward_paged), against the bf16 "
              "cache's call above and a copy of the call's bytes (8-bit values and float32 scales):")
        print()
        print("| cache | scales | B, H_q, H_kv, L_q, L_k, D | cpu µs | bf16 cache µs | copy µs | bf16 cache / cpu "
              "| cpu / copy | bytes read GB/s (cpu, copy) | share of the copy's rate | rounds |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name in args.caches:
            for shape in SHAPES:
                for per_token in (False, True):
                    row = quantized_row(CACHES[name], per_token, shape, args.rounds, args.budget)
                    print(f"| {name} | {'token' if per_token else 'sequence'} | {', '.join(map(str, shape))} | "
                          f"{row['cpu_us']:.0f} | {row['bf16_us']:.0f} | {row['copy_us']:.0f} | {row['vs_bf16']:.2f} | "
                          f"{row['over_copy']:.2f} | {row['cpu_gb_s']:.1f}, {row['copy_gb_s']:.1f} | "
                          f"{row['copy_share']:.2f} | {row['rounds']} |", flush=True)
    if args.layers != 0:
        cache_bytes = last_level_cache_bytes()
        print()
        print(f"A step through a model's layers, each with caches of its own, bf16 queries; the last-level cache is "
              f"{cache_bytes / 2 ** 20:.0f} MiB, and each layer's caches are read from memory, as in serving, where "
              f"every layer's cache is read once a token (per layer: µs, and the median ratios of the interleaved "
              f"rounds):")
        print()
        print("| B, H_q, H_kv, L_q, L_k, D | layers | bf16 cache µs | SDPA µs | int8 µs | fp8 µs | SDPA / bf16 cache | "
              "bf16 cache / int8 | bf16 cache / fp8 | bf16 paged / rows | share of the copy's rate: bf16, int8, fp8 | "
              "copy GB/s: bf16, 8-bit | rounds |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for shape in SHAPES[:2]:
            batch, _, heads_kv, _, len_k, dim = shape
            layers = args.layers or layers_past_cache(2 * batch * heads_kv * len_k * dim * 2, cache_bytes)
            row = depth_row(shape, layers, args.rounds, args.budget)
            print(f"| {', '.join(map(str, shape))} | {layers} | {row['bf16_us']:.0f} | {row['sdpa_us']:.0f} | "
                  f"{row['int8_us']:.0f} | {row['fp8_us']:.0f} | {row['vs_sdpa']:.2f} | {row['int8_vs_bf16']:.2f} | "
                  f"{row['fp8_vs_bf16']:.2f} | {row['paged_vs_rows']:.2f} | {row['bf16_copy_share']:.2f}, "
                  f"{row['int8_copy_share']:.2f}, {row['fp8_copy_share']:.2f} | {row['copy_bf16_gb_s']:.1f}, "
                  f"{row['copy_8bit_gb_s']:.1f} | {row['rounds']} |", flush=True)
    print()
    print(f"attention_with_kvcache, B=1, H_q=32, H_kv=8, D=128, one token (a generation step) or {PREFILL_CHUNK} (a "
          "chunk of a prefill, causal) appended to the rest of 4000 keys in a 4096-key cache (a (B, L_max, H_kv, D) "
          "buffer), against SDPA over the 4000 keys sliced from it; the same step over a paged copy (16-key blocks, "
          "shuffled), read in place and gathered first:")
    print()
    print("| dtype | appended | kvcache µs | SDPA µs | SDPA / kvcache | paged µs | paged / dense | gathered µs "
          "| gathered / paged | rounds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for appended in (1, PREFILL_CHUNK):
        for name in args.dtypes:
            row = kvcache_row(DTYPES[name], args.rounds, args.budget, appended=appended)
            print(f"| {name} | {appended} | {row['kvcache_us']:.0f} | {row['sdpa_us']:.0f} | {row['vs_sdpa']:.2f} | "
                  f"{row['paged_us']:.0f} | {row['paged_vs_dense']:.2f} | {row['gathered_us']:.0f} | "
                  f"{row['gathered_vs_paged']:.2f} | {row['rounds']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
