"""The einsum formulation: scores, softmax, weighted sum of values. The oracle of every other backend.

It materialises the (L_q, L_k) scores, so its memory grows with L². Everything here is plain
differentiable PyTorch, so it also serves the calls no fused backend can run here (float64 on a
GPU, say), and `MultiheadAttention`'s weights after dropout.
"""

from __future__ import annotations

import torch

from .. import masks
from .. import scores as score_variants
from ..dropout import Dropout, keep_mask
from ..problem import lse_dtype
from ..scores import PLAIN, ScoreVariant
from .base import Backend


def _grouped(query: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(B, H_q, L, D) -> (B, H_kv, G, L, D): query heads grouped by the key/value head they share."""
    batch, heads_q, length, dim = query.shape
    return query.reshape(batch, heads_kv, heads_q // heads_kv, length, dim)


def scaled_scores(query, key, scale=None):
    """scale · Q Kᵀ, (B, H_q, L_q, L_k) in the query's dtype."""
    batch, heads_q, len_q, head_dim = query.shape
    heads_kv, len_k = key.shape[1], key.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    scores = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(query, heads_kv), key)
    return scores.reshape(batch, heads_q, len_q, len_k) * scale


def masked_scores(query, key, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                  variant: ScoreVariant = PLAIN):
    """The scores the softmax takes, (B, H_q, L_q, L_k) in the query's dtype: scaled, capped, plus the
    additive mask and ALiBi, -inf where a key is hidden (fused_attn.scores gives the order)."""
    batch, heads_q, len_q, len_k = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    scores = scaled_scores(query, key, scale)
    if variant.softcap > 0.0:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    visible, alibi = score_variants.terms(variant, is_causal, batch, heads_q, len_q, len_k, query.device)
    if alibi is not None:
        scores = scores + alibi.to(scores.dtype)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if variant.block_tiles is not None:  # a mask program, materialised: the oracle's definition of it
        scores = scores.masked_fill(~masks.dense_of(variant.block_tiles, variant.block_bits, len_q, len_k),
                                    float("-inf"))
    return scores


def _rows_that_see_a_key(scores: torch.Tensor):
    """(mask of rows with a visible key (…, 1), scores with the other rows zeroed).

    Softmax and log-sum-exp of an all -inf row are NaN, and so are their gradients; computing them
    on zeros and selecting afterwards keeps both the values and the gradients of such rows finite.
    A NaN score is a visible one: its row comes out NaN, as in SDPA, rather than hidden.
    """
    sees_a_key = (scores != float("-inf")).any(dim=-1, keepdim=True)
    return sees_a_key, torch.where(sees_a_key, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))


def probabilities(scores: torch.Tensor) -> torch.Tensor:
    """Row softmax of masked scores; a row that sees no key is all zeros (never NaN, also in backward)."""
    sees_a_key, safe_scores = _rows_that_see_a_key(scores)
    return torch.where(sees_a_key, torch.softmax(safe_scores, dim=-1), 0.0)


def log_sum_exp(scores: torch.Tensor) -> torch.Tensor:
    """Row log-sum-exp in `lse_dtype`; -inf (with zero gradient) for a row that sees no key."""
    sees_a_key, safe_scores = _rows_that_see_a_key(scores)
    lse = torch.logsumexp(safe_scores.to(lse_dtype(scores.dtype)), dim=-1)
    return torch.where(sees_a_key.squeeze(-1), lse, float("-inf"))


def weighted_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(B, H_q, L_q, L_k) probabilities times (B, H_kv, L_k, D_v) values -> (B, H_q, L_q, D_v)."""
    batch, heads_q, len_q, _ = probs.shape
    heads_kv = value.shape[1]
    out = torch.einsum("bhgqk,bhkd->bhgqd", _grouped(probs, heads_kv), value)
    return out.reshape(batch, heads_q, len_q, value.shape[-1])


def dropped(probs: torch.Tensor, dropout: Dropout | None) -> torch.Tensor:
    """The weights after dropout: the elements fused_attn.dropout keeps, scaled by 1 / (1 - p)."""
    if dropout is None:
        return probs
    keep = keep_mask(dropout, *probs.shape)
    return torch.where(keep, probs * dropout.keep_scale, torch.zeros((), dtype=probs.dtype, device=probs.device))


def with_sink_column(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The scores with each head's sink logit as one more key column (gpt-oss's definition): the softmax
    over it is the call's; the column is dropped before the values are weighed."""
    if sinks is None:
        return scores
    batch, heads, len_q, _ = scores.shape
    column = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(batch, heads, len_q, 1)
    return torch.cat([scores, column], dim=-1)


