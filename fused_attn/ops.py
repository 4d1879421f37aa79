"""The torch.library ops of fused calls: forward, backward, their fake kernels, autograd.

The ops take the backend's name as an argument, so one registration serves every backend and
`torch.compile` sees a single opaque op whichever kernel runs inside it. `attention` is the entry
point: the op, or, where the op would only add its Python layers (~35 µs a call), its body.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _extension
from .backends import registry
from .dropout import Dropout, check_rng
from .problem import lse_dtype, output_like
from .scores import from_op_args, sink_gradient


def _dropout(dropout_p: float, dropout_rng: Optional[Tensor], query: Tensor) -> Optional[Dropout]:
    """The op's dropout arguments as one value; the kernels read the rng tensor, so it is checked."""
    if dropout_p == 0.0:
        return None
    if not 0.0 < dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    check_rng(dropout_rng, query.device)
    return Dropout(dropout_p, dropout_rng)


def _run_forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout, seq_first, backend,
                 variant):
    out = output_like(query, value.shape[-1], seq_first)
    lse = registry.get(backend).forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out,
                                        dropout, variant)
    return out, lse


def _forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_rng,
             seq_first, backend, window_left=-1, window_right=-1, bottom_right=False, softcap=0.0,
             alibi_slopes=None, diagonal_shift=0, block_tiles=None, block_bits=None, sinks=None):
    return _run_forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                        _dropout(dropout_p, dropout_rng, query), seq_first, backend,
                        from_op_args(window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift,
                                     block_tiles, block_bits, sinks))


@torch.library.custom_op("fused_attn::attention_fwd", mutates_args=())
def attention_fwd(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                  key_padding_mask: Optional[Tensor], is_causal: bool, scale: float, dropout_p: float,
                  dropout_rng: Optional[Tensor], seq_first: bool, backend: str, window_left: int = -1,
                  window_right: int = -1, bottom_right: bool = False, softcap: float = 0.0,
                  alibi_slopes: Optional[Tensor] = None, diagonal_shift: int = 0,
                  block_tiles: Optional[Tensor] = None, block_bits: Optional[Tensor] = None,
                  sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(B, H_q, L_q, D_v) output, laid out as in `output_like`, and its log-sum-exp (B, H_q, L_q).

    `dropout_rng` is the call's (seed, offset, query_start, key_start), int64 (4,) (fused_attn.dropout),
    when dropout_p > 0. The last nine arguments are the call's fused_attn.scores.ScoreVariant (`op_args`).
    """
    return _forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                    dropout_rng, seq_first, backend, window_left, window_right, bottom_right, softcap,
                    alibi_slopes, diagonal_shift, block_tiles, block_bits, sinks)


def needs_op(*tensors: Optional[Tensor]) -> bool:
    """Whether a forward on these tensors must go through the op: to record autograd, to be traced
    (torch.compile), or to meet tensor subclasses, dispatch modes (fake tensors) or functorch
    transforms (vmap, grad), which all work on ops."""
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:  # a loop, not any(...) over a generator: this runs on every call
        if t is not None and (type(t) is not Tensor or (grad and t.requires_grad)):
            return True
    return False


def attention(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_rng,
              seq_first, backend, variant):
    """`attention_fwd`, called as the op where `needs_op`, else as its body: same result."""
    if needs_op(query, key, value, attn_mask, key_padding_mask, variant.alibi_slopes, variant.sinks,
                variant.block_tiles):
        return attention_fwd(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                             dropout_rng, seq_first, backend, *variant.op_args())
    return _run_forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                        _dropout(dropout_p, dropout_rng, query), seq_first, backend, variant)


@attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                        dropout_rng, seq_first, backend, window_left=-1, window_right=-1, bottom_right=False,
                        softcap=0.0, alibi_slopes=None, diagonal_shift=0, block_tiles=None, block_bits=None,
                        sinks=None):
    out = output_like(query, value.shape[-1], seq_first)
    lse = query.new_empty(query.shape[:-1], dtype=lse_dtype(query.dtype))
    return out, lse


@torch.library.custom_op("fused_attn::attention_bwd", mutates_args=())
def attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], query: Tensor, key: Tensor,
                  value: Tensor, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor],
                  key_padding_mask: Optional[Tensor], is_causal: bool, scale: float, dropout_p: float,
                  dropout_rng: Optional[Tensor], backend: str, mask_grad: bool = False,
                  window_left: int = -1, window_right: int = -1, bottom_right: bool = False,
                  softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                  diagonal_shift: int = 0, block_tiles: Optional[Tensor] = None,
                  block_bits: Optional[Tensor] = None,
                  sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients with respect to query, key, value and, with `mask_grad`, the (additive) mask as the
    kernels see it, (B, H_q, L_q, L_k); without, an empty tensor in its place. (The sinks' gradient
    needs only `out`, `lse` and `grad_out`: fused_attn.scores.sink_gradient.)"""
    grad_mask = _new_grad_mask(query, attn_mask, mask_grad)
    variant = from_op_args(window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                           block_bits, sinks)
    grads = registry.get(backend).backward(query, key, value, attn_mask, key_padding_mask, is_causal,
                                           scale, out, lse, grad_out, grad_lse,
                                           _dropout(dropout_p, dropout_rng, query),
                                           grad_mask if mask_grad else None, variant)
    return (*grads, grad_mask)


def _new_grad_mask(query: Tensor, attn_mask: Optional[Tensor], mask_grad: bool) -> Tensor:
    """Zeros the shape of the mask's (B, H_q, L_q, L_k) view, dense (the kernels write the visible
    elements), or an empty placeholder when no mask gradient is asked for."""
    if not mask_grad:
        return query.new_empty(0)
    return torch.zeros(attn_mask.shape, dtype=attn_mask.dtype, device=attn_mask.device)


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out, grad_lse, query, key, value, out, lse, attn_mask, key_padding_mask,
                        is_causal, scale, dropout_p, dropout_rng, backend, mask_grad=False, window_left=-1,
                        window_right=-1, bottom_right=False, softcap=0.0, alibi_slopes=None, diagonal_shift=0,
                        block_tiles=None, block_bits=None, sinks=None):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            _new_grad_mask(query, attn_mask, mask_grad))


