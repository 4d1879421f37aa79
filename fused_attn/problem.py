"""One description of an attention call, shared by the argument checks, the registry and the kernels.

Every backend receives the same tensors:

    query            (B, H_q,  L_q, D_qk)   any strides
    key              (B, H_kv, L_k, D_qk)   any strides, H_q % H_kv == 0
    value            (B, H_kv, L_k, D_v)    any strides
    attn_mask        None, or a bool (True = attend) or floating (added to the scores) tensor viewed
                     as (B, H_q, L_q, L_k); broadcast dimensions have stride 0, nothing is expanded
    key_padding_mask None, or a bool (B, L_k) tensor, True = ignore that key
    out              (B, H_q, L_q, D_v), written in place through its strides

and returns the log-sum-exp of the scaled, masked scores, (B, H_q, L_q) in `lse_dtype(query.dtype)`
(float32; float64 for float64 inputs), -inf on rows that see no key (whose output is 0).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .scores import PLAIN, ScoreVariant, lse_dtype  # noqa: F401 (lse_dtype: its users import it from here)


class Problem(NamedTuple):
    """What a backend needs to know to decide whether it can run a call. (A named tuple: made once
    per call, and a frozen dataclass costs microseconds to build.)"""

    device: torch.device
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim_qk: int
    head_dim_v: int
    is_causal: bool
    dropout_p: float
    mask_dtype: torch.dtype | None
    mask_requires_grad: bool
    has_key_padding_mask: bool
    score_features: tuple[str, ...] = ()  # what the call's ScoreVariant asks (fused_attn.scores.FEATURES)
    varlen: bool = False  # a packed batch of sequences (fused_attn.varlen); lengths are the largest possible
    cache_dtype: torch.dtype | None = None  # an 8-bit key/value cache's dtype (fused_attn.quantization)
    # Keys and values read from a key/value cache's blocks through a block table (`Backend.forward_paged`): a paged
    # cache, and the dense caches fused_attn.kvcache reads as one (rows named by cache_batch_idx, 8-bit rows).
    paged: bool = False

    @classmethod
    def of(cls, query, key, value, attn_mask, key_padding_mask, is_causal, dropout_p,
           variant: ScoreVariant = PLAIN) -> "Problem":
        batch, heads_q, len_q, head_dim_qk = query.shape
        _, heads_kv, len_k, head_dim_v = value.shape
        return cls(
            device=query.device,
            dtype=query.dtype,
            batch=batch,
            heads_q=heads_q,
            heads_kv=heads_kv,
            len_q=len_q,
            len_k=len_k,
            head_dim_qk=head_dim_qk,
            head_dim_v=head_dim_v,
            is_causal=is_causal,
            dropout_p=dropout_p,
            mask_dtype=None if attn_mask is None else attn_mask.dtype,
            mask_requires_grad=attn_mask is not None and attn_mask.requires_grad,
            has_key_padding_mask=key_padding_mask is not None,
            score_features=variant.features(is_causal),
        )


def output_like(query: torch.Tensor, head_dim_v: int, seq_first: bool) -> torch.Tensor:
    """The output of a call, (B, H_q, L_q, D_v), laid out so that merging heads is a free view.

    Its storage is (B, L_q, H_q, D_v), or (L_q, B, H_q, D_v) when `seq_first`, which is exactly the
    (B, L, E) or (L, B, E) tensor the out-projection reads.
    """
    batch, heads, length, _ = query.shape
    # One allocation with the permuted strides (a new_empty and a permute cost twice the time).
    if seq_first:
        strides = (heads * head_dim_v, head_dim_v, batch * heads * head_dim_v, 1)
    else:
        strides = (length * heads * head_dim_v, head_dim_v, heads * head_dim_v, 1)
    return torch.empty_strided((batch, heads, length, head_dim_v), strides, dtype=query.dtype, device=query.device)
