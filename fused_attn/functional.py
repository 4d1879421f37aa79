"""The public functions: argument checks -> one Problem -> a backend -> the autograd op."""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from . import masks, ops, plans
from .backends import reference, registry
from .checks import (_check_generator, _check_inputs, _check_key_padding_mask, _check_options, _check_tensor,
                     _mask_view, _padding_of, _refuse_forward_mode_ad)
from .dropout import Dropout, next_rng
from .problem import Problem
from .scores import causal_bias_variant, variant_of
from .varlen import nested_attention  # varlen imports nothing of this module


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
            backend, seq_first, generator=None, causal_alignment="top_left", window_size=None, softcap=None,
            alibi_slopes=None, plan_key=None, sinks=None):
    """Checks everything, then runs the chosen backend. Returns (out (B, H_q, L_q, D_v), lse).

    With `plan_key` (fused_attn.plans.key_of of this call), what was concluded is remembered for the
    next call of that key if the call ran a kernel without the op."""
    _check_inputs(query, key, value, enable_gqa)
    _check_options(dropout_p, scale, is_causal)
    _check_generator(generator, query)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected None or a backend name, got {type(backend).__name__}")
    bias_alignment = causal_bias_variant(attn_mask, query, key)
    if bias_alignment is not None:  # PyTorch's CausalBias: causal masking, run in-kernel
        if is_causal:
            raise ValueError("attn_mask: a CausalBias already makes the call causal; pass is_causal=False")
        attn_mask, is_causal, causal_alignment = None, True, bias_alignment
    variant = variant_of(query, causal_alignment, window_size, softcap, alibi_slopes, sinks)
    attn_mask, variant = masks.with_program(attn_mask, variant, is_causal, query, key)
    mask = _mask_view(attn_mask, query, key)
    _check_key_padding_mask(key_padding_mask, query, key)
    mask, key_padding_mask = _padding_of(mask, key_padding_mask)
    default_scale = query.shape[-1] ** -0.5
    scale = default_scale if scale is None else float(scale)
    problem = Problem.of(query, key, value, mask, key_padding_mask, is_causal, float(dropout_p), variant)
    chosen = registry.choose(problem, backend)
    # Drawn whichever backend runs, so that a generator state gives the same dropped elements on all.
    dropout = Dropout(float(dropout_p), next_rng(query.device, generator)) if dropout_p > 0.0 else None
    # The reference runs as differentiable eager code for dropout and masks that need a gradient, as
    # it does for empty problems, where there is nothing for a kernel to do.
    if chosen.name == reference.ReferenceBackend.name and (
            dropout is not None or problem.mask_requires_grad or query.numel() == 0 or key.numel() == 0):
        return reference.attention(query, key, value, mask, key_padding_mask, is_causal, scale, dropout,
                                   variant=variant)
    _refuse_forward_mode_ad(query=query, key=key, value=value, attn_mask=mask)
    result = ops.attention(query, key, value, mask, key_padding_mask, is_causal, scale, float(dropout_p),
                           None if dropout is None else dropout.rng, seq_first, chosen.name, variant)
    if plan_key is not None:
        plans.remember(plan_key, chosen, variant, default_scale, query, value)
    return result


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, key_padding_mask=None, return_lse=False, backend=None, generator=None,
              causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, sinks=None):
    """Exact attention, softmax(Q Kᵀ · scale + mask) V, call-compatible with
    `torch.nn.functional.scaled_dot_product_attention`.

    Args:
        query: (B, H_q, L_q, D_qk), any strides.
        key: (B, H_kv, L_k, D_qk), any strides; H_kv == H_q unless `enable_gqa`.
        value: (B, H_kv, L_k, D_v), any strides.
        attn_mask: bool (True = attend) or additive, of query's dtype, broadcastable to
            (B, H_q, L_q, L_k); or one of PyTorch's `torch.nn.attention.bias.CausalBias` objects
            (`causal_upper_left`, `causal_lower_right`), which run as `is_causal` with their
            alignment, without a mask in memory; or a mask program (`fused_attn.masks.mask_program`),
            or FlexAttention's `BlockMask`, run at the cost of the tiles they keep.
        dropout_p: dropout on the attention weights (applied whenever > 0, as in SDPA): kept weights
            are scaled by 1 / (1 - dropout_p). Which elements are dropped depends only on the
            generator's state and the element's (b, h, i, j), the same on every backend
            (`fused_attn.dropout`; `fused_attn.testing.dropout_mask` gives the mask of a call).
        generator: the torch.Generator dropout draws from (default: that of the tensors' device).
        is_causal: query i sees keys j <= i + offset; may be combined with masks and a window.
        causal_alignment: "top_left" (offset 0, SDPA's meaning), "bottom_right" (offset
            L_k - L_q, flash-attn's: the last query sits on the last key), or an int, the offset
            itself (a block of a longer sequence). It also places the window and ALiBi's distances.
        window_size: (left, right), as flash-attn: query i sees key j iff
            -left <= j - (i + offset) <= right; -1 or None leaves a side unbounded. Key blocks
            outside the window are never visited.
        softcap: c > 0 caps each scaled score s at c · tanh(s / c), before masks and ALiBi.
        alibi_slopes: float32 (H_q,) or (B, H_q): adds -slope · |i + offset - j| to the scores.
        sinks: attention sinks (gpt-oss's `s_aux`), (H_q,) float32 or of query's dtype, may require
            grad: one logit per query head that joins every row's softmax and carries no value, so a
            row's weights sum to 1 / (1 + exp(sinks[h] - lse_visible)). The lse returned includes it; a
            row that sees no key gives 0 and lse sinks[h].
        scale: defaults to 1 / sqrt(D_qk).
        enable_gqa: allow H_q to be a multiple of H_kv (grouped-query attention).
        key_padding_mask: bool (B, L_k), True = ignore that key (as nn.MultiheadAttention).
        return_lse: also return the log-sum-exp of each row, (B, H_q, L_q), float32 (float64
            for float64 inputs).
        backend: a name from `available_backends()`; default automatic.

    Nested tensors: jagged `torch.nested` query, key and value of shape (B, H, j, D) (as
    `scaled_dot_product_attention` takes them) run as `attention_varlen` on their packed values,
    without padding; masks are not taken then, and the log-sum-exp comes packed, (H_q, total_q).

    Returns:
        (B, H_q, L_q, D_v) in query's dtype, or (output, lse) when `return_lse`. A row that sees
        no key gives 0 and lse -inf.
    """
    # Written out rather than as any(...) over a generator: this runs on every call.
    if getattr(query, "is_nested", False) or getattr(key, "is_nested", False) or getattr(value, "is_nested", False):
        return nested_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                key_padding_mask=key_padding_mask, return_lse=return_lse, backend=backend,
                                generator=generator, causal_alignment=causal_alignment, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    plan_key = None
    # A plain call without autograd or tracing to record runs its plan if it has one (fused_attn.plans).
    if sinks is None and forward_ad._current_level < 0 and not ops.needs_op(query, key, value):
        plan_key = plans.key_of(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                key_padding_mask, backend, generator, causal_alignment, window_size, softcap,
                                alibi_slopes)
        plan = None if plan_key is None else plans.find(plan_key)
        if plan is not None:
            out, lse = plans.run(plan, query, key, value, is_causal, scale)
            return (out, lse) if return_lse else out
    out, lse = _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       key_padding_mask, backend, seq_first=False, generator=generator,
                       causal_alignment=causal_alignment, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, plan_key=plan_key, sinks=sinks)
    return (out, lse) if return_lse else out


