"""`fused_attn.flex_attention`: FlexAttention's call, for the calls whose only modification is a mask."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxOutput, BlockMask

from .functional import attention


def _check_block_mask(block_mask, query, key) -> None:
    if block_mask is None:
        return
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected None or a torch.nn.attention.flex_attention.BlockMask "
                        f"(create_block_mask), got {type(block_mask).__name__}")
    if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 4:
        lengths = (query.shape[2], key.shape[2])
        if tuple(block_mask.seq_lengths) != lengths:
            raise ValueError(f"block_mask: made for (L_q, L_k) = {tuple(block_mask.seq_lengths)}, the call has "
                             f"{lengths}; make one for these lengths (or crop it with BlockMask._adjust)")


def _wants_lse(return_lse: bool, return_aux) -> bool:
    if return_aux is None:
        return bool(return_lse)
    if return_lse:
        raise ValueError("return_lse: give return_lse or return_aux, not both (return_aux=AuxRequest(lse=True) "
                         "replaces return_lse)")
    if getattr(return_aux, "max_scores", False):
        raise ValueError("return_aux: max_scores is not computed by fused_attn; ask for lse only")
    return bool(getattr(return_aux, "lse", False))


def broadcast_batch(query, key, value):
    """(key, value) with a batch of 1 viewed as query's batch, which FlexAttention allows; as given
    otherwise (the checks of `attention` refuse what does not fit)."""
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)) \
            and key.shape[0] == value.shape[0] == 1 != query.shape[0]:
        return key.expand(query.shape[0], -1, -1, -1), value.expand(query.shape[0], -1, -1, -1)
    return key, value


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None, backend=None):
    """`torch.nn.attention.flex_attention.flex_attention` for masks: the same call and results, run on
    fused_attn's kernels, forward and backward, without torch.compile.

    Args:
        query: (B, H_q, L_q, D_qk); key: (B or 1, H_kv, L_k, D_qk); value: (B or 1, H_kv, L_k, D_v), any
            strides (a batch of 1 is broadcast, as FlexAttention does).
        score_mod: not taken: None only (a mask comes as the BlockMask's mask_mod).
        block_mask: None (every query sees every key) or a BlockMask for (L_q, L_k), as
            `create_block_mask` makes it; it runs as its mask program
            (`fused_attn.masks.program_of_block_mask`), made at its first call and kept as long as it
            lives, so every layer and the backward reuse it.
        scale: defaults to 1 / sqrt(D_qk). enable_gqa: H_q a multiple of H_kv.
        return_lse: also return the log-sum-exp of each row (natural log, (B, H_q, L_q), float32; float64
            for float64 inputs); -inf on rows that see no key, whose output is 0.
        kernel_options: accepted and ignored (FlexAttention's Triton tuning; fused_attn chooses its own).
        return_aux: `AuxRequest(lse=True)` returns (output, AuxOutput(lse=..., max_scores=None)); max_scores
            is not computed (ValueError).
        backend: a fused_attn backend name; default automatic, as `attention`.

    Returns:
        (B, H_q, L_q, D_v) in query's dtype; with (output, lse) or (output, AuxOutput) as asked.
    """
    if score_mod is not None:
        raise ValueError("score_mod: fused_attn.flex_attention takes no score_mod; a mask is given as the "
                         "mask_mod of a BlockMask (block_mask=create_block_mask(mask_mod, ...)); use "
                         "torch.nn.attention.flex_attention.flex_attention for score_mod")
    _check_block_mask(block_mask, query, key)
    wants_lse = _wants_lse(return_lse, return_aux)
    key, value = broadcast_batch(query, key, value)
    out, lse = attention(query, key, value, attn_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                         return_lse=True, backend=backend)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if wants_lse else None, max_scores=None)
    return (out, lse) if wants_lse else out
