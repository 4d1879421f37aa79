"""fused_attn.attention_with_kvcache against its definition: each sequence's keys after the append,
attended by its last L_q positions (the reference backend, one sequence at a time)."""

from __future__ import annotations

import pytest
import torch

import fused_attn
from fused_attn import quantization, testing

HEADS_Q, HEADS_KV, DIM = 4, 2, 16


def expected_of(query, keys, values, lengths, dtype, starts=None, **options):
    """The definition, sequence by sequence: bottom-right aligned attention over the valid keys
    (starts[b] .. lengths[b], from 0 without starts), by the reference backend in `dtype`."""
    outs, lses = [], []
    starts = [0] * len(lengths) if starts is None else starts.tolist()
    for b, (start, length) in enumerate(zip(starts, lengths.tolist())):
        out, lse = fused_attn.attention(
            query[b:b + 1].to(dtype), keys[b:b + 1, :, start:length].to(dtype),
            values[b:b + 1, :, start:length].to(dtype),
            enable_gqa=True, causal_alignment="bottom_right", return_lse=True, backend="reference",
            **{k: (v[b:b + 1] if k == "alibi_slopes" and v is not None and v.dim() == 2 else v)
               for k, v in options.items()})
        outs.append(out)
        lses.append(lse)
    return testing.Results(torch.cat(outs), torch.cat(lses))


def random_case(generator, dtype, len_q, len_new, capacity, batch=4):
    lengths_before = torch.randint(0, capacity - len_new + 1, (batch,), generator=generator, dtype=torch.int32)
    lengths_before[0] = 0  # an empty cache
    query = torch.randn(batch, HEADS_Q, len_q, DIM, generator=generator).to(dtype)
    new_k = torch.randn(batch, HEADS_KV, len_new, DIM, generator=generator).to(dtype)
    new_v = torch.randn(batch, HEADS_KV, len_new, DIM, generator=generator).to(dtype)
    return lengths_before, query, new_k, new_v


def check(actual, query, keys, values, lengths, starts=None, **options):
    """The project's criterion (fused_attn.testing) against the float64 and same-dtype definitions."""
    out, lse = actual
    dtype = query.dtype
    testing.assert_close_to_reference(testing.Results(out, lse),
                                      expected_of(query, keys, values, lengths, torch.float64, starts, **options),
                                      expected_of(query, keys, values, lengths, dtype, starts, **options), dtype)


OPTIONS = {
    "plain": dict(),
    "window": dict(window_size=(5, -1)),
    "softcap_alibi": dict(softcap=3.0, alibi=True),
    "window_alibi": dict(window_size=(9, 0), alibi=True),
    "sinks_softcap": dict(sinks=True, softcap=3.0),
    "window_alibi_sinks": dict(window_size=(9, 0), alibi=True, sinks=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("len_q,len_new", [(1, 1), (1, 0), (3, 3), (5, 2)])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_dense_cache_appends_in_place_and_attends(generator, dtype, len_q, len_new, name):
    capacity = 40
    lengths_before, query, new_k, new_v = random_case(generator, dtype, len_q, len_new, capacity)
    # A (B, L_max, H_kv, D) buffer seen as (B, H_kv, L_max, D): the view the call writes through.
    k_buffer = torch.randn(4, capacity, HEADS_KV, DIM, generator=generator).to(dtype)
    v_buffer = torch.randn(4, capacity, HEADS_KV, DIM, generator=generator).to(dtype)
    k_cache, v_cache = k_buffer.transpose(1, 2), v_buffer.transpose(1, 2)
    options = dict(OPTIONS[name])
    slopes = torch.rand(HEADS_Q, generator=generator) if options.pop("alibi", False) else None
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(HEADS_Q, generator=generator) * 2 + 1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(lengths_before.tolist()):
        expected_k[b, :, start:start + len_new] = new_k[b]
        expected_v[b, :, start:start + len_new] = new_v[b]
    lengths = lengths_before + len_new
    actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k if len_new else None,
                                               new_v if len_new else None, cache_seqlens=lengths_before,
                                               alibi_slopes=slopes, return_lse=True, backend="cpu", **options)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    check(actual, query, expected_k, expected_v, lengths, is_causal=True, alibi_slopes=slopes, **options)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("len_q", [1, 3])
def test_long_cache_of_token_rows_gives_the_definition(generator, cache_dtype, len_q):
    # (B, L_max, H_kv, D) buffers, as in the test above, over more keys than the cpu decode kernels split every
    # 512 where a token's heads lie side by side (2048 and more): the items go head by head within each split.
    # Sequences of the whole cache, of one split and a few keys, and empty; an int8 cache under per-sequence scales.
    # D = 80: the AVX512-BF16 copy's pairs (32 values of a key row, 64 of a value row at two query rows) and their
    # float tails.
    capacity, heads_kv, dim = 2600, 4, 80
    dtype = torch.bfloat16 if cache_dtype == torch.int8 else cache_dtype
    lengths = torch.tensor([capacity, 517, 0], dtype=torch.int32)
    query = torch.randn(3, 8, len_q, dim, generator=generator).to(dtype)
    k_cache, v_cache = (random_cache_values(generator, (3, capacity, heads_kv, dim), cache_dtype).transpose(1, 2)
                        for _ in range(2))
    scales = {}
    keys, values = k_cache, v_cache
    if cache_dtype == torch.int8:
        scales = dict(k_scale=torch.rand(3, heads_kv, generator=generator) / 64 + 1e-3,
                      v_scale=torch.rand(3, heads_kv, generator=generator) / 64 + 1e-3)
        keys, values = dequantized(k_cache, scales["k_scale"], torch.float32), dequantized(v_cache, scales["v_scale"],
                                                                                              torch.float32)
    actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, cache_seqlens=lengths, return_lse=True,
                                               backend="cpu", **scales)
    check(actual, query, keys, values, lengths, is_causal=True)


def unseen_value(dtype: torch.dtype):
    """What fills memory no call may read: NaN, or for int8 (no NaN) -128, which no quantized value is."""
    return -128 if dtype == torch.int8 else float("nan")


def fill(values: torch.Tensor, index, value) -> None:
    """values[index] = value, also for float8 tensors (filled through their bytes: torch has no fill for them)."""
    if values.dtype == torch.float8_e4m3fn:
        values.view(torch.uint8)[index] = torch.tensor(value).to(values.dtype).view(torch.uint8)
    else:
        values[index] = value


