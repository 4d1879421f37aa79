"""`redirect_sdpa()`: runs code written against `torch.nn.functional.scaled_dot_product_attention`
(timm, diffusers, open_clip, hand-written GPTs) on fused_attn, without editing it.

It is a `torch.overrides.TorchFunctionMode`, so it sees the calls of SDPA made in its block, also
through a name bound before the block was entered (`from torch.nn.functional import
scaled_dot_product_attention`). A call fused_attn can serve runs as `fused_attn.attention`; any other
call, and every other torch function, runs as PyTorch would run it.

Under torch.compile (verified with torch 2.13, `fullgraph=True`, the eager backend and inductor),
Dynamo traces the mode: a function compiled outside the block and called inside it, and a block
entered (or a decorated function called) inside the compiled function, both without a graph break;
the redirected call becomes fused_attn's op in the graph, a pass-through stays PyTorch's SDPA. The
graph is guarded on the active modes and their `backend`, so calling a compiled function inside and
outside the block compiles it once for each; a graph break inside the block resumes with the mode
active. Dynamo gained this tracing of modes in late 2024 (pytorch/pytorch#133137, #137121); older
torch releases are untested here.

Like torch's own modes, the block holds for the thread that entered it.

FlexAttention's `torch.nn.attention.flex_attention.flex_attention` is a plain Python function, which no
mode sees: the first redirect made replaces that module attribute by a function that, inside a block,
runs the calls fused_attn can serve as `fused_attn.flex_attention` and passes every other call (and
every call outside a block, or traced by torch.compile) on to torch's own. Calls through the module
attribute are seen (`flex_attention.flex_attention(...)` after `from torch.nn.attention import
flex_attention`), and so are names imported from it after that first redirect; a name imported before
it (`from torch.nn.attention.flex_attention import flex_attention` at the top of a module imported
earlier) is torch's function itself, and its calls are not seen.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex_module
from torch.overrides import TorchFunctionMode

from .. import flex, masks
from ..backends import registry
from ..backends.reference import ReferenceBackend
from ..checks import _check_inputs, _check_options, _mask_view
from ..functional import attention
from ..problem import Problem
from ..scores import PLAIN, causal_bias_variant, is_causal_bias, variant_of
from ..varlen import _check_packed, _packed_of

_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_NAMES = frozenset(_POSITIONAL) | frozenset(_DEFAULTS)


class SDPARedirect(TorchFunctionMode, contextlib.ContextDecorator):
    """The mode `redirect_sdpa` returns. Dynamo traces entering it only while `__enter__`/`__exit__`
    are TorchFunctionMode's own, so it defines neither."""

    def __init__(self, backend: str | None = None):
        super().__init__()
        if backend is not None:
            if not isinstance(backend, str):
                raise TypeError(f"backend: expected None or a backend name, got {type(backend).__name__}")
            registry.get(backend)  # a ValueError naming `backend` and the known names
        self.backend = backend
        _route_flex_attention()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # This runs with the mode taken off the stack, so the torch calls of fused_attn below are
        # not intercepted again.
        if func is F.scaled_dot_product_attention:
            call = _arguments(args, kwargs)
            if call is not None:
                served = self._serve(**call)
                if served is not None:
                    return served
        return func(*args, **kwargs)

    def _serve(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        """The output of fused_attn for this call, or None where PyTorch has to run it."""
        if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
            return None
        if any(t.is_nested for t in (query, key, value)):
            return self._serve_nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if not query.dim() == key.dim() == value.dim() >= 2:
            return None
        if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:  # SDPA broadcasts them, fused_attn not
            return None
        # SDPA takes (..., L, D): the dims before the last three are the batch, the third from last
        # the heads (enable_gqa groups along it), as fused_attn's (B, H, L, D) needs them.
        q, k, v = (_as_4d(t) for t in (query, key, value))
        if q is None or k is None or v is None:
            return None
        mask = attn_mask
        if isinstance(attn_mask, torch.Tensor) and not is_causal_bias(attn_mask):
            mask = _mask_as_4d(attn_mask, (*query.shape[:-1], key.shape[-2]))
            if mask is None:
                return None
        problem = _problem(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
        backend = None if problem is None else self._backend_for(problem)
        if backend is None:
            return None
        out = attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, backend=backend)
        return out.view(*query.shape[:-1], value.shape[-1])

    def _serve_nested(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        """Jagged (B, H, j, D) tensors without a mask run as fused_attn's packed batches; other nested
        tensors (strided layout, a mask) are left to PyTorch."""
        if attn_mask is not None:
            return None
        try:
            packed = [_packed_of(name, t) for name, t in (("query", query), ("key", key), ("value", value))]
            _check_packed(*packed)
            _check_options(dropout_p, scale, is_causal)
        except (TypeError, ValueError):
            return None
        heads_q, heads_kv = packed[0].shape[1], packed[1].shape[1]
        # Key and value must share their sequences (one nested size), and query their batch.
        batch = query.shape[0]
        if (heads_q != heads_kv and not enable_gqa) or key.shape[2] != value.shape[2] \
                or key.shape[0] != batch or value.shape[0] != batch:
            return None
        # As attention_varlen describes a packed batch: its lengths are the largest possible.
        problem = Problem(device=query.device, dtype=query.dtype, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                          len_q=packed[0].shape[0], len_k=packed[1].shape[0], head_dim_qk=packed[0].shape[2],
                          head_dim_v=packed[2].shape[2], is_causal=is_causal, dropout_p=float(dropout_p),
                          mask_dtype=None, mask_requires_grad=False, has_key_padding_mask=False, varlen=True)
        backend = self._backend_for(problem)
        if backend is None:
            return None
        return attention(query, key, value, None, dropout_p, is_causal, scale, enable_gqa, backend=backend)

    def serve_flex(self, args, kwargs):
        """fused_attn.flex_attention's result for a call of FlexAttention's flex_attention, or None where
        torch's has to run it: a score_mod, max_scores asked for, arguments this version does not know or
        that torch refuses, a call no fused backend takes."""
        try:
            call = _torch_flex_signature.bind(*args, **kwargs).arguments
        except TypeError:
            return None
        aux = call.get("return_aux")
        if not call.keys() <= _FLEX_SERVED or call.get("score_mod") is not None \
                or (aux is not None and (call.get("return_lse") or getattr(aux, "max_scores", True))):
            return None
        query, key, value = call["query"], call["key"], call["value"]
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested for t in (query, key, value)):
            return None
        key, value = flex.broadcast_batch(query, key, value)
        problem = _flex_problem(query, key, value, call.get("block_mask"), call.get("scale"),
                                call.get("enable_gqa", False))
        backend = None if problem is None else self._backend_for(problem)
        if backend is None:
            return None
        return flex.flex_attention(**call, backend=backend)

    def _backend_for(self, problem: Problem) -> str | None:
        return fused_backend_for(problem, self.backend)


def fused_backend_for(problem: Problem, backend: str | None = None) -> str | None:
    """The backend to run `problem` on: `backend`, else the one requested (by `use_backend` or by the
    environment), whose refusal fused_attn raises; else the first fused backend that takes it.
    The reference is never chosen unasked: it materialises the scores, which PyTorch's own kernels
    do not, so PyTorch serves what no fused backend can. (Shared with `sdpa_plugin`.)"""
    requested = registry.requested_backend(backend)
    if requested is not None:
        return requested
    for name in registry.names():
        candidate = registry.get(name)
        if name != ReferenceBackend.name and problem.device.type in candidate.devices \
                and not registry.reasons(candidate, problem):
            return name
    return None


def redirect_sdpa(backend: str | None = None) -> SDPARedirect:
    """Within the block (or the decorated function), `F.scaled_dot_product_attention` runs as
    `fused_attn.attention` wherever fused_attn can serve the call.

        with fused_attn.redirect_sdpa():
            y = model(x)            # its SDPA calls run on fused_attn

        @fused_attn.redirect_sdpa(backend="cpu")
        def step(x): ...

    Served: query, key and value of 2 or more dims, (..., L, D), with the same leading dims, of a
    dtype and device a fused backend takes, whose leading dims merge into (B, H) as a view; masks
    of fused_attn's dtypes (bool or query's) broadcastable to (..., L_q, L_k); PyTorch's CausalBias;
    jagged nested tensors without a mask. Served calls follow fused_attn's contract where it differs
    from PyTorch's: `dropout_p > 0` drops with fused_attn's generator (fused_attn.dropout), the same
    distribution, other elements; a query that sees no key gives 0 (PyTorch: NaN).
    Left to PyTorch, unchanged: everything else (broadcast batch dims, a float mask of another dtype,
    strided nested tensors, unknown arguments...), and everything else torch does in the block.
    Not seen: SDPA called from inside another overridable torch function, such as
    `F.multi_head_attention_forward` of `nn.MultiheadAttention`, since a mode is off while it
    handles a call (`fused_attn.replace_attention` swaps those modules instead).

    FlexAttention's `flex_attention` (called through its module, or by a name imported after the first
    redirect was made: the module docstring says why) runs as `fused_attn.flex_attention` where it can:
    no score_mod, a BlockMask or none, the lse or no auxiliary output, 4-D tensors a fused backend takes.
    Any other call (a score_mod, max_scores asked for, arguments torch refuses) and every call traced by
    torch.compile run as torch's own.

    Args:
        backend: a name from `fused_attn.available_backends()`; every served call then runs on it,
            and one it cannot run raises `fused_attn.BackendError`. By default the first fused backend
            that takes the call (as `use_backend` and FUSED_ATTN_BACKEND request otherwise); never
            the reference unasked.
    """
    return SDPARedirect(backend)


def _arguments(args, kwargs) -> dict | None:
    """SDPA's arguments by name; None for a call SDPA's signature refuses (PyTorch then says why) or
    with arguments this version of fused_attn does not know."""
    if len(args) > len(_POSITIONAL) or any(name not in _NAMES or name in _POSITIONAL[:len(args)] for name in kwargs):
        return None
    call = {**_DEFAULTS, **dict(zip(_POSITIONAL, args)), **kwargs}
    return call if len(call) == len(_NAMES) else None


def _as_4d(tensor: torch.Tensor) -> torch.Tensor | None:
    """(..., H, L, D) as a (B, H, L, D) view, the batch dims merged; None where that needs a copy."""
    if tensor.dim() <= 4:
        return tensor[(None,) * (4 - tensor.dim())]
    batch = tensor.dim() - 3
    if not _mergeable(tensor.shape[:batch], tensor.stride()[:batch]):
        return None
    return tensor.view(math.prod(tensor.shape[:batch]), *tensor.shape[batch:])


def _mergeable(sizes, strides) -> bool:
    """Whether dims of these sizes and strides merge into one without a copy."""
    if 0 in sizes:
        return True
    dims = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    return all(outer == size * stride for (_, outer), (size, stride) in zip(dims, dims[1:]))


def _mask_as_4d(mask: torch.Tensor, full: tuple[int, ...]) -> torch.Tensor | None:
    """A mask broadcastable to `full` (..., L_q, L_k), as a view broadcastable to the (B, H, L_q, L_k)
    of `_as_4d`; None where it does not broadcast (a mask of more dims than the query too: PyTorch
    refuses it) or the view needs a copy."""
    if mask.dim() > len(full) or any(m not in (1, f) for m, f in zip(reversed(mask.shape), reversed(full))):
        return None
    if len(full) <= 4:
        return mask
    batch = len(full) - 3
    expanded = mask.expand(full)  # stride 0 where it broadcasts: merging those dims stays a view
    if not _mergeable(expanded.shape[:batch], expanded.stride()[:batch]):
        return None
    return expanded.view(math.prod(full[:batch]), *full[batch:])


def _problem(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> Problem | None:
    """The call as the registry sees it, after fused_attn's own argument checks; None where they
    refuse it (PyTorch then runs it, and raises its own error for what it refuses too)."""
    try:
        _check_inputs(q, k, v, enable_gqa)
        _check_options(dropout_p, scale, is_causal)
        alignment = causal_bias_variant(mask, q, k)
        if alignment is not None:
            if is_causal:
                return None
            return Problem.of(q, k, v, None, None, True, float(dropout_p),
                              variant_of(q, alignment, None, None, None))
        mask = _mask_view(mask, q, k)
    except (TypeError, ValueError):
        return None
    return Problem.of(q, k, v, mask, None, is_causal, float(dropout_p))


def _flex_problem(q, k, v, block_mask, scale, enable_gqa) -> Problem | None:
    """A FlexAttention call as the registry sees it (its BlockMask as its mask program); None where
    fused_attn's checks refuse it (torch's flex_attention then runs it, or raises its own error)."""
    if block_mask is not None and not isinstance(block_mask, flex_module.BlockMask):
        return None
    try:
        _check_inputs(q, k, v, enable_gqa)
        _check_options(0.0, scale, False)
        _, variant = masks.with_program(block_mask, PLAIN, False, q, k)
    except (TypeError, ValueError):
        return None
    return Problem.of(q, k, v, None, None, False, 0.0, variant)


# --- FlexAttention -------------------------------------------------------------------------------
# flex_attention is a plain Python function, which no TorchFunctionMode sees. So the first redirect made
# puts `_flex_attention_redirected` in its place, as the attribute of torch.nn.attention.flex_attention
# (a mode cannot swap it on entry and back on exit: Dynamo traces entering only TorchFunctionMode's own
# __enter__). Outside every block it passes each call on to torch's function unchanged.

_FLEX_SERVED = frozenset(("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "return_lse",
                          "kernel_options", "return_aux"))
_torch_flex = flex_module.flex_attention
_torch_flex_signature = inspect.signature(_torch_flex)


def _innermost_redirect() -> SDPARedirect | None:
    """The innermost redirect_sdpa block entered on this thread and still open, if any."""
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, SDPARedirect):
            return mode
    return None


def _flex_attention_redirected(*args, **kwargs):
    # Traced by torch.compile, the call stays torch's, whose compiled kernels are what compiling it is for.
    if not torch.compiler.is_compiling():
        mode = _innermost_redirect()
        served = None if mode is None else mode.serve_flex(args, kwargs)
        if served is not None:
            return served
    return _torch_flex(*args, **kwargs)


def _route_flex_attention() -> None:
    """Puts `_flex_attention_redirected` in place of torch.nn.attention.flex_attention.flex_attention, once
    (with torch's name, signature and docstring)."""
    global _torch_flex, _torch_flex_signature
    if flex_module.flex_attention is _flex_attention_redirected:
        return
    _torch_flex = flex_module.flex_attention
    _torch_flex_signature = inspect.signature(_torch_flex)
    functools.update_wrapper(_flex_attention_redirected, _torch_flex)
    flex_module.flex_attention = _flex_attention_redirected