def _split_heads(name: str, tensor, heads: int, batch_first: bool):
    """(B, L, E) or (L, B, E) -> a (B, H, L, E / H) view of the same storage."""
    _check_tensor(name, tensor, 3, "(B, L, E)" if batch_first else "(L, B, E)")
    if tensor.shape[-1] % heads != 0:
        raise ValueError(f"{name}: expected an embedding size divisible by {heads} heads, "
                         f"got {tensor.shape[-1]}")
    heads_view = tensor.unflatten(-1, (heads, tensor.shape[-1] // heads))
    return heads_view.permute(0, 2, 1, 3) if batch_first else heads_view.permute(1, 2, 0, 3)


def split_heads_attention(query, key, value, num_heads, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, *, num_kv_heads=None, key_padding_mask=None, batch_first=True,
                          return_lse=False, backend=None, generator=None, causal_alignment="top_left",
                          window_size=None, softcap=None, alibi_slopes=None, sinks=None):
    """Multi-head attention on unsplit (B, L, E) tensors: split heads, attend, merge heads, fused.

    The heads are read through strides (the three slices of one packed (B, L, 3E) projection work
    as they are) and the output is written straight into the merged layout.

    Args:
        query: (B, L_q, E_q), or (L_q, B, E_q) when not `batch_first`; E_q = num_heads · D_qk.
            Unbatched, as nn.MultiheadAttention takes them: (L_q, E_q), with key and value 2-D too.
        key: (B, L_k, E_k) with E_k = num_kv_heads · D_qk; likewise (L_k, B, E_k).
        value: (B, L_k, E_v) with E_v = num_kv_heads · D_v; likewise (L_k, B, E_v).
        num_heads: H_q. num_kv_heads: H_kv, default H_q (a divisor of H_q for GQA).
        The other arguments are those of `attention`, masks in (B, H_q, L_q, L_k) terms (unbatched:
        (H_q, L_q, L_k) or (L_q, L_k), and a key_padding_mask of (L_k,)).

    Returns:
        (B, L_q, H_q · D_v), or (L_q, B, H_q · D_v) when not `batch_first` (unbatched: (L_q, H_q · D_v));
        with the log-sum-exp (B, H_q, L_q) (unbatched: (H_q, L_q)) when `return_lse`.
    """
    if isinstance(query, torch.Tensor) and query.dim() == 2:
        for name, tensor in (("key", key), ("value", value)):
            _check_tensor(name, tensor, 2, "(L, E), unbatched as query")
        batch_dim = 0 if batch_first else 1
        if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() == 1:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        result = split_heads_attention(
            query.unsqueeze(batch_dim), key.unsqueeze(batch_dim), value.unsqueeze(batch_dim), num_heads, attn_mask,
            dropout_p, is_causal, scale, num_kv_heads=num_kv_heads, key_padding_mask=key_padding_mask,
            batch_first=batch_first, return_lse=return_lse, backend=backend, generator=generator,
            causal_alignment=causal_alignment, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=sinks)
        if return_lse:
            return result[0].squeeze(batch_dim), result[1][0]
        return result.squeeze(batch_dim)
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if not isinstance(num_kv_heads, int) or isinstance(num_kv_heads, bool) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads: expected a positive int, got {num_kv_heads!r}")
    q = _split_heads("query", query, num_heads, batch_first)
    k = _split_heads("key", key, num_kv_heads, batch_first)
    v = _split_heads("value", value, num_kv_heads, batch_first)
    out, lse = _attend(q, k, v, attn_mask, dropout_p, is_causal, scale, num_kv_heads != num_heads,
                       key_padding_mask, backend, seq_first=not batch_first, generator=generator,
                       causal_alignment=causal_alignment, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, sinks=sinks)
    merged = out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)
    merged = merged.reshape(*merged.shape[:2], -1)
    return (merged, lse) if return_lse else merged