def paged_copy(generator, dense_k, dense_v, block_size, spare_blocks=5, scales=()):
    """The dense caches (B, H_kv, capacity, D) scattered into shuffled blocks of a paged cache, with spare
    blocks nobody owns (NaN): (k_blocks, v_blocks, block_table); then, for each per-token scale tensor of
    `scales` (B, H_kv, capacity), its blocks (num_blocks, block_size, H_kv), strided (every other float)."""
    batch, heads_kv, capacity, _ = dense_k.shape
    max_blocks = capacity // block_size
    num_blocks = batch * max_blocks + spare_blocks
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks].view(batch, max_blocks)
    blocks = []
    for dense in (dense_k, dense_v):
        paged = torch.empty((num_blocks, block_size, heads_kv, dense.shape[3]), dtype=dense.dtype)
        fill(paged, ..., unseen_value(dense.dtype))
        paged[block_table] = dense.transpose(1, 2).unflatten(1, (max_blocks, block_size))
        blocks.append(paged)
    scale_blocks = []
    for dense in scales:
        paged = torch.full((num_blocks, block_size, heads_kv, 2), float("nan"))[..., 0]
        paged[block_table] = dense.transpose(1, 2).unflatten(1, (max_blocks, block_size))
        scale_blocks.append(paged)
    return blocks[0], blocks[1], block_table.int(), *scale_blocks


# (block size, L_q, capacity, dtype): blocks of one key, blocks that split the kernels' key blocks, decode and
# long-query calls (L_q > 16), sequences over the CPU's 512-key blocks and its split-KV decode, bf16 (long-query key
# blocks gathered across cache blocks of 16 and of 7 keys, whose VNNI pairs straddle two cache blocks).
PAGED_CASES = {
    "block_1": (1, 1, 7, torch.float32),
    "block_5_lq4": (5, 4, 35, torch.float32),
    "block_16_lq20": (16, 20, 112, torch.float32),
    "block_16_long": (16, 3, 1600, torch.float32),
    "block_48_bf16": (48, 1, 1536, torch.bfloat16),
    "block_16_lq20_bf16": (16, 20, 112, torch.bfloat16),
    "block_7_lq24_bf16": (7, 24, 147, torch.bfloat16),
}


@pytest.mark.usefixtures("interpreter_remedies")
@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("batch,dtype", [(1, torch.float32), (3, torch.float32), (3, torch.bfloat16)], ids=str)
def test_sequences_of_one_length_take_their_band_without_a_mask(generator, monkeypatch, backend, paged, batch, dtype):
    """Sequences that all have one length after the append (always so for one sequence) put every query's causal
    bound and window on one diagonal: the band reaches the kernels as an alignment, with no (B, 1, L_q, L_max)
    mask, and the call gives the definition's result with ALiBi (causal), sinks and a softcap; a batch of two lengths
    still takes the mask."""
    if (reason := fused_attn.available_backends()[backend]) is not None:
        pytest.skip(reason)
    import fused_attn.kvcache as kvcache

    masks = []  # the mask of each call's attention, dense or paged

    def recording(call, mask_at):  # mask_at: the mask's position among the call's arguments
        def recorded(*args, **kwargs):
            masks.append(args[mask_at])
            return call(*args, **kwargs)
        return recorded

    monkeypatch.setattr(kvcache, "attention", recording(kvcache.attention, 3))
    monkeypatch.setattr(kvcache, "_paged_attention", recording(kvcache._paged_attention, 4))
    capacity, len_q, block_size = 48, 6, 8
    same, mixed = torch.full((batch,), 29), torch.tensor([29, 17, 29][:batch])  # lengths before the append
    for lengths_before in (same.int(), mixed.int()):
        query = torch.randn(batch, HEADS_Q, len_q, DIM, generator=generator).to(dtype)
        new_k, new_v = (torch.randn(batch, HEADS_KV, len_q, DIM, generator=generator).to(dtype) for _ in range(2))
        dense_k, dense_v = (torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator).to(dtype)
                            for _ in range(2))
        lengths = lengths_before + len_q
        if backend != "reference":  # which reads whole rows, masked
            for b, end in enumerate(lengths.tolist()):
                dense_k[b, :, end:], dense_v[b, :, end:] = float("nan"), float("-inf")
        slopes = torch.rand(batch, HEADS_Q, generator=generator) * 0.5 if dtype == torch.float32 else None
        sinks = torch.randn(HEADS_Q, generator=generator) * 2 + 1
        options = dict(alibi_slopes=slopes, window_size=(9, -1), softcap=4.0, sinks=sinks)
        expected_k, expected_v = dense_k.clone(), dense_v.clone()
        for b, start in enumerate(lengths_before.tolist()):
            expected_k[b, :, start:start + len_q], expected_v[b, :, start:start + len_q] = new_k[b], new_v[b]
        cache = dict(block_table=None)
        if paged:
            k_blocks, v_blocks, block_table = paged_copy(generator, dense_k, dense_v, block_size)
            cache = dict(block_table=block_table)
            dense_k, dense_v = k_blocks, v_blocks
        masks.clear()
        actual = fused_attn.attention_with_kvcache(query, dense_k, dense_v, new_k, new_v, cache_seqlens=lengths_before,
                                                   return_lse=True, backend=backend, **cache, **options)
        check(actual, query, expected_k, expected_v, lengths, is_causal=True, **options)
        one_length = bool((lengths == lengths[0]).all())
        assert len(masks) == 1 and (masks[0] is None) == one_length, (one_length, masks[0] is None)


@pytest.mark.usefixtures("interpreter_remedies")  # bf16 products in Triton's interpreter as a GPU computes them
@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_cache_matches_the_dense_one(generator, backend, name):
    """Blocks in a random order, any block size: the same result as the dense cache they map, and the
    definition; the appended tokens land in their blocks; table entries past a sequence's end are never read."""
    if (reason := fused_attn.available_backends()[backend]) is not None:
        pytest.skip(reason)
    block_size, len_q, capacity, dtype = PAGED_CASES[name]
    if backend == "triton" and capacity > 200:
        pytest.skip("long caches are slow in Triton's interpreter; the short cases read the same block table")
    batch = 3
    lengths_before, query, new_k, new_v = random_case(generator, dtype, len_q, len_q, capacity, batch)
    lengths_before[1] = capacity - len_q  # a full cache
    dense_k = torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator).to(dtype)
    dense_v = torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator).to(dtype)
    if backend != "reference":  # which reads whole rows, masked
        # The keys past each sequence's end, in its last block or the kernels' last key block: never read.
        for b, end in enumerate((lengths_before + len_q).tolist()):
            dense_k[b, :, end:], dense_v[b, :, end:] = float("nan"), float("-inf")
    k_blocks, v_blocks, block_table = paged_copy(generator, dense_k, dense_v, block_size)
    # Entries past each sequence's last block are not blocks at all: never read.
    used = (lengths_before + len_q + block_size - 1) // block_size
    block_table[torch.arange(block_table.shape[1])[None, :] >= used[:, None]] = -1
    # ALiBi runs aligned to the buffer's end (fused_attn.kvcache), which costs precision in long buffers and in bf16.
    slopes = torch.rand(batch, HEADS_Q, generator=generator) if capacity <= 200 and dtype == torch.float32 else None
    sinks = torch.randn(HEADS_Q, generator=generator) * 2 + 1
    options = dict(cache_seqlens=lengths_before, alibi_slopes=slopes, window_size=(6 * block_size, -1),
                   softcap=4.0, sinks=sinks, return_lse=True, backend=backend)
    paged = fused_attn.attention_with_kvcache(query, k_blocks, v_blocks, new_k, new_v, block_table=block_table,
                                              **options)
    dense = fused_attn.attention_with_kvcache(query, dense_k, dense_v, new_k, new_v, **options)
    torch.testing.assert_close(paged, dense, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else
                                                dict(rtol=2e-2, atol=2e-2)))
    lengths = lengths_before + len_q
    check(paged, query, dense_k, dense_v, lengths, is_causal=True, alibi_slopes=slopes, softcap=4.0,
          window_size=(6 * block_size, -1), sinks=sinks)
    gathered = k_blocks[block_table.clamp(min=0).long()].flatten(1, 2).transpose(1, 2)
    for b, start in enumerate(lengths_before.tolist()):
        assert torch.equal(gathered[b, :, start:start + len_q], new_k[b])


