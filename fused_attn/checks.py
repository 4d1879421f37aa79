"""Argument checks shared by the public entry points (fused_attn.functional, .varlen, .kvcache,
.distributed, .integrations): one home below all of them, so that none imports another for its checks.
This module imports nothing of fused_attn."""

from __future__ import annotations

import numbers

import torch
from torch.autograd import forward_ad

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, tensor, rank: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {tuple(tensor.shape)}")


def _check_same(name: str, what: str, expected, got) -> None:
    if expected != got:
        raise ValueError(f"{name}: expected {what} {expected} (as query), got {got}")


def check_dtypes_and_devices(query, key, value) -> None:
    """A supported dtype for query, and query's dtype and device for key and value."""
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query: expected a dtype in {SUPPORTED_DTYPES}, got {query.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} (as query), got {tensor.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name}: expected device {query.device} (as query), got {tensor.device}")


def _check_inputs(query, key, value, enable_gqa: bool) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, tensor, 4, "(B, H, L, D)")
    check_dtypes_and_devices(query, key, value)
    # Each shape read once: a torch.Size is built at every `.shape`, and this runs on every call.
    q_shape, k_shape, v_shape = query.shape, key.shape, value.shape
    _check_same("key", "batch size", q_shape[0], k_shape[0])
    _check_same("value", "batch size", q_shape[0], v_shape[0])
    if v_shape[1] != k_shape[1]:
        raise ValueError(f"value: expected {k_shape[1]} heads (as key), got {v_shape[1]}")
    if v_shape[2] != k_shape[2]:
        raise ValueError(f"value: expected length {k_shape[2]} (as key), got {v_shape[2]}")
    _check_same("key", "head dim", q_shape[3], k_shape[3])
    for name, shape in (("query", q_shape), ("value", v_shape)):
        if shape[3] < 1:
            raise ValueError(f"{name}: expected a head dim of at least 1, got shape {tuple(shape)}")
    heads_q, heads_kv = q_shape[1], k_shape[1]
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(f"key: expected {heads_q} heads (as query), got {heads_kv}; "
                         "pass enable_gqa=True for grouped-query attention")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"key: expected a number of heads dividing the query's {heads_q}, got {heads_kv}")


def _check_options(dropout_p, scale, is_causal) -> None:
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)):
        raise TypeError(f"scale: expected None or a number, got {type(scale).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")


def _mask_view(attn_mask, query, key):
    """The mask viewed as (B, H_q, L_q, L_k) with stride 0 where it broadcasts; never copied."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected None or a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, query.dtype):
        raise TypeError(f"attn_mask: expected dtype torch.bool or {query.dtype} (as query), "
                        f"got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask: expected device {query.device} (as query), got {attn_mask.device}")
    full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, full) != full:
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask: expected a shape broadcastable to (B, H_q, L_q, L_k) = {full}, "
                         f"got {tuple(attn_mask.shape)}") from None
    return attn_mask.expand(full)


def _check_key_padding_mask(key_padding_mask, query, key) -> None:
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, torch.Tensor):
        raise TypeError(f"key_padding_mask: expected None or a torch.Tensor, "
                        f"got {type(key_padding_mask).__name__}")
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask: expected dtype torch.bool (True = ignore the key), "
                        f"got {key_padding_mask.dtype}")
    expected = (query.shape[0], key.shape[2])
    if tuple(key_padding_mask.shape) != expected:
        raise ValueError(f"key_padding_mask: expected shape (B, L_k) = {expected}, "
                         f"got {tuple(key_padding_mask.shape)}")
    if key_padding_mask.device != query.device:
        raise ValueError(f"key_padding_mask: expected device {query.device} (as query), "
                         f"got {key_padding_mask.device}")


def _padding_of(mask, key_padding_mask):
    """A bool mask that varies only with the batch and the key, (B, 1, 1, L_k) as most libraries pass
    padding, becomes key padding: (B, L_k), True = ignore, merged with `key_padding_mask`. The kernels
    read key padding once per key block instead of once per score. Returns (mask, key_padding_mask)."""
    if mask is None or mask.dtype != torch.bool:
        return mask, key_padding_mask
    if any(mask.shape[dim] != 1 and mask.stride(dim) != 0 for dim in (1, 2)):
        return mask, key_padding_mask
    hidden = ~mask[:, 0, 0, :]
    return None, hidden if key_padding_mask is None else hidden | key_padding_mask


def _check_generator(generator, query) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected None or a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != query.device.type:
        raise ValueError(f"generator: expected a generator of device type {query.device.type} (as query), "
                         f"got one of {generator.device}")


def _refuse_forward_mode_ad(**tensors) -> None:
    """The ops have a backward but no forward-mode derivative; without this check a tangent would be
    dropped silently (a zero jvp)."""
    if forward_ad._current_level >= 0:
        for name, tensor in tensors.items():
            if tensor is not None and forward_ad.unpack_dual(tensor).tangent is not None:
                raise NotImplementedError(f"{name}: forward-mode AD (a dual tensor, as in torch.func.jvp) "
                                          "is not supported; use reverse mode (backward, vjp) instead")


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Raises `message` when `condition` (a bool tensor) is false: at once on the CPU, asynchronously
    (at the next synchronisation) on a GPU, which keeps the call free of host synchronisation."""
    if condition.device.type == "cpu":
        if not bool(condition):
            raise ValueError(message)
    else:
        torch._assert_async(condition, message)
