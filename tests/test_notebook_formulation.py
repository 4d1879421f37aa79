"""The module against multi-head attention written out step by step with einsum: project with
W_Q, W_K, W_V; split heads; row-normalised exp(QKᵀ/√d_h); weighted sum of values; merge heads;
project with W_O. Independent of fused_attn's own reference."""

import pytest
import torch

import fused_attn


def einsum_multihead(x, w_q, w_k, w_v, w_o, heads):
    batch, length, embed = x.shape
    head_dim = embed // heads
    q = torch.einsum("oe,ble->blo", w_q, x).reshape(batch, length, heads, head_dim)
    k = torch.einsum("oe,ble->blo", w_k, x).reshape(batch, length, heads, head_dim)
    v = torch.einsum("oe,ble->blo", w_v, x).reshape(batch, length, heads, head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / head_dim ** 0.5
    unnormalised = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = unnormalised / unnormalised.sum(dim=-1, keepdim=True)
    z = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, embed)
    return torch.einsum("oe,ble->blo", w_o, z), weights


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_module_matches_the_step_by_step_einsum(generator, heads):
    embed, batch, length = 8, 3, 6
    x = torch.randn(batch, length, embed, generator=generator, dtype=torch.float64)
    module = fused_attn.MultiheadAttention(embed, heads, bias=False, batch_first=True, dtype=torch.float64)
    w_q, w_k, w_v = module.in_proj_weight.detach().chunk(3)
    expected, expected_weights = einsum_multihead(x, w_q, w_k, w_v, module.out_proj.weight.detach(), heads)
    out, weights = module(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-12)


def test_split_heads_entry_matches_the_step_by_step_einsum(generator):
    embed, heads = 12, 3
    x = torch.randn(2, 5, embed, generator=generator, dtype=torch.float64)
    w_q, w_k, w_v, w_o = (torch.randn(embed, embed, generator=generator, dtype=torch.float64) / embed ** 0.5
                          for _ in range(4))
    expected, _ = einsum_multihead(x, w_q, w_k, w_v, w_o, heads)
    packed = x @ torch.cat([w_q, w_k, w_v]).T
    merged = fused_attn.split_heads_attention(*packed.chunk(3, dim=-1), num_heads=heads)
    torch.testing.assert_close(merged @ w_o.T, expected, rtol=1e-12, atol=1e-12)