def test_paged_block_table_entries_are_checked(generator):
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, 1, 1, 20, batch=2)
    lengths_before[:] = 9
    k_blocks = torch.zeros(6, 4, HEADS_KV, DIM)
    block_table = torch.tensor([[0, 1, 2, 7, 9], [3, 4, 6, -1, -1]], dtype=torch.int32)  # (0, 3): no such block
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match="block_table"):
            fused_attn.attention_with_kvcache(query, k_blocks, k_blocks.clone(), new_k, new_v,
                                              cache_seqlens=lengths_before, block_table=block_table, backend=backend)
    with pytest.raises(RuntimeError, match="block_table"):  # the op checks it too, for direct callers
        torch.ops.fused_attn.paged_forward(query, k_blocks, k_blocks, block_table, None,
                                           torch.arange(20)[None, :].expand(2, 20) >= 12, False, 1.0,
                                           torch.empty(2, HEADS_Q, 1, DIM))


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_every_backend_gives_the_definition(generator, backend):
    if (reason := fused_attn.available_backends()[backend]) is not None:
        pytest.skip(reason)
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, 2, 2, 30)
    k_cache = torch.randn(4, HEADS_KV, 30, DIM, generator=generator)
    v_cache = torch.randn(4, HEADS_KV, 30, DIM, generator=generator)
    actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths_before,
                                               softcap=2.0, return_lse=True, backend=backend)
    check(actual, query, k_cache, v_cache, lengths_before + 2, is_causal=True, softcap=2.0)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("window_size", [(-1, 0), (4, 0)], ids=str)
def test_alibi_with_a_causal_window_and_several_queries(generator, backend, paged, window_size):
    """is_causal=False with a window of right bound 0 is causal (no key after a query is visible), so
    ALiBi aligned to the cache's end is a shift of the scores there too: the call runs and gives the
    definition (flash-attn's reference tests make such calls)."""
    capacity, len_q, batch, block_size = 24, 3, 3, 4
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, len_q, len_q, capacity, batch)
    k_cache = torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator)
    v_cache = torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator)
    slopes = torch.rand(batch, HEADS_Q, generator=generator)
    options = dict(cache_seqlens=lengths_before, is_causal=False, window_size=window_size, alibi_slopes=slopes,
                   return_lse=True, backend=backend)
    if paged:
        k_blocks, v_blocks, block_table = paged_copy(generator, k_cache, v_cache, block_size)
        actual = fused_attn.attention_with_kvcache(query, k_blocks, v_blocks, new_k, new_v, block_table=block_table,
                                                   **options)
    else:
        actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k, new_v, **options)
    for b, start in enumerate(lengths_before.tolist()):
        k_cache[b, :, start:start + len_q] = new_k[b]
        v_cache[b, :, start:start + len_q] = new_v[b]
    check(actual, query, k_cache, v_cache, lengths_before + len_q, window_size=window_size, alibi_slopes=slopes)
    # The same call as is_causal=True (the flag adds nothing to a band that is causal already).
    causal = dict(options, cache_seqlens=lengths_before + len_q, is_causal=True)
    if paged:
        again = fused_attn.attention_with_kvcache(query, k_blocks, v_blocks, block_table=block_table, **causal)
    else:
        again = fused_attn.attention_with_kvcache(query, k_cache, v_cache, **causal)
    torch.testing.assert_close(again, actual, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("window_size", [None, (-1, -1), (4, -1), (4, 1), (-1, 2)], ids=str)
def test_alibi_with_keys_after_a_query_is_still_refused(generator, paged, window_size):
    """Several queries that may see keys after them (is_causal=False and no window of right bound 0):
    ALiBi aligned to the cache's end would not be a shift of the scores, and the call is refused."""
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, 3, 3, 24, batch=2)
    k_cache = torch.randn(2, HEADS_KV, 24, DIM, generator=generator)
    v_cache = torch.randn(2, HEADS_KV, 24, DIM, generator=generator)
    caches = paged_copy(generator, k_cache, v_cache, 4) if paged else (k_cache, v_cache, None)
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match="alibi_slopes"):
            fused_attn.attention_with_kvcache(query, caches[0], caches[1], new_k, new_v, block_table=caches[2],
                                              cache_seqlens=lengths_before, is_causal=False,
                                              window_size=window_size, alibi_slopes=torch.rand(HEADS_Q),
                                              backend=backend)
    # One query sees no key after it (its sequence ends there): that call runs, whatever the window.
    fused_attn.attention_with_kvcache(query[:, :, :1], caches[0], caches[1], block_table=caches[2],
                                      cache_seqlens=lengths_before + 3, is_causal=False, window_size=window_size,
                                      alibi_slopes=torch.rand(HEADS_Q), backend="cpu")


@pytest.mark.parametrize("change, error, message", [
    (dict(cache_seqlens=torch.zeros(4, dtype=torch.int64)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.full((4,), 29, dtype=torch.int32)), ValueError, "capacity"),
    (dict(key=torch.zeros(4, HEADS_KV, 2, DIM + 1)), ValueError, "key"),
    (dict(value=None), ValueError, "key, value"),
    (dict(k_cache=torch.zeros(4, HEADS_KV, 30)), ValueError, "k_cache"),
    (dict(block_table=torch.zeros(4, 3, dtype=torch.int64)), ValueError, "block_table"),
    (dict(is_causal=False, alibi_slopes=torch.ones(HEADS_Q)), ValueError, "alibi_slopes"),
    (dict(is_causal=False, window_size=(5, 1), alibi_slopes=torch.ones(HEADS_Q)), ValueError, "alibi_slopes"),
])
def test_bad_arguments_are_named(change, error, message):
    arguments = dict(query=torch.zeros(4, HEADS_Q, 3, DIM), k_cache=torch.zeros(4, HEADS_KV, 30, DIM),
                     v_cache=torch.zeros(4, HEADS_KV, 30, DIM), key=torch.zeros(4, HEADS_KV, 2, DIM),
                     value=torch.zeros(4, HEADS_KV, 2, DIM), cache_seqlens=torch.zeros(4, dtype=torch.int32))
    arguments.update(change)
    query = arguments.pop("query")
    with pytest.raises(error, match=message):
        fused_attn.attention_with_kvcache(query, **arguments)


# flash-attn's cache options: cache_batch_idx, cache_leftpad, rotary_cos/rotary_sin with rotary_interleaved.

