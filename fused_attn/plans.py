"""Plans of plain calls to `fused_attn.attention`: what the argument checks and the backend choice
concluded for one call signature, kept so that the next call with that signature goes straight to the
kernel. On a small call (B=1, H=4, L=64, D=32 on a CPU) the full path's Python costs a third as much as
the kernel (bench/NOTES.md, sections 24 and 25); a planned call pays for its key, one dictionary lookup,
the output and the backend's own call.

A plain call has no attn_mask, key_padding_mask, dropout, ALiBi slopes or generator, plain tensors
(`torch.Tensor` itself, not nested) and no autograd, tracing or transform to record it (`ops.needs_op`;
those go through the op, where these microseconds do not count). Its key holds everything the checks
and the choice read: shapes, dtypes and devices of query, key and value, is_causal, enable_gqa,
causal_alignment, window_size, softcap and the request in force (argument, `use_backend` block,
environment). A plan is made only after the full path accepted a call, so a hit needs a key equal to
that of an accepted call. Python's equality mixes types (True == 1 == 1.0, with equal hashes; 0.0 ==
-0.0), and the checks refuse some of what compares equal (is_causal=1, dropout_p=False): so a key is
made only of values of exact types for which equal means the same call, and anything else takes the
full path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _extension
from .backends import registry
from .backends.base import Backend
from .backends.extension import ExtensionBackend
from .problem import output_like
from .scores import ScoreVariant


class Plan(NamedTuple):
    backend: Backend
    variant: ScoreVariant
    default_scale: float  # 1 / sqrt(D_qk), for scale=None
    # The output as `output_like` lays it out (query's dtype and device, both in the key).
    out_size: torch.Size
    out_stride: tuple[int, ...]
    # The variant's arguments of `fused_attn._C.plain_forward` (csrc/plain_call.cpp), for backends that
    # call the extension's forward as it is; None for the others.
    direct_args: tuple | None


_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 1024
# The registry's backends, in order, when the plans were made: registering one may change any choice.
_registered: tuple[Backend, ...] = ()


def _is_plain_window(window_size) -> bool:
    """None, or a tuple of two ints or Nones: the windows whose equality means the same window (a bool
    bound equals 0 or 1 but is refused; a list is unhashable)."""
    if window_size is None:
        return True
    if type(window_size) is not tuple or len(window_size) != 2:
        return False
    left, right = window_size
    return (left is None or type(left) is int) and (right is None or type(right) is int)


def key_of(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, backend,
           generator, causal_alignment, window_size, softcap, alibi_slopes) -> tuple | None:
    """The plan key of a plain call, or None when the call is not one (it then takes the full path).

    For tensors that are not nested (`attention` sends nested ones elsewhere first)."""
    # One expression of exact type tests, cheapest first: this runs on every plain call.
    if (attn_mask is not None or key_padding_mask is not None or generator is not None
            or alibi_slopes is not None
            or type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor
            or type(dropout_p) is not float or dropout_p != 0.0
            or type(is_causal) is not bool or type(enable_gqa) is not bool
            or type(causal_alignment) is not str
            or (scale is not None and type(scale) is not float)
            or (backend is not None and type(backend) is not str)
            # 0.0 and -0.0 (no cap) compare equal but are different values: they take the full path.
            or (softcap is not None and (type(softcap) is not float or not softcap > 0.0))
            or not _is_plain_window(window_size)):
        return None
    # The scale is not in the key: any float is accepted and passed on as it is, and it plays no part in
    # the choice (None takes the plan's default, which depends on D_qk, in the key).
    return (query.shape, key.shape, value.shape, query.dtype, key.dtype, value.dtype, query.device, key.device,
            value.device, is_causal, enable_gqa, causal_alignment, window_size, softcap,
            registry.requested_backend(backend))


def find(call_key: tuple) -> Plan | None:
    """The plan made for `call_key`, if any and if the registry has not changed since."""
    global _registered
    backends = tuple(registry._BACKENDS.values())
    if backends != _registered:
        _plans.clear()
        _registered = backends
        return None
    return _plans.get(call_key)


def remember(call_key: tuple, backend: Backend, variant: ScoreVariant, default_scale: float, query: Tensor,
             value: Tensor) -> None:
    """Keeps what the full path concluded for an accepted plain call that ran `backend`'s kernel."""
    # A backend's answer is fixed for the devices it is chosen for automatically (Backend.refusals);
    # elsewhere it may depend on the environment (the triton backend on CPU tensors reads
    # TRITON_INTERPRET at each call), so such explicit requests keep their full path.
    if query.device.type not in backend.devices:
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    layout = output_like(query, value.shape[-1], seq_first=False)
    _plans[call_key] = Plan(backend, variant, default_scale, layout.shape, layout.stride(), _direct_args(backend, variant))


def _direct_args(backend: Backend, variant: ScoreVariant) -> tuple | None:
    """(window_left, window_right, bottom_right, softcap, diagonal_shift) when the backend's forward is the
    extension's own (the plain call then goes to `_C.plain_forward`, which allocates the output itself)."""
    if _extension._C is None or type(backend).forward is not ExtensionBackend.forward:
        return None
    window_left, window_right, bottom_right, softcap, _, diagonal_shift, _, _ = variant.score_args()  # no ALiBi here
    return window_left, window_right, bottom_right, softcap, diagonal_shift


def run(plan: Plan, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None):
    """The no-op path of `ops.attention` with the plan's answers: (out, lse)."""
    scale = plan.default_scale if scale is None else scale
    # Direct unless the backend's forward has been replaced on the instance since (a wrapper, a spy).
    if plan.direct_args is not None and "forward" not in plan.backend.__dict__:
        return _extension._C.plain_forward(query, key, value, is_causal, scale, *plan.direct_args)
    out = query.new_empty_strided(plan.out_size, plan.out_stride)  # without dtype and device to parse: faster
    lse = plan.backend.forward(query, key, value, None, None, is_causal, scale, out, None, plan.variant)
    return out, lse


def clear() -> None:
    _plans.clear()
