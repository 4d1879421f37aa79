"""Rotary position embedding (RoPE) as `attention_with_kvcache` applies it, with flash-attn's tables.

The tables are `cos`/`sin` of shape (seqlen_ro, rotary_dim / 2): row p holds the angles of position p.
Only the first rotary_dim dimensions of a head turn; they form rotary_dim / 2 pairs (x1, x2), each
turned by its angle: (x1·cos − x2·sin, x1·sin + x2·cos). `interleaved` pairs dimensions (2i, 2i + 1)
(GPT-J); otherwise (i, i + rotary_dim / 2) (GPT-NeoX). The products are computed in float32 (float64
for float64 tensors) and rounded once to the tensor's dtype.

`rotate` is the single place that does it, on q and the new keys before the kernels: on the CPU in one
pass of the extension's `rotary` op (a decode step's dozen small torch operations cost a tenth of the
step, bench/NOTES.md section 35), elsewhere in torch. Both round the same way, bit for bit.
"""

from __future__ import annotations

import torch

from . import _extension


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """x (B, H, L, D) turned at positions (B, L) (int64, each in [0, seqlen_ro)), as a new tensor;
    dimensions from rotary_dim on are copied unchanged."""
    half = cos.shape[1]
    if half == 0:
        return x
    if x.device.type == "cpu" and _extension._C is not None:
        return torch.ops.fused_attn.rotary(x, cos, sin, positions, interleaved)
    return rotate_in_torch(x, cos, sin, positions, interleaved)


def rotate_in_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    interleaved: bool) -> torch.Tensor:
    """`rotate` in torch operations, on any device."""
    half = cos.shape[1]
    compute = torch.promote_types(x.dtype, torch.float32)
    cos_at = cos[positions].to(compute).unsqueeze(1)  # (B, 1, L, half): one angle for every head
    sin_at = sin[positions].to(compute).unsqueeze(1)
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    x1, x2 = x[..., first].to(compute), x[..., second].to(compute)
    out = x.clone()
    out[..., first] = x1 * cos_at - x2 * sin_at
    out[..., second] = x1 * sin_at + x2 * cos_at
    return out
