"""`attention_varlen`: a batch of sequences of different lengths, packed without padding.

Sequence b holds query tokens `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` and key/value tokens
`cu_seqlens_k[b] .. cu_seqlens_k[b + 1]` of the packed `(total_tokens, H, D)` tensors, as in
flash-attn's `flash_attn_varlen_func`. Each sequence is its own attention problem: positions, causal
alignment, windows and ALiBi distances are counted within the sequence.

How the backends see it (`Backend.forward_varlen`, for those that declare `takes_varlen`): the cpu
and reference backends run their ordinary kernels on each sequence's strided `(1, H, L, D)` view of
the packed tensors in turn, reading and writing the packed storage in place, the bounds read on the
host (fused_attn.backends.packed); the triton and cuda kernels read each sequence's bounds
themselves, one launch per kernel for the whole batch, with no host synchronisation when
`max_seqlen_q/k` are given (their grid is made for them; otherwise they are read from the lengths).

Dropout: the call draws one (seed, offset); sequence b drops the elements that a one-sequence call
with (seed, offset + b) drops (fused_attn.dropout), so sequences never share a random stream.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import masks
from .backends import registry
from .checks import (_check_generator, _check_options, _check_tensor, _refuse_forward_mode_ad, assert_on_device,
                     check_dtypes_and_devices)
from .dropout import Dropout, check_rng, next_rng
from .ops import needs_op
from .problem import Problem, lse_dtype
from .scores import from_op_args, sink_gradient, variant_of


def _check_packed(query, key, value) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, tensor, 3, "(total_tokens, H, D)")
    check_dtypes_and_devices(query, key, value)
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(f"value: expected (total_k, H_kv) = {tuple(key.shape[:2])} (as key), got {tuple(value.shape[:2])}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"key: expected head dim {query.shape[2]} (as query), got {key.shape[2]}")
    if query.shape[2] < 1 or value.shape[2] < 1:
        raise ValueError(f"query, value: expected head dims of at least 1, got {query.shape[2]} and {value.shape[2]}")
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"key: expected a number of heads dividing the query's {heads_q}, got {heads_kv}")


def _check_cu_seqlens(name: str, cu_seqlens, device) -> None:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{name}: expected an int32 (or int64) tensor (B + 1,) of cumulative sequence lengths, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} of shape "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name}: expected device {device} (as query), got {cu_seqlens.device}")


def _check_max_seqlen(name: str, max_seqlen) -> int:
    """-1 for None (no bound given), else the bound as an int."""
    if max_seqlen is None:
        return -1
    if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise ValueError(f"{name}: expected None or an int >= 0, got {max_seqlen!r}")
    return int(max_seqlen)


def _check_bounds(name: str, cu_seqlens: Tensor, total: int, max_seqlen: int, max_name: str) -> None:
    """The values of cu_seqlens: 0 first, non-decreasing, `total` last, no sequence over `max_seqlen`
    (-1: unbounded). Raises at once for CPU tensors; for GPU tensors a device-side assertion, queued
    before the kernels, stops the stream there (the error is reported at the next synchronisation)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (lengths >= 0).all()
    assert_on_device(ok, f"{name}: expected cumulative lengths starting at 0, non-decreasing, ending at the "
                         f"{total} packed tokens")
    if max_seqlen >= 0:
        assert_on_device((lengths <= max_seqlen).all(),
                         f"{max_name}: a sequence of {name} is longer than the {max_seqlen} given")


def _check_op_args(query, key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_rng,
                   alibi_slopes) -> None:
    """What the op relies on, checked in its body (it runs with real tensors, also under torch.compile)."""
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} (as cu_seqlens_q), got "
                         f"{tuple(cu_seqlens_k.shape)}")
    _check_bounds("cu_seqlens_q", cu_seqlens_q, query.shape[0], max_seqlen_q, "max_seqlen_q")
    _check_bounds("cu_seqlens_k", cu_seqlens_k, key.shape[0], max_seqlen_k, "max_seqlen_k")
    if dropout_p > 0.0:
        check_rng(dropout_rng, query.device)
    batch = cu_seqlens_q.shape[0] - 1
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (batch, query.shape[1]):
        raise ValueError(f"alibi_slopes: expected (B, H_q) = ({batch}, {query.shape[1]}), got "
                         f"{tuple(alibi_slopes.shape)}")


def _dropout(dropout_p: float, dropout_rng: Optional[Tensor]) -> Optional[Dropout]:
    return None if dropout_p == 0.0 else Dropout(dropout_p, dropout_rng)


def _new_outputs(query, value) -> tuple[Tensor, Tensor]:
    """The packed output (total_q, H_q, D_v) and log-sum-exp (H_q, total_q)."""
    out = query.new_empty((query.shape[0], query.shape[1], value.shape[2]))
    return out, query.new_empty((query.shape[1], query.shape[0]), dtype=lse_dtype(query.dtype))