def rope(x, cos, sin, positions, interleaved):
    """The rotary embedding by its definition, one pair of dimensions at a time: pair i of the first
    2 · cos.shape[1] dimensions, (2i, 2i + 1) interleaved or (i, i + cos.shape[1]), turned by the
    angle of row positions[b, l] of the tables; products in float32 (float64 for float64), rounded once."""
    half = cos.shape[1]
    compute = torch.promote_types(x.dtype, torch.float32)
    out = x.clone()
    for i in range(half):
        first, second = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = cos[positions, i].to(compute)[:, None], sin[positions, i].to(compute)[:, None]  # (B, 1, L)
        x1, x2 = x[..., first].to(compute), x[..., second].to(compute)
        out[..., first] = (x1 * c - x2 * s).to(x.dtype)
        out[..., second] = (x1 * s + x2 * c).to(x.dtype)
    return out


def test_rotary_turns_each_pair_by_its_angle(generator):
    """fused_attn.rotary against complex multiplication: pair (x1, x2) is x1 + i·x2, times e^(i·angle)."""
    from fused_attn import rotary

    x = torch.randn(2, 3, 5, DIM, generator=generator, dtype=torch.float64)
    angle = torch.rand(9, 6, generator=generator, dtype=torch.float64) * 6.3
    positions = torch.randint(0, 9, (2, 5), generator=generator)
    turn = torch.polar(torch.ones_like(angle), angle)[positions][:, None]  # (B, 1, L, 6)
    for interleaved in (True, False):
        pairs = x[..., :12].unflatten(-1, (6, 2)) if interleaved else x[..., :12].unflatten(-1, (2, 6)).transpose(-1, -2)
        turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
        turned = turned.flatten(-2) if interleaved else turned.transpose(-1, -2).flatten(-2)
        expected = torch.cat([turned, x[..., 12:]], -1)
        torch.testing.assert_close(rotary.rotate(x, angle.cos(), angle.sin(), positions, interleaved), expected,
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                 (torch.float64, torch.float64), (torch.float64, torch.float32)],
                         ids=str)