def attention(query, key, value, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
              dropout=None, return_weights=False, variant: ScoreVariant = PLAIN):
    """Differentiable attention in the inputs' dtype: returns (out, lse) or (out, lse, weights).

    `lse` is in `lse_dtype(query.dtype)` (of the undropped scores); `weights` are the probabilities
    after `dropout` (a fused_attn.dropout.Dropout, or None), the ones that multiplied the values.
    """
    scores = with_sink_column(masked_scores(query, key, attn_mask, key_padding_mask, is_causal, scale, variant),
                              variant.sinks)
    lse = log_sum_exp(scores)
    probs = probabilities(scores)
    if variant.sinks is not None:
        probs = probs[..., :-1]
    probs = dropped(probs, dropout)
    out = weighted_values(probs, value)
    return (out, lse, probs) if return_weights else (out, lse)


def _sum_over_groups(grad: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(B, H_q, L, D) -> (B, H_kv, L, D): a key/value head's gradient gathers its whole query group."""
    batch, heads_q, length, dim = grad.shape
    return grad.reshape(batch, heads_kv, heads_q // heads_kv, length, dim).sum(dim=2)


class ReferenceBackend(Backend):
    name = "reference"
    devices = ("cpu", "cuda")
    takes_dropout = True
    takes_mask_gradient = True
    takes_score_variants = frozenset(score_variants.FEATURES)
    takes_varlen = True

    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout=None,
                variant=PLAIN):
        result, lse = attention(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout,
                                variant=variant)
        out.copy_(result)
        return lse

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                 grad_out, grad_lse, dropout=None, grad_mask=None, variant=PLAIN):
        heads_kv = key.shape[1]
        scores = masked_scores(query, key, attn_mask, key_padding_mask, is_causal, scale, variant)
        # The weights of the given log-sum-exp, as the kernels take them: a call on part of a row's keys
        # (a ring attention step) gets its share of the whole row's softmax.
        seen = torch.isfinite(lse).unsqueeze(-1)
        shift = torch.where(seen, lse.unsqueeze(-1), 0.0)
        probs = torch.where(seen, torch.exp(scores.to(lse.dtype) - shift), 0.0).to(scores.dtype)
        grad_value = _sum_over_groups(torch.einsum("bhqk,bhqd->bhkd", dropped(probs, dropout), grad_out),
                                      heads_kv)
        grad_probs = torch.einsum("bhgqd,bhkd->bhgqk", _grouped(grad_out, heads_kv), value)
        # The gradient of the undropped weights: dropout's mask and scale, applied to the other side.
        grad_probs = dropped(grad_probs.reshape(probs.shape), dropout)
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            delta = delta - grad_lse.unsqueeze(-1)
        grad_scores = probs * (grad_probs - delta.to(probs.dtype))
        if grad_mask is not None:  # the mask is added to the scaled scores: its gradient is dS itself
            grad_mask.copy_(grad_scores)
        if variant.softcap > 0.0:  # d/ds c·tanh(s/c) = 1 - tanh²(s/c)
            capped = torch.tanh(scaled_scores(query, key, scale) / variant.softcap)
            grad_scores = grad_scores * (1 - capped * capped)
        grad_scores = grad_scores * scale
        grad_query = weighted_values(grad_scores, key)
        grad_key = _sum_over_groups(torch.einsum("bhqk,bhqd->bhkd", grad_scores, query), heads_kv)
        return tuple(torch.empty_like(like).copy_(grad) for grad, like in
                     ((grad_query, query), (grad_key, key), (grad_value, value)))