def _varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                    dropout_p, dropout_rng, backend, window_left, window_right, bottom_right, softcap, alibi_slopes,
                    diagonal_shift, block_tiles=None, block_bits=None, sinks=None):
    _check_op_args(query, key, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_rng,
                   alibi_slopes)
    out, lse = _new_outputs(query, value)
    registry.get(backend).forward_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, out, lse,
        _dropout(dropout_p, dropout_rng),
        from_op_args(window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                     block_bits, sinks))
    return out, lse


@torch.library.custom_op("fused_attn::varlen_fwd", mutates_args=())
def varlen_fwd(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float, dropout_p: float,
               dropout_rng: Optional[Tensor], backend: str, window_left: int = -1, window_right: int = -1,
               bottom_right: bool = False, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
               diagonal_shift: int = 0, block_tiles: Optional[Tensor] = None, block_bits: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Packed output (total_q, H_q, D_v) and log-sum-exp (H_q, total_q); max_seqlen -1: not given."""
    return _varlen_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                           scale, dropout_p, dropout_rng, backend, window_left, window_right, bottom_right, softcap,
                           alibi_slopes, diagonal_shift, block_tiles, block_bits, sinks)


@varlen_fwd.register_fake
def _varlen_fwd_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                     dropout_p, dropout_rng, backend, window_left=-1, window_right=-1, bottom_right=False,
                     softcap=0.0, alibi_slopes=None, diagonal_shift=0, block_tiles=None, block_bits=None, sinks=None):
    return _new_outputs(query, value)


@torch.library.custom_op("fused_attn::varlen_bwd", mutates_args=())
def varlen_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], query: Tensor, key: Tensor, value: Tensor,
               out: Tensor, lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, is_causal: bool, scale: float, dropout_p: float, dropout_rng: Optional[Tensor],
               backend: str, window_left: int = -1, window_right: int = -1, bottom_right: bool = False,
               softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
               diagonal_shift: int = 0, block_tiles: Optional[Tensor] = None,
               block_bits: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Packed gradients of query, key and value."""
    return registry.get(backend).backward_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, out, lse,
        grad_out, grad_lse, _dropout(dropout_p, dropout_rng),
        from_op_args(window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                     block_bits))


@varlen_bwd.register_fake
def _varlen_bwd_fake(grad_out, grad_lse, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, is_causal, scale, dropout_p, dropout_rng, backend, window_left=-1, window_right=-1, bottom_right=False,
                     softcap=0.0, alibi_slopes=None, diagonal_shift=0, block_tiles=None, block_bits=None):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    (query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p,
     dropout_rng, backend, window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift,
     block_tiles, block_bits, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_rng, alibi_slopes,
                          block_tiles, block_bits, sinks)
    ctx.max_seqlens = max_seqlen_q, max_seqlen_k
    ctx.is_causal, ctx.scale, ctx.dropout_p, ctx.backend = is_causal, scale, dropout_p, backend
    ctx.variant_args = (window_left, window_right, bottom_right, softcap)
    ctx.diagonal_shift = diagonal_shift
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    (query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_rng, alibi_slopes, block_tiles, block_bits,
     sinks) = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = varlen_bwd(grad_out, grad_lse, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
                       ctx.is_causal, ctx.scale, ctx.dropout_p, dropout_rng, ctx.backend, *ctx.variant_args, alibi_slopes,
                       ctx.diagonal_shift, block_tiles, block_bits)
    grad_sinks = None
    if sinks is not None and ctx.needs_input_grad[20]:  # rows of (H_q, total_q), as the log-sum-exp
        grad_sinks = sink_gradient(sinks, lse, out.transpose(0, 1), grad_out.transpose(0, 1), grad_lse, heads_dim=0)
    return (*grads, *([None] * 17), grad_sinks)


varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     dropout_p=0.0, is_causal=False, scale=None, *, return_lse=False, backend=None, generator=None,
                     causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, sinks=None,
                     attn_mask=None):
    """Attention over a packed batch of sequences of different lengths (no padding), with autograd.

    Args:
        query: (total_q, H_q, D_qk), the queries of every sequence one after another; any strides.
        key: (total_k, H_kv, D_qk); value: (total_k, H_kv, D_v). H_q a multiple of H_kv (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) (B + 1,): sequence b is tokens
            cu_seqlens[b] .. cu_seqlens[b + 1]; 0 first and the total last. Empty sequences are
            allowed (a sequence without keys gives 0, lse -inf, or the sink with `sinks`). Their
            values are checked on the device (on a GPU, asynchronously: a device-side assertion
            ahead of the kernels).
        max_seqlen_q, max_seqlen_k: the longest sequence, or None. Given, they are checked on the
            device (asynchronously on a GPU), and the triton and cuda kernels' grid is made for them;
            omitted, those backends read them from the lengths (a host synchronisation on a GPU).
        dropout_p, is_causal, scale, causal_alignment, window_size, softcap, generator: as in
            `fused_attn.attention`, positions counted within each sequence ("bottom_right" aligns
            each sequence's last query with its last key; an integer alignment is not taken).
        alibi_slopes: float32 (H_q,) or (B, H_q), a row per sequence.
        sinks: (H_q,), as in `fused_attn.attention`: the same sink logits for every sequence.
        attn_mask: None, or a mask program (`fused_attn.masks.mask_program`, or a FlexAttention BlockMask) whose
            batch row b (or only row) is sequence b's mask, at the sequence's own positions: built for lengths
            that cover the longest sequences (a bottom-right alignment in it is resolved against those).
        return_lse: also return the log-sum-exp, (H_q, total_q) (as flash-attn), float32 (float64
            for float64 inputs).
        backend: a name from `available_backends()`; default automatic.

    Returns:
        (total_q, H_q, D_v), or (output, lse) when `return_lse`.
    """
    _check_packed(query, key, value)
    _check_options(dropout_p, scale, is_causal)
    _check_generator(generator, query)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, query.device)
    # The kernels read the bounds with a unit stride.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    max_q, max_k = _check_max_seqlen("max_seqlen_q", max_seqlen_q), _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected None or a backend name, got {type(backend).__name__}")
    batch, heads_q, heads_kv = cu_seqlens_q.shape[0] - 1, query.shape[1], key.shape[1]
    # The variant's keywords are checked against a (B, H_q) batch of sequences.
    variant = variant_of(query.new_empty((batch, heads_q, 0, 0)), causal_alignment, window_size, softcap,
                         alibi_slopes, sinks)
    if variant.diagonal_shift:
        raise ValueError(f"causal_alignment: expected 'top_left' or 'bottom_right' for a packed batch (each "
                         f"sequence has its own diagonal), got the offset {causal_alignment!r}")
    variant = masks.with_sequences_program(attn_mask, variant, is_causal, query, cu_seqlens_q, cu_seqlens_k)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    # The registry decides on the largest problem the call could be (lengths are not read here).
    problem = Problem(query.device, query.dtype, batch, heads_q, heads_kv, max_q if max_q >= 0 else query.shape[0],
                      max_k if max_k >= 0 else key.shape[0], query.shape[2], value.shape[2], is_causal,
                      float(dropout_p), None, False, False, variant.features(is_causal), varlen=True)
    chosen = registry.choose(problem, backend)
    dropout_rng = next_rng(query.device, generator) if dropout_p > 0.0 else None
    _refuse_forward_mode_ad(query=query, key=key, value=value)
    args = (query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, is_causal, scale, float(dropout_p),
            dropout_rng, chosen.name, *variant.op_args())
    fused = (varlen_fwd if needs_op(query, key, value, variant.alibi_slopes, variant.sinks, variant.block_tiles)
             else _varlen_forward)
    out, lse = fused(*args)
    return (out, lse) if return_lse else out



def _packed_of(name: str, tensor) -> Tensor:
    """A jagged nested (B, H, j, D) tensor's values, (total, H, D), a view."""
    if not (isinstance(tensor, Tensor) and tensor.is_nested and tensor.layout == torch.jagged
            and tensor.dim() == 4 and getattr(tensor, "_ragged_idx", None) == 2):
        raise ValueError(f"{name}: expected a jagged nested tensor (B, H, j, D), ragged along the sequence "
                         f"(as scaled_dot_product_attention takes them), like query")
    return tensor.transpose(1, 2).values()


def nested_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                     *, key_padding_mask=None, return_lse=False, backend=None, generator=None,
                     causal_alignment="top_left", window_size=None, softcap=None, alibi_slopes=None, sinks=None):
    """`fused_attn.attention` on jagged nested tensors: `attention_varlen` on their packed values."""
    packed = [_packed_of(name, t) for name, t in (("query", query), ("key", key), ("value", value))]
    for name, given in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if given is not None:
            raise ValueError(f"{name}: not taken with nested tensors (their sequences are already exact)")
    if packed[1].shape[1] != packed[0].shape[1] and not enable_gqa:
        raise ValueError(f"key: expected {packed[0].shape[1]} heads (as query), got {packed[1].shape[1]}; "
                         "pass enable_gqa=True for grouped-query attention")
    out, lse = attention_varlen(*packed, query.offsets(), key.offsets(), None, None, dropout_p, is_causal, scale,
                                return_lse=True, backend=backend, generator=generator,
                                causal_alignment=causal_alignment, window_size=window_size, softcap=softcap,
                                alibi_slopes=alibi_slopes, sinks=sinks)
    # The query's own offsets: the output has its ragged size (adds to the query's residual stream).
    nested = torch.nested.nested_tensor_from_jagged(out, query.offsets()).transpose(1, 2)
    return (nested, lse) if return_lse else nested
