"""Packed batches of sequences (fused_attn.varlen) run one sequence at a time: the default of
`Backend.forward_varlen` / `backward_varlen` for backends whose kernels do not read sequence bounds;
and paged caches gathered into dense ones, the default of `Backend.forward_paged`.

Sequence b is a strided (1, H, L, D) view of the packed (total, H, D) tensors, so the ordinary kernels
read and write the packed storage in place. The bounds are read on the host (free for CPU tensors).
Sequence b's dropout is a one-sequence call's with the call's (seed, offset + b).
"""

from __future__ import annotations

import dataclasses

import torch

from ..dropout import Dropout, shifted_rng
from ..masks import TILE
from ..quantization import dequantize
from ..scores import ScoreVariant


def sequence_view(packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start .. end of a packed (total, H, ...) tensor as a (1, H, L, ...) view."""
    return packed[start:end].transpose(0, 1).unsqueeze(0)


def sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(b, q_start, q_end, k_start, k_end) of every sequence, read on the host."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(b, bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]) for b in range(len(bounds_q) - 1)]


def sequence_dropout(dropout: Dropout | None, b: int) -> Dropout | None:
    if dropout is None:
        return None
    return Dropout(dropout.p, shifted_rng(dropout.rng, offset=b))


def sequence_variant(variant: ScoreVariant, b: int, len_q: int, len_k: int) -> ScoreVariant:
    """The variant of sequence b (len_q queries, len_k keys): its row of the (B, H_q) ALiBi slopes and of the mask
    program's tiles, those that cover its positions."""
    if variant.alibi_slopes is not None:
        variant = dataclasses.replace(variant, alibi_slopes=variant.alibi_slopes[b:b + 1])
    if variant.block_tiles is not None:
        tiles = variant.block_tiles[b:b + 1, :, :-(-len_q // TILE), :-(-len_k // TILE)]
        variant = dataclasses.replace(variant, block_tiles=tiles)
    return variant


def forward(backend, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse, dropout, variant):
    for b, q0, q1, k0, k1 in sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        seq_out, seq_lse = sequence_view(out, q0, q1), lse[:, q0:q1]
        if k1 == k0:  # a sequence without keys: every row sees none (but its sink)
            seq_out.zero_()
            if variant.sinks is None:
                seq_lse.fill_(float("-inf"))
            else:
                seq_lse.copy_(variant.sinks[:, None].to(seq_lse.dtype))
            continue
        seq_lse.copy_(backend.forward(sequence_view(query, q0, q1), sequence_view(key, k0, k1),
                                      sequence_view(value, k0, k1), None, None, is_causal, scale, seq_out,
                                      sequence_dropout(dropout, b), sequence_variant(variant, b, q1 - q0, k1 - k0))[0])


def backward(backend, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse, grad_out, grad_lse,
             dropout, variant):
    # Zeros: the tokens of sequences without queries or without keys get no gradient.
    grads = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for b, q0, q1, k0, k1 in sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        seq_grad_lse = None if grad_lse is None else grad_lse[:, q0:q1].unsqueeze(0)
        seq_grads = backend.backward(sequence_view(query, q0, q1), sequence_view(key, k0, k1),
                                     sequence_view(value, k0, k1), None, None, is_causal, scale,
                                     sequence_view(out, q0, q1), lse[:, q0:q1].unsqueeze(0),
                                     sequence_view(grad_out, q0, q1), seq_grad_lse, sequence_dropout(dropout, b),
                                     None, sequence_variant(variant, b, q1 - q0, k1 - k0))
        for packed, grad, (start, end) in zip(grads, seq_grads, ((q0, q1), (k0, k1), (k0, k1))):
            sequence_view(packed, start, end).copy_(grad)
    return grads


def _gathered(blocks: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The blocks of each row of `block_table`, (B, H_kv, max_blocks · block_size, ...); entries that are no block
    index read block 0."""
    table = block_table.long()
    table = table.where((table >= 0) & (table < blocks.shape[0]), 0)
    return blocks[table].flatten(1, 2).transpose(1, 2)


def gathered_blocks(blocks: torch.Tensor, block_table: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """The (B, H_kv, max_blocks · block_size, D) dense copy of a paged cache's sequences, zeros where
    `key_padding_mask` (B, L_k) hides a key: what lies past a sequence's end, even NaN or a table entry
    that is no block index, never reaches the result."""
    return _gathered(blocks, block_table).masked_fill(key_padding_mask[:, None, :, None], 0)


def gathered_cache(blocks, scales, block_table, key_padding_mask, dtype) -> torch.Tensor:
    """`gathered_blocks` of a paged cache, dequantized into `dtype` where it is 8-bit: `scales` (B, H_kv), one
    per sequence and head, or (num_blocks, block_size, H_kv), one per stored key and head (Backend.forward_paged)."""
    if scales is None:
        return gathered_blocks(blocks, block_table, key_padding_mask)
    dense = _gathered(blocks, block_table)
    if scales.dim() == 2:
        dense_scales = scales[:, :, None].expand(dense.shape[:3])
    else:
        dense_scales = _gathered(scales, block_table)
    return dequantize(dense, dense_scales, dtype).masked_fill(key_padding_mask[:, None, :, None], 0)
