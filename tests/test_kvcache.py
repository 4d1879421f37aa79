"""fused_attn.attention_with_kvcache against its definition: each sequence's keys after the append,
attended by its last L_q positions (the reference backend, one sequence at a time)."""

from __future__ import annotations

import pytest
import torch

import fused_attn
from fused_attn import testing

HEADS_Q, HEADS_KV, DIM = 4, 2, 16


def expected_of(query, keys, values, lengths, dtype, **options):
    """The definition, sequence by sequence: bottom-right aligned attention over the valid prefix, by
    the reference backend in `dtype`."""
    outs, lses = [], []
    for b, length in enumerate(lengths.tolist()):
        out, lse = fused_attn.attention(
            query[b:b + 1].to(dtype), keys[b:b + 1, :, :length].to(dtype), values[b:b + 1, :, :length].to(dtype),
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


def check(actual, query, keys, values, lengths, **options):
    """The project's criterion (fused_attn.testing) against the float64 and same-dtype definitions."""
    out, lse = actual
    dtype = query.dtype
    testing.assert_close_to_reference(testing.Results(out, lse),
                                      expected_of(query, keys, values, lengths, torch.float64, **options),
                                      expected_of(query, keys, values, lengths, dtype, **options), dtype)


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


def paged_copy(generator, dense_k, dense_v, block_size, spare_blocks=5):
    """The dense caches (B, H_kv, capacity, D) scattered into shuffled blocks of a paged cache, with spare
    blocks nobody owns (NaN): (k_blocks, v_blocks, block_table)."""
    batch, heads_kv, capacity, _ = dense_k.shape
    max_blocks = capacity // block_size
    num_blocks = batch * max_blocks + spare_blocks
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks].view(batch, max_blocks)
    blocks = []
    for dense in (dense_k, dense_v):
        paged = torch.full((num_blocks, block_size, heads_kv, dense.shape[3]), float("nan"), dtype=dense.dtype)
        paged[block_table] = dense.transpose(1, 2).unflatten(1, (max_blocks, block_size))
        blocks.append(paged)
    return blocks[0], blocks[1], block_table.int()


# (block size, L_q, capacity, dtype): blocks of one key, blocks that split the kernels' key blocks, decode and
# long-query calls (L_q > 16), sequences over the CPU's 512-key blocks and its split-KV decode, bf16.
PAGED_CASES = {
    "block_1": (1, 1, 7, torch.float32),
    "block_5_lq4": (5, 4, 35, torch.float32),
    "block_16_lq20": (16, 20, 112, torch.float32),
    "block_16_long": (16, 3, 1600, torch.float32),
    "block_48_bf16": (48, 1, 1536, torch.bfloat16),
}


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
    k_blocks, v_blocks, block_table = paged_copy(generator, dense_k, dense_v, block_size)
    # Entries past each sequence's last block are not blocks at all: never read.
    used = (lengths_before + len_q + block_size - 1) // block_size
    block_table[torch.arange(block_table.shape[1])[None, :] >= used[:, None]] = -1
    # ALiBi runs aligned to the buffer's end (fused_attn.kvcache), which costs precision in long buffers.
    slopes = torch.rand(batch, HEADS_Q, generator=generator) if capacity <= 200 else None
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