def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, key_padding_mask, is_causal, scale, dropout_p, dropout_rng, _, backend,
     window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles, block_bits,
     sinks) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, key_padding_mask, dropout_rng, alibi_slopes,
                          block_tiles, block_bits, sinks)
    ctx.is_causal, ctx.scale, ctx.dropout_p, ctx.backend = is_causal, scale, dropout_p, backend
    ctx.variant_args = (window_left, window_right, bottom_right, softcap)
    ctx.diagonal_shift = diagonal_shift
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    (query, key, value, out, lse, attn_mask, key_padding_mask, dropout_rng, alibi_slopes, block_tiles, block_bits,
     sinks) = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    mask_grad = bool(ctx.needs_input_grad[3])
    grad_query, grad_key, grad_value, grad_mask = attention_bwd(
        grad_out, grad_lse, query, key, value, out, lse, attn_mask, key_padding_mask, ctx.is_causal,
        ctx.scale, ctx.dropout_p, dropout_rng, ctx.backend, mask_grad, *ctx.variant_args, alibi_slopes,
        ctx.diagonal_shift, block_tiles, block_bits, sinks)
    # (needs_input_grad covers the arguments given: sinks, the last, are given when they are not None.)
    wants_sinks = sinks is not None and ctx.needs_input_grad[19]
    grad_sinks = sink_gradient(sinks, lse, out, grad_out, grad_lse) if wants_sinks else None
    return (grad_query, grad_key, grad_value, grad_mask if mask_grad else None,
            *(None,) * 15, grad_sinks)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)

if _extension._C is not None:
    @torch.library.register_fake("fused_attn::row_dots")
    def _row_dots_fake(a, b):
        return a.new_empty(a.shape[:-1], dtype=lse_dtype(a.dtype))

    @torch.library.register_fake("fused_attn::rotary")
    def _rotary_fake(x, cos, sin, positions, interleaved):
        return torch.empty_like(x)