def test_rotary_op_is_the_torch_definition_bit_for_bit(generator, dtype, table_dtype):
    """The CPU's one-pass `rotary` op against `rotate_in_torch`, for strided inputs and tables, partial rotary
    dims, both pairings: identical bits."""
    from fused_attn import rotary

    if fused_attn.available_backends()["cpu"] is not None:
        pytest.skip("the C++ extension is not built")
    for layout in testing.LAYOUTS:
        x = testing.strided(torch.randn(3, 4, 5, DIM, generator=generator).to(dtype), layout)
        for half in (1, 3, DIM // 2):
            angle = torch.rand(12, 2 * half, generator=generator, dtype=torch.float64)[:, ::2] * 100
            cos, sin = angle.cos().to(table_dtype), angle.sin().to(table_dtype)
            positions = torch.randint(0, 12, (5, 3), generator=generator).t()
            for interleaved in (True, False):
                fused = rotary.rotate(x, cos, sin, positions, interleaved)
                in_torch = rotary.rotate_in_torch(x, cos, sin, positions, interleaved)
                assert fused.stride() == x.stride() or layout == "packed"
                assert torch.equal(fused, in_torch), (layout, half, interleaved)


def test_rotary_op_names_its_bad_arguments(generator):
    if fused_attn.available_backends()["cpu"] is not None:
        pytest.skip("the C++ extension is not built")
    x, table = torch.randn(2, 3, 4, DIM), torch.rand(10, 4)
    positions = torch.zeros(2, 4, dtype=torch.long)
    for arguments, name in [((x[0], table, table, positions), "x"), ((x, table, table[:, :3], positions), "cos, sin"),
                            ((x, table, table.double(), positions), "cos, sin"),
                            ((x, table, table, positions.int()), "positions"),
                            ((x, table, table, positions[:1]), "positions"),
                            ((x, table, table, positions + 10), "positions")]:
        with pytest.raises(RuntimeError, match=f"rotary: {name}"):
            torch.ops.fused_attn.rotary(*arguments, True)


def run_cache_options(generator, backend, dtype, *, len_q, len_new, batch=3, capacity=24, heads_kv=2,
                      batch_idx=False, duplicate_rows=False, leftpad=False, rotary=None, rotary_dim=DIM,
                      table_dtype=None, is_causal=True, window_size=None, softcap=None, alibi=False, sinks=False,
                      block_size=None, return_lse=True, layouts=("heads_inner", "contiguous", "reversed"),
                      cache_dtype=None, scale_layout="token"):
    """One call with flash-attn's cache options, against the definition written out here: the cache rows
    gathered, the rotary applied by `rope` at flash-attn's positions (new key i at cache_seqlens + i; query
    i there too under a causal or windowed mask, else every query at cache_seqlens), the sequence's keys
    cache_leftpad .. cache_seqlens + L_new attended bottom-right aligned. The whole cache after the append
    is compared exactly: rows no sequence names are NaN, so reading them would show in the output, and
    they must stay NaN.

    With an 8-bit `cache_dtype` the cache holds random 8-bit values and float32 scales in `scale_layout`
    ("token": (rows, H_kv, capacity), as a (rows, capacity, H_kv) buffer; "sequence": (rows, H_kv)); the new keys
    are stored as `stored_as` says, and the definition attends over the dequantized cache in the query's dtype.
    Memory no call may read holds NaN scales (and NaN fp8 values)."""
    rows = batch + 2 if batch_idx else batch
    in_order = is_causal or (window_size is not None and tuple(window_size) != (-1, -1))
    reach = max(len_new, len_q if in_order else min(len_q, 1)) if rotary else len_new  # positions past the start
    starts = torch.randint(0, capacity - reach + 1, (batch,), generator=generator, dtype=torch.int32)
    starts[0] = capacity - reach  # a full cache
    starts[1] = min(int(starts[1]), 2)  # a short one (maybe empty)
    leftpads = (torch.rand(batch, generator=generator) * (starts + 1)).floor().int() if leftpad else None
    if leftpad:
        leftpads[1] = starts[1]  # nothing before the new keys
    idx = torch.randperm(rows, generator=generator)[:batch].int()
    if duplicate_rows:  # two sequences reading one row (allowed: nothing is appended), from one start
        idx[2] = idx[0]
        if leftpad:
            leftpads[2] = leftpads[0]
            starts[2] = max(int(starts[2]), int(leftpads[0]))
    row_of = idx.long() if batch_idx else torch.arange(batch)

    quantized = cache_dtype is not None
    k_values, v_values = (random_cache_values(generator, (rows, heads_kv, capacity, DIM), cache_dtype or dtype)
                          for _ in range(2))
    scales = ()
    if quantized:
        shape = (rows, heads_kv, capacity) if scale_layout == "token" else (rows, heads_kv)
        scales = tuple(torch.rand(shape, generator=generator) * 0.02 + 0.002 for _ in range(2))
    unnamed = torch.ones(rows, dtype=torch.bool)
    unnamed[row_of] = False
    for values in (k_values, v_values):
        fill(values, unnamed, unseen_value(values.dtype))
    for scale in scales:
        scale[unnamed] = float("nan")
    if leftpad:
        # The keys before each start: NaN (keys) and inf (values) for the kernels, which never load them;
        # the reference backend reads whole rows, masked, so for it they are large finite values, which
        # would swamp the output if they were seen. An 8-bit cache is read by every backend as blocks,
        # masked before anything is computed: its values there are the largest it holds, its scales NaN.
        for b, pad in enumerate(leftpads.tolist()):
            for values, poison in ((k_values, float("nan")), (v_values, float("inf"))):
                if quantized:
                    fill(values, (row_of[b], slice(None), slice(None, pad)), quantization.LARGEST[cache_dtype])
                else:
                    values[row_of[b], :, :pad] = poison if backend != "reference" else \
                        50 * torch.randn(heads_kv, pad, DIM, generator=generator).to(dtype)
            if quantized and scale_layout == "token":
                for scale in scales:
                    scale[row_of[b], :, :pad] = float("nan")
    query = testing.strided(torch.randn(batch, HEADS_Q, len_q, DIM, generator=generator).to(dtype), layouts[0])
    k_cache, v_cache = testing.strided(k_values, layouts[1]), testing.strided(v_values, layouts[2])
    if quantized and scale_layout == "token":  # as a (rows, capacity, H_kv) buffer
        scales = tuple(scale.transpose(1, 2).contiguous().transpose(1, 2) for scale in scales)
    new_k = torch.randn(batch, heads_kv, len_new, DIM, generator=generator).to(dtype)
    new_v = torch.randn(batch, heads_kv, len_new, DIM, generator=generator).to(dtype)

    cos = sin = None
    q_seen, k_stored = query, new_k
    if rotary:
        table_length = int((starts + reach).max())  # exactly what the call reads
        angle = torch.rand(table_length, rotary_dim // 2, generator=generator) * 2 * torch.pi
        cos, sin = angle.cos().to(table_dtype or dtype), angle.sin().to(table_dtype or dtype)
        key_positions = starts.long()[:, None] + torch.arange(len_new)
        query_steps = torch.arange(len_q) if in_order else torch.zeros(len_q, dtype=torch.long)
        k_stored = rope(new_k, cos, sin, key_positions, rotary == "interleaved")
        q_seen = rope(query, cos, sin, starts.long()[:, None] + query_steps, rotary == "interleaved")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_scales = tuple(scale.clone() for scale in scales)
    for b, start in enumerate(starts.tolist()):
        for expected, new, index in ((expected_k, k_stored, 0), (expected_v, new_v, 1)):
            if not quantized:
                expected[row_of[b], :, start:start + len_new] = new[b]
                continue
            if scale_layout == "token":
                scale = new[b].float().abs().amax(-1) / quantization.LARGEST[cache_dtype]
                scale = torch.where(scale > 0, scale, 1.0)
                expected_scales[index][row_of[b], :, start:start + len_new] = scale
            else:
                scale = scales[index][row_of[b]][:, None].expand(heads_kv, len_new)
            expected[row_of[b], :, start:start + len_new] = stored_as(new[b], scale, cache_dtype)

    slopes = torch.rand(batch, HEADS_Q, generator=generator) if alibi else None
    sink_values = torch.randn(HEADS_Q, generator=generator) * 2 + 1 if sinks else None
    options = dict(is_causal=is_causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes,
                   sinks=sink_values)
    call = dict(cache_seqlens=starts, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary == "interleaved",
                return_lse=return_lse, backend=backend, **options)
    if quantized:
        call.update(k_scale=scales[0], v_scale=scales[1])
    appended = (new_k, new_v) if len_new else (None, None)
    if block_size is not None:
        k_blocks, v_blocks, block_table, *scale_blocks = paged_copy(
            generator, k_cache, v_cache, block_size, scales=scales if scale_layout == "token" else ())
        if scale_blocks:
            call.update(k_scale=scale_blocks[0], v_scale=scale_blocks[1])
        actual = fused_attn.attention_with_kvcache(query, k_blocks, v_blocks, *appended, block_table=block_table,
                                                   **call)
        k_cache, v_cache, *seen_scales = (blocks[block_table.long()].flatten(1, 2).transpose(1, 2)
                                          for blocks in (k_blocks, v_blocks, *scale_blocks))
        if scale_blocks:
            scales = tuple(seen_scales)
    else:
        actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, *appended,
                                                   cache_batch_idx=idx if batch_idx else None,
                                                   cache_leftpad=leftpads, **call)
    for stored, expected in zip((k_cache, v_cache, *scales), (expected_k, expected_v, *expected_scales)):
        assert stored.dtype == expected.dtype
        if stored.element_size() == 1:  # compared as bytes: NaN and -128 must stay as they were
            stored, expected = stored.view(torch.uint8), expected.view(torch.uint8)
        torch.testing.assert_close(stored, expected, rtol=0, atol=0, equal_nan=True)
    if quantized:
        expected_k, expected_v = (dequantized(values, scale, dtype) for values, scale in
                                  zip((expected_k, expected_v), expected_scales))
    check(actual if return_lse else (actual, None), q_seen, expected_k[row_of], expected_v[row_of],
          starts + len_new, leftpads, **options)


def random_cache_values(generator, shape, dtype):
    """Cache contents of `dtype`: normal values, or for an 8-bit cache, values spread over its whole range."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    if dtype == torch.float8_e4m3fn:
        return (torch.randn(shape, generator=generator) * 64).clamp(-448, 448).to(dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def stored_as(new, scale, dtype):
    """README's quantization of new keys (..., D) under `scale` (...): new / scale in float32, saturated at the
    format's largest magnitude, rounded to nearest (ties to even)."""
    largest = quantization.LARGEST[dtype]
    ratio = torch.clamp(new.float() / scale[..., None], -largest, largest)
    return (ratio.round() if dtype == torch.int8 else ratio).to(dtype)


def dequantized(values, scale, dtype):
    """The 8-bit cache `values` (rows, H_kv, L, D) under `scale` (rows, H_kv, L) or (rows, H_kv), in `dtype`."""
    if scale.dim() == 2:
        scale = scale[:, :, None]
    return (values.float() * scale[..., None]).to(dtype)


CACHE_OPTION_CASES = {
    "rows_leftpad_rotary_causal": dict(len_q=3, len_new=3, batch_idx=True, leftpad=True, rotary="interleaved"),
    "rows_rotary_halves_not_causal_sinks_softcap_mqa": dict(len_q=2, len_new=2, batch_idx=True, rotary="halves",
                                                            is_causal=False, sinks=True, softcap=3.0, heads_kv=1),
    # Queries rotated at cache_seqlens + i while they attend from cache_seqlens + L_new - L_q + i.
    "leftpad_causal_window_alibi_partial_rotary_mha": dict(len_q=3, len_new=1, leftpad=True, rotary="halves",
                                                           rotary_dim=8, is_causal=False, window_size=(6, 0),
                                                           alibi=True, heads_kv=4),
    "shared_rows_leftpad_window_no_append": dict(len_q=2, len_new=0, batch_idx=True, duplicate_rows=True,
                                                 leftpad=True, is_causal=False, window_size=(4, 2), softcap=2.0),
    "decode_rows_leftpad_rotary_alibi_sinks_fp32_tables": dict(len_q=1, len_new=1, batch_idx=True, leftpad=True,
                                                               rotary="interleaved", alibi=True, sinks=True,
                                                               table_dtype=torch.float32),
    "rotary_window_not_causal_no_lse": dict(len_q=3, len_new=2, rotary="interleaved", is_causal=False,
                                            window_size=(5, 1), heads_kv=1, return_lse=False),
    "paged_rotary_alibi_sinks_softcap": dict(len_q=4, len_new=4, block_size=4, rotary="halves", rotary_dim=12,
                                             alibi=True, sinks=True, softcap=4.0),
    "paged_decode_rotary_window": dict(len_q=1, len_new=1, block_size=3, rotary="interleaved", window_size=(7, -1)),
    "int8_tokens_rows_leftpad_rotary": dict(len_q=3, len_new=2, batch_idx=True, leftpad=True, rotary="halves",
                                            cache_dtype=torch.int8),
    "fp8_sequences_rows_decode_alibi_sinks": dict(len_q=1, len_new=1, batch_idx=True, alibi=True, sinks=True,
                                                  cache_dtype=torch.float8_e4m3fn, scale_layout="sequence"),
    "int8_sequences_window_softcap_mqa": dict(len_q=4, len_new=3, is_causal=False, window_size=(5, 1), softcap=3.0,
                                              heads_kv=1, cache_dtype=torch.int8, scale_layout="sequence"),
    "fp8_tokens_paged_rotary_alibi": dict(len_q=2, len_new=2, block_size=4, rotary="interleaved", alibi=True,
                                          cache_dtype=torch.float8_e4m3fn),
    "int8_sequences_paged_decode_softcap": dict(len_q=1, len_new=1, block_size=3, softcap=2.0,
                                                cache_dtype=torch.int8, scale_layout="sequence"),
    "fp8_tokens_shared_rows_no_append": dict(len_q=2, len_new=0, batch_idx=True, duplicate_rows=True, leftpad=True,
                                             is_causal=False, cache_dtype=torch.float8_e4m3fn),
}


@pytest.mark.parametrize("backend, dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16),
                                            ("reference", torch.float32), ("triton", torch.float32)], ids=str)
