"""fused_attn.attention_with_kvcache against its definition: each sequence's keys after the append,
attended by its last L_q positions (the reference backend, one sequence at a time)."""

from __future__ import annotations

import pytest
import torch

import fused_attn
from fused_attn import testing

HEADS_Q, HEADS_KV, DIM = 4, 2, 16


def expected_of(query, keys, values, lengths, **options):
    """The definition, sequence by sequence: bottom-right aligned attention over the valid prefix."""
    outs, lses = [], []
    for b, length in enumerate(lengths.tolist()):
        out, lse = fused_attn.attention(
            query[b:b + 1].double(), keys[b:b + 1, :, :length].double(), values[b:b + 1, :, :length].double(),
            enable_gqa=True, causal_alignment="bottom_right", return_lse=True, backend="reference",
            **{k: (v[b:b + 1] if k == "alibi_slopes" and v is not None and v.dim() == 2 else v)
               for k, v in options.items()})
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def random_case(generator, dtype, len_q, len_new, capacity, batch=4):
    lengths_before = torch.randint(0, capacity - len_new + 1, (batch,), generator=generator, dtype=torch.int32)
    lengths_before[0] = 0  # an empty cache
    query = torch.randn(batch, HEADS_Q, len_q, DIM, generator=generator).to(dtype)
    new_k = torch.randn(batch, HEADS_KV, len_new, DIM, generator=generator).to(dtype)
    new_v = torch.randn(batch, HEADS_KV, len_new, DIM, generator=generator).to(dtype)
    return lengths_before, query, new_k, new_v


def check(actual, expected, dtype):
    out, lse = actual
    expected_out, expected_lse = expected
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.double(), expected_out, **tolerance)
    seen = torch.isfinite(expected_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen].double(), expected_lse[seen], **tolerance)


OPTIONS = {
    "plain": dict(),
    "window": dict(window_size=(5, -1)),
    "softcap_alibi": dict(softcap=3.0, alibi=True),
    "window_alibi": dict(window_size=(9, 0), alibi=True),
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
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(lengths_before.tolist()):
        expected_k[b, :, start:start + len_new] = new_k[b]
        expected_v[b, :, start:start + len_new] = new_v[b]
    lengths = lengths_before + len_new
    actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k if len_new else None,
                                               new_v if len_new else None, cache_seqlens=lengths_before,
                                               alibi_slopes=slopes, return_lse=True, backend="cpu", **options)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    check(actual, expected_of(query, expected_k, expected_v, lengths, is_causal=True, alibi_slopes=slopes,
                              **options), dtype)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("len_q", [1, 4])
def test_paged_cache_matches_the_dense_one(generator, block_size, len_q):
    """Blocks in a random order, any block size: the same result as the dense cache they map."""
    batch, max_blocks = 3, 7
    capacity = max_blocks * block_size
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, len_q, len_q, capacity, batch)
    dense_k = torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator)
    dense_v = torch.randn(batch, HEADS_KV, capacity, DIM, generator=generator)
    # Scatter the dense caches into shuffled blocks (with spare blocks nobody owns).
    num_blocks = batch * max_blocks + 5
    block_table = torch.randperm(num_blocks, generator=generator)[:batch * max_blocks].view(batch, max_blocks)
    k_blocks = torch.full((num_blocks, block_size, HEADS_KV, DIM), float("nan"))
    v_blocks = torch.full((num_blocks, block_size, HEADS_KV, DIM), float("nan"))
    k_blocks[block_table] = dense_k.transpose(1, 2).unflatten(1, (max_blocks, block_size))
    v_blocks[block_table] = dense_v.transpose(1, 2).unflatten(1, (max_blocks, block_size))
    slopes = torch.rand(batch, HEADS_Q, generator=generator)
    paged = fused_attn.attention_with_kvcache(query, k_blocks, v_blocks, new_k, new_v, cache_seqlens=lengths_before,
                                              block_table=block_table.int(), alibi_slopes=slopes,
                                              window_size=(6, -1), return_lse=True, backend="cpu")
    dense = fused_attn.attention_with_kvcache(query, dense_k, dense_v, new_k, new_v, cache_seqlens=lengths_before,
                                              alibi_slopes=slopes, window_size=(6, -1), return_lse=True,
                                              backend="cpu")
    torch.testing.assert_close(paged[0], dense[0])
    torch.testing.assert_close(paged[1], dense[1])
    # The appended tokens landed in the right blocks.
    gathered = k_blocks[block_table].flatten(1, 2).transpose(1, 2)
    for b, start in enumerate(lengths_before.tolist()):
        assert torch.equal(gathered[b, :, start:start + len_q], new_k[b])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_every_backend_gives_the_definition(generator, backend):
    if (reason := fused_attn.available_backends()[backend]) is not None:
        pytest.skip(reason)
    lengths_before, query, new_k, new_v = random_case(generator, torch.float32, 2, 2, 30)
    k_cache = torch.randn(4, HEADS_KV, 30, DIM, generator=generator)
    v_cache = torch.randn(4, HEADS_KV, 30, DIM, generator=generator)
    actual = fused_attn.attention_with_kvcache(query, k_cache, v_cache, new_k, new_v, cache_seqlens=lengths_before,
                                               softcap=2.0, return_lse=True, backend=backend)
    check(actual, expected_of(query, k_cache, v_cache, lengths_before + 2, is_causal=True, softcap=2.0),
          torch.float32)


@pytest.mark.parametrize("change, error, message", [
    (dict(cache_seqlens=torch.zeros(4, dtype=torch.int64)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.full((4,), 29, dtype=torch.int32)), ValueError, "capacity"),
    (dict(key=torch.zeros(4, HEADS_KV, 2, DIM + 1)), ValueError, "key"),
    (dict(value=None), ValueError, "key, value"),
    (dict(k_cache=torch.zeros(4, HEADS_KV, 30)), ValueError, "k_cache"),
    (dict(block_table=torch.zeros(4, 3, dtype=torch.int64)), ValueError, "block_table"),
    (dict(is_causal=False, alibi_slopes=torch.ones(HEADS_Q)), ValueError, "alibi_slopes"),
])
def test_bad_arguments_are_named(change, error, message):
    arguments = dict(query=torch.zeros(4, HEADS_Q, 3, DIM), k_cache=torch.zeros(4, HEADS_KV, 30, DIM),
                     v_cache=torch.zeros(4, HEADS_KV, 30, DIM), key=torch.zeros(4, HEADS_KV, 2, DIM),
                     value=torch.zeros(4, HEADS_KV, 2, DIM), cache_seqlens=torch.zeros(4, dtype=torch.int32))
    arguments.update(change)
    query = arguments.pop("query")
    with pytest.raises(error, match=message):
        fused_attn.attention_with_kvcache(query, **arguments)