@pytest.mark.parametrize("name", list(CACHE_OPTION_CASES))
def test_cache_options_give_the_definition(generator, backend, dtype, name):
    if (reason := fused_attn.available_backends()[backend]) is not None:
        pytest.skip(reason)
    run_cache_options(generator, backend, dtype, **CACHE_OPTION_CASES[name])


def drawn_cache_options(generator) -> dict:
    """Every option drawn at once, within what the call takes (no cache_batch_idx or cache_leftpad with a
    paged cache, no rotary without new keys, ALiBi with several queries only where none sees a key after it)."""
    def pick(choices):
        return choices[int(torch.randint(len(choices), (1,), generator=generator))]

    len_q = pick([1, 1, 2, 3, 5])
    len_new = pick(list(range(len_q + 1)))
    paged = pick([False, False, False, True])
    batch_idx, leftpad = (False, False) if paged else (pick([False, True]), pick([False, True]))
    is_causal = pick([False, True])
    window_size = pick([None, (pick([0, 3, 7]), -1), (pick([0, 3, 7]), 0), (pick([2, 7]), pick([1, 2])),
                        (-1, pick([0, 2]))])
    causal_band = is_causal or (window_size is not None and window_size[1] == 0)
    return dict(len_q=len_q, len_new=len_new, heads_kv=pick([1, 2, 4]), batch_idx=batch_idx, leftpad=leftpad,
                duplicate_rows=batch_idx and len_new == 0 and pick([False, True]),
                rotary=pick([None, "interleaved", "halves"]) if len_new else None,
                rotary_dim=pick([2, 8, 10, DIM]), table_dtype=pick([None, torch.float32]), is_causal=is_causal,
                window_size=window_size, softcap=pick([None, 2.5]),
                alibi=(len_q == 1 or causal_band) and pick([False, True]), sinks=pick([False, True]),
                block_size=pick([1, 3, 8]) if paged else None, return_lse=pick([True, True, False]),
                layouts=tuple(pick(testing.LAYOUTS) for _ in range(3)),
                cache_dtype=pick([None, None, torch.int8, torch.float8_e4m3fn]),
                scale_layout=pick(["token", "sequence"]))


@pytest.mark.parametrize("backend, dtype, seeds", [("cpu", torch.float32, 24), ("cpu", torch.bfloat16, 12),
                                                   ("reference", torch.float32, 8), ("triton", torch.float32, 6)],
                         ids=str)
def test_cache_options_drawn_together(backend, dtype, seeds):
    if (reason := fused_attn.available_backends()[backend]) is not None:
        pytest.skip(reason)
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(0xCAC4E + seed)
        options = drawn_cache_options(generator)
        try:
            run_cache_options(generator, backend, dtype, **options)
        except AssertionError as error:
            raise AssertionError(f"seed {seed}, {options}: {error}") from error


@pytest.mark.parametrize("is_causal, window_size, len_q, len_new, reach", [
    (True, None, 3, 1, 3),  # causal: the queries' positions run to cache_seqlens + L_q - 1
    (False, (-1, 1), 3, 1, 3),  # a window: the same
    (False, None, 3, 1, 1),  # neither: every query at cache_seqlens
    (False, None, 1, 4, 4),  # the new keys reach further
])
def test_rotary_table_must_cover_every_position_read(generator, is_causal, window_size, len_q, len_new, reach):
    """A table exactly as long as the positions read runs; one position shorter is refused, cache untouched."""
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, len_q, len_new, 30, batch=3)
    lengths_before[:] = torch.tensor([5, 11, 2], dtype=torch.int32)
    k_cache = torch.randn(3, HEADS_KV, 30, DIM, generator=generator)
    v_cache = torch.randn(3, HEADS_KV, 30, DIM, generator=generator)
    angle = torch.rand(11 + reach, DIM // 2, generator=generator)
    options = dict(cache_seqlens=lengths_before, is_causal=is_causal, window_size=window_size, backend="cpu")
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match="rotary_cos"):
        fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k, new_v, rotary_cos=angle[:-1].cos(),
                                          rotary_sin=angle[:-1].sin(), **options)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k, new_v, rotary_cos=angle.cos(),
                                      rotary_sin=angle.sin(), **options)


def cache_option_arguments(generator):
    """A valid call with every cache option: B = 3 sequences in rows (4, 0, 2) of a 5-row cache."""
    cos, sin = torch.rand(24, DIM // 2, generator=generator).cos(), torch.rand(24, DIM // 2, generator=generator).sin()
    return dict(query=torch.randn(3, HEADS_Q, 2, DIM, generator=generator),
                k_cache=torch.randn(5, HEADS_KV, 24, DIM, generator=generator),
                v_cache=torch.randn(5, HEADS_KV, 24, DIM, generator=generator),
                key=torch.randn(3, HEADS_KV, 2, DIM, generator=generator),
                value=torch.randn(3, HEADS_KV, 2, DIM, generator=generator),
                cache_seqlens=torch.tensor([3, 0, 10], dtype=torch.int32),
                cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32),
                cache_leftpad=torch.tensor([1, 0, 4], dtype=torch.int32), rotary_cos=cos, rotary_sin=sin)


def int32(*values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("change, error, message", [
    (dict(cache_batch_idx=torch.tensor([4, 0, 2])), ValueError, "cache_batch_idx"),
    (dict(cache_batch_idx=int32(4, 0)), ValueError, "cache_batch_idx"),
    (dict(cache_batch_idx=int32(4, 0, 2, device="meta")), ValueError, "cache_batch_idx"),
    (dict(cache_batch_idx=int32(4, 0, 5)), ValueError, "cache_batch_idx"),
    (dict(cache_batch_idx=int32(4, -1, 2)), ValueError, "cache_batch_idx"),
    (dict(cache_batch_idx=int32(4, 0, 4)), ValueError, "cache_batch_idx"),  # two appends to one row
    (dict(block_table=int32(0, 1, 2).view(3, 1)), ValueError, "cache_batch_idx"),
    (dict(cache_leftpad=torch.tensor([1, 0, 4])), ValueError, "cache_leftpad"),
    (dict(cache_leftpad=int32(1, 0, 4, 0)), ValueError, "cache_leftpad"),
    (dict(cache_leftpad=int32(1, 0, 4, device="meta")), ValueError, "cache_leftpad"),
    (dict(cache_leftpad=int32(4, 0, 4)), ValueError, "cache_leftpad"),  # past its sequence's end (3)
    (dict(cache_leftpad=int32(1, -1, 4)), ValueError, "cache_leftpad"),
    (dict(cache_batch_idx=None, block_table=int32(0, 1, 2).view(3, 1)), ValueError, "cache_leftpad"),
    (dict(rotary_sin=None), ValueError, "rotary_sin"),
    (dict(rotary_cos=None), ValueError, "rotary_cos"),
    (dict(rotary_sin=torch.zeros(24, DIM // 2 - 1)), ValueError, "rotary_sin"),
    (dict(rotary_cos=torch.zeros(24 * DIM // 2), rotary_sin=torch.zeros(24 * DIM // 2)), ValueError, "rotary_cos"),
    (dict(rotary_cos=torch.zeros(24, DIM // 2 + 1), rotary_sin=torch.zeros(24, DIM // 2 + 1)), ValueError,
     "rotary_cos"),  # rotary_dim past the head dim
    (dict(rotary_cos=torch.zeros(24, 4, dtype=torch.float64), rotary_sin=torch.zeros(24, 4, dtype=torch.float64)),
     TypeError, "rotary_cos"),
    (dict(rotary_sin=torch.zeros(24, DIM // 2, dtype=torch.int32)), TypeError, "rotary_sin"),
    (dict(rotary_cos=torch.zeros(24, 4, device="meta"), rotary_sin=torch.zeros(24, 4, device="meta")), ValueError,
     "rotary_cos"),
    (dict(rotary_cos=torch.zeros(11, 4), rotary_sin=torch.zeros(11, 4)), ValueError, "rotary_cos"),  # 10 + 2 > 11
    (dict(key=None, value=None), ValueError, "rotary_cos"),  # nothing to turn
    (dict(cache_batch_idx=None), ValueError, "k_cache"),  # 5 rows for 3 sequences, none named
    (dict(is_causal=False, alibi_slopes=torch.ones(HEADS_Q)), ValueError, "alibi_slopes"),
    # The checks of the attention itself come before the append too.
    (dict(scale="x"), TypeError, "scale"),
    (dict(query=torch.zeros(3, 3, 2, DIM)), ValueError, "k_cache"),
    (dict(backend="nope"), ValueError, "backend"),
])
def test_bad_cache_options_are_named_and_leave_the_cache(generator, change, error, message):
    arguments = cache_option_arguments(generator)
    arguments.update(change)
    query = arguments.pop("query")
    caches = arguments["k_cache"], arguments["v_cache"]
    before = [cache.clone() for cache in caches]
    for backend in ("cpu", "reference"):
        with pytest.raises(error, match=message):
            fused_attn.attention_with_kvcache(query, **{"backend": backend, **arguments})
        assert all(torch.equal(cache, kept) for cache, kept in zip(caches, before))
    valid = cache_option_arguments(generator)
    fused_attn.attention_with_kvcache(valid.pop("query"), **valid, backend="cpu")


def quantized_arguments(generator, cache_dtype=torch.int8, layout="token"):
    """A valid call on an 8-bit cache: B = 3 sequences in rows (4, 0, 2) of a 5-row cache, two new keys each."""
    arguments = cache_option_arguments(generator)
    del arguments["rotary_cos"], arguments["rotary_sin"], arguments["cache_leftpad"]
    for name in ("k_cache", "v_cache"):
        arguments[name] = random_cache_values(generator, arguments[name].shape, cache_dtype)
    shape = (5, HEADS_KV, 24) if layout == "token" else (5, HEADS_KV)
    arguments["k_scale"], arguments["v_scale"] = torch.rand(shape) + 0.01, torch.rand(shape) + 0.01
    return arguments


@pytest.mark.parametrize("change, error, message", [
    (dict(k_cache=torch.zeros(5, HEADS_KV, 24, DIM, dtype=torch.uint8)), TypeError, "k_cache"),
    (dict(v_cache=torch.zeros(5, HEADS_KV, 24, DIM, dtype=torch.float16)), TypeError, "v_cache"),
    (dict(v_cache=torch.zeros(5, HEADS_KV, 24, DIM, dtype=torch.float8_e4m3fn)), TypeError, "v_cache"),
    (dict(k_scale=None), ValueError, "k_scale"),
    (dict(v_scale=torch.ones(5, HEADS_KV, 24, dtype=torch.float16)), ValueError, "v_scale"),
    (dict(k_scale=torch.ones(5, HEADS_KV, 23)), ValueError, "k_scale"),
    (dict(k_scale=torch.ones(3, HEADS_KV)), ValueError, "k_scale"),  # per row of the cache, not per sequence
    (dict(v_scale=torch.ones(5, HEADS_KV)), ValueError, "v_scale"),  # k_scale is per token
    (dict(k_scale=torch.ones(5, HEADS_KV, 24, device="meta")), ValueError, "k_scale"),
    # Scales of a per-sequence layout quantize the appended keys: a named row's must be positive and finite.
    (dict(k_scale=torch.tensor([[1.0, 1.0]] * 4 + [[0.0, 1.0]]), v_scale=torch.ones(5, HEADS_KV)), ValueError,
     "k_scale"),
    (dict(k_scale=torch.ones(5, HEADS_KV), v_scale=torch.tensor([[1.0, 1.0]] * 2 + [[float("nan"), 1.0]] * 3)),
     ValueError, "v_scale"),
    (dict(cache_batch_idx=int32(4, 0, 5)), ValueError, "cache_batch_idx"),
])
def test_bad_quantized_caches_are_named_and_leave_the_cache(generator, change, error, message):
    arguments = quantized_arguments(generator)
    arguments.update(change)
    query = arguments.pop("query")
    kept = {name: arguments[name].clone() for name in ("k_cache", "v_cache", "k_scale", "v_scale")
            if isinstance(arguments[name], torch.Tensor) and arguments[name].device.type == "cpu"}
    for backend in ("cpu", "reference"):
        with pytest.raises(error, match=message):
            fused_attn.attention_with_kvcache(query, **{"backend": backend, **arguments})
        for name, before in kept.items():
            assert torch.equal(arguments[name].view(torch.uint8), before.view(torch.uint8)), name  # NaN too
    for cache_dtype in quantization.CACHE_DTYPES:
        for layout in ("token", "sequence"):
            valid = quantized_arguments(generator, cache_dtype, layout)
            fused_attn.attention_with_kvcache(valid.pop("query"), **valid, backend="cpu")


def test_scales_are_refused_with_a_cache_of_the_query_dtype(generator):
    arguments = cache_option_arguments(generator)
    with pytest.raises(ValueError, match="k_scale"):
        fused_attn.attention_with_kvcache(arguments.pop("query"), **arguments, k_scale=torch.ones(5, HEADS_KV),
                                          v_scale=torch.ones(5, HEADS_KV))


@pytest.mark.parametrize("cache_dtype, layout, bound", [
    (torch.int8, "token", 0.02), (torch.int8, "sequence", 0.04),
    (torch.float8_e4m3fn, "token", 0.08), (torch.float8_e4m3fn, "sequence", 0.1)], ids=str)
def test_quantization_error_against_a_bf16_cache(generator, cache_dtype, layout, bound):
    """The error the 8-bit format itself adds, measured against the same keys in a bf16 cache (both filled by
    appends of the same keys, attended by fp32 math of the same bf16 queries): bounded by what the format's
    precision allows (int8: 1/254 of the range per value; e4m3: 2^-4 relative), relative to the output's scale."""
    batch, capacity, length = 2, 256, 200
    query = torch.randn(batch, HEADS_Q, 1, DIM, generator=generator).to(torch.bfloat16)
    keys = torch.randn(batch, HEADS_KV, length, DIM, generator=generator).to(torch.bfloat16)
    values = torch.randn(batch, HEADS_KV, length, DIM, generator=generator).to(torch.bfloat16)
    lengths = torch.zeros(batch, dtype=torch.int32)
    bf16_cache = [torch.zeros(batch, HEADS_KV, capacity, DIM, dtype=torch.bfloat16) for _ in range(2)]
    cache = [torch.zeros(batch, HEADS_KV, capacity, DIM, dtype=cache_dtype) for _ in range(2)]
    shape = (batch, HEADS_KV, capacity) if layout == "token" else (batch, HEADS_KV)
    # A per-sequence scale is the caller's: here each head's largest magnitude over the keys to come.
    scales = [torch.ones(shape) if layout == "token" else
              tensor.float().abs().amax(dim=(2, 3)) / quantization.LARGEST[cache_dtype] for tensor in (keys, values)]
    fused_attn.attention_with_kvcache(query, *bf16_cache, keys, values, cache_seqlens=lengths, backend="reference")
    fused_attn.attention_with_kvcache(query, *cache, keys, values, cache_seqlens=lengths, k_scale=scales[0],
                                      v_scale=scales[1], backend="reference")
    lengths += length
    exact = fused_attn.attention_with_kvcache(query.double(), *(c.double() for c in bf16_cache), cache_seqlens=lengths,
                                              backend="reference")
    eight_bit = fused_attn.attention_with_kvcache(query.double(), *(dequantized(c, s, torch.float64)
                                                                    for c, s in zip(cache, scales)),
                                                  cache_seqlens=lengths, backend="reference")
    error = (eight_bit - exact).abs().max() / exact.abs().max()
    assert 0 < error < bound, f"{cache_dtype} ({layout} scales): relative error {error:.4f}"


def test_registry_says_which_backends_dequantize_an_8bit_cache():
    """cuda and reference run on a dequantized copy and say so; the backends whose kernels read 8-bit values
    say nothing of the kind."""
    from fused_attn.backends import registry
    from fused_attn.problem import Problem

    problem = Problem(device=torch.device("cpu"), dtype=torch.bfloat16, batch=1, heads_q=4, heads_kv=2, len_q=1,
                      len_k=64, head_dim_qk=DIM, head_dim_v=DIM, is_causal=False, dropout_p=0.0, mask_dtype=None,
                      mask_requires_grad=False, has_key_padding_mask=True, cache_dtype=torch.int8)
    verdicts = registry.explain(problem)
    assert "dequantizes the int8 key/value cache into a bfloat16 copy" in verdicts["reference"]
    for name in registry.names():
        backend = registry.get(name)
        notes = backend.notes(problem)
        assert (not notes) == backend.reads_quantized_cache, name
        assert backend.notes(problem._replace(cache_dtype=None)) == [], name
    assert not registry.get("cuda").reads_quantized_cache


@pytest.mark.parametrize("cache, read_as_blocks", [("dense", False), ("paged", True), ("named_rows", True),
                                                   ("int8_rows", True)])
def test_problem_says_whether_the_cache_is_read_as_blocks(generator, monkeypatch, cache, read_as_blocks):
    """The Problem the registry chooses by marks a cache read through a block table, whatever its dtype: a paged
    cache, the rows cache_batch_idx names and the rows of a dense 8-bit cache (the triton backend's notes say its
    descriptor variants cannot read those)."""
    from fused_attn.backends import registry

    problems = []
    choose = registry.choose
    monkeypatch.setattr(registry, "choose", lambda problem, explicit=None: problems.append(problem) or
                        choose(problem, explicit))
    batch, capacity = 2, 16
    query = torch.randn(batch, HEADS_Q, 1, DIM, generator=generator)
    options = {}
    if cache == "paged":
        k_cache, v_cache = (torch.randn(4, capacity // 2, HEADS_KV, DIM, generator=generator) for _ in range(2))
        options = dict(block_table=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32))
    else:
        dtype = torch.int8 if cache == "int8_rows" else torch.float32
        k_cache, v_cache = (torch.ones(batch, HEADS_KV, capacity, DIM, dtype=dtype) for _ in range(2))
    if cache == "named_rows":
        options = dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32))
    if cache == "int8_rows":
        options = dict(k_scale=torch.ones(batch, HEADS_KV), v_scale=torch.ones(batch, HEADS_KV))
    fused_attn.attention_with_kvcache(query, k_cache, v_cache, cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
                                      backend="reference", **options)
    assert problems[0].paged == read_as_blocks
    assert problems[0].cache_dtype == (torch.int8 if cache == "int8_rows" else None)
