"""fused_attn as a flash-attention implementation of PyTorch's SDPA plug-in point (torch >= 2.13).

    import fused_attn                                      # registers the name "fused_attn"
    torch.nn.attention.activate_flash_attention_impl("fused_attn")
    y = model(x)                                           # SDPA's flash kernels now run on fused_attn
    torch.nn.attention.restore_flash_attention_impl()      # PyTorch's own kernels again

`torch.nn.attention.register_flash_attention_impl(name, register_fn=...)` stores a function that
`activate_flash_attention_impl(name)` calls; it registers kernels with the dispatcher and returns a
handle whose `remove()` `restore_flash_attention_impl()` calls (FA3 and FA4 come in the same way).
Ours registers, in one `torch.library.Library`, a kernel of its own at the dispatch key of each
flash operator that SDPA and `torch.nn.attention.varlen` call:

    CPU   aten::_scaled_dot_product_flash_attention_for_cpu (+ _backward)      (B, H, L, D), top-left causal
    CUDA  aten::_scaled_dot_product_flash_attention (+ _backward)              (B, H, L, D)
          aten::_flash_attention_forward, _flash_attention_backward,          (B, L, H, D) or packed
          _flash_attention_forward_no_dropout_inplace                          (total, H, D); bottom-right
                                                                               causal, windows

Being an operator's own kernel, below autograd, it is what eager code, `torch.compile` graphs
(which keep these operators as they are; their meta kernels give the shapes) and the ATen autograd
formulas call; the backward operator receives the output and log-sum-exp our forward returned.
Each kernel runs a call on the backend `redirect_sdpa` would choose (fused_attn.integrations.sdpa:
`use_backend` and FUSED_ATTN_BACKEND are followed; the reference never unasked), and hands every call
no fused backend serves to PyTorch's own kernel, saved at activation (`torch.library.get_kernel`).
Outputs are laid out as the operators' meta kernels promise torch.compile.

Verified on the CPU (tests/test_sdpa_plugin.py). The CUDA kernels are registered, their signatures
checked against this torch's schemas at activation, and their argument mapping runs in the tests on
CPU tensors; they have not run on a GPU.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch

from ..backends import registry
from ..problem import Problem
from ..scores import PLAIN, UNBOUNDED, ScoreVariant
from ..varlen import _check_packed
from .sdpa import _check_inputs, _mask_view, _problem, fused_backend_for

NAME = "fused_attn"


def register() -> bool:
    """Makes "fused_attn" known to `torch.nn.attention.activate_flash_attention_impl`; False on a
    torch without the plug-in point. Only stores a function: nothing is registered with the
    dispatcher until activation (PyTorch asks providers not to activate themselves on import)."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(NAME, register_fn=activate)
    return True


class Activation:
    """The handle `activate_flash_attention_impl` keeps; `restore_flash_attention_impl` (or activating
    another implementation) calls `remove`."""

    def __init__(self, library: torch.library.Library):
        self._library = library

    def remove(self) -> None:
        if self._library is not None:
            # Explicitly, not by dropping the last reference: a reference held elsewhere (a traceback)
            # would otherwise keep our kernels in the dispatcher.
            self._library._destroy()
            self._library = None


# --- CPU: SDPA's flash operator ---------------------------------------------------------------------


def _cpu_call(query, key, value, attn_mask, dropout_p, is_causal):
    """The backend to serve a call of the CPU flash operator, or None to leave it to PyTorch."""
    # PyTorch's CPU flash kernel refuses dropout (SDPA runs such calls on its math backend), so a call
    # with dropout comes only from code calling the operator itself; PyTorch's kernel gives it
    # PyTorch's answer (its error).
    if dropout_p != 0.0:
        return None
    # The operator's contract, which its meta kernel states (the output is shaped as the query):
    # equal head dims. Masks: SDPA hands it additive masks (it converts bool ones); one of the query's
    # dtype is what the fused kernels take, a float32 mask on half inputs stays PyTorch's.
    if not query.dim() == key.dim() == value.dim() == 4 or value.shape[-1] != query.shape[-1]:
        return None
    if attn_mask is not None and attn_mask.dtype != query.dtype:
        return None
    # An empty problem is left to PyTorch, as SDPA leaves it to its math backend.
    if query.numel() == 0 or key.numel() == 0:
        return None
    # The operator takes H_q a multiple of H_kv (SDPA's enable_gqa arrives so).
    return _backend(_problem(query, key, value, attn_mask, dropout_p, is_causal, None, True))


def _cpu_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    backend = _cpu_call(query, key, value, attn_mask, dropout_p, is_causal)
    if backend is None:
        return None
    out = torch.empty_like(query)  # as the meta kernel: the query's layout
    lse = backend.forward(query, key, value, _mask_view(attn_mask, query, key), None, is_causal,
                          _scale(scale, query), out, None, PLAIN)
    return out, _laid_out(lse, (0, 2, 1))  # the meta's log-sum-exp: (B, L, H) in memory


def _cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                  scale=None):
    # The same decision as the forward's. Where the two could differ (a `use_backend` block around
    # the forward only), the log-sum-exp still fits: PyTorch's kernel and ours both return
    # log Σ exp(scale·q·k + mask) per row.
    backend = _cpu_call(query, key, value, attn_mask, dropout_p, is_causal)
    if backend is None:
        return None
    grads = backend.backward(query, key, value, _mask_view(attn_mask, query, key), None, is_causal,
                             _scale(scale, query), out, logsumexp, grad_out, None, None, None, PLAIN)
    # The meta kernel promises (B, L, H, D) in memory, as PyTorch's kernel writes them.
    return tuple(_laid_out(grad, (0, 2, 1, 3)) for grad in grads)


# --- CUDA: SDPA's flash operators and flash-attn's own, which varlen_attn calls ----------------------


def _flash_call(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, window_left,
                window_right, scale):
    """(backend, variant, scale) to serve a call of flash-attn's operators on (B, L, H, D) or packed
    (total, H, D) tensors, or None to leave it to PyTorch."""
    # Dropout: flash-attn's kernel drops the elements its Philox counters select for the rng state
    # it returns, and its backward regenerates them from that state; fused_attn's kernels select
    # other elements (fused_attn.dropout), so a served call could not reproduce what PyTorch drops
    # for the same generator state. Those calls stay PyTorch's.
    if dropout_p != 0.0 or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None  # float64: the meta kernel promises a float32 log-sum-exp; PyTorch refuses it anyway
    if value.shape[-1] != query.shape[-1] or (cum_seq_q is None) != (cum_seq_k is None):
        return None
    if query.numel() == 0 or key.numel() == 0:  # as SDPA, which never sends these to flash-attn
        return None
    # flash-attn's diagonal: the last query sits on the last key, per sequence; a bound < 0 is none.
    variant = ScoreVariant(bottom_right=True, window_left=_bound(window_left), window_right=_bound(window_right))
    try:
        if cum_seq_q is None:
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            _check_inputs(q, k, v, True)
            problem = Problem.of(q, k, v, None, None, is_causal, 0.0, variant)
        else:
            _check_packed(query, key, value)
            # As attention_varlen describes a packed batch: its lengths are the largest possible.
            problem = Problem(device=query.device, dtype=query.dtype, batch=cum_seq_q.shape[0] - 1,
                              heads_q=query.shape[1], heads_kv=key.shape[1], len_q=max_q, len_k=max_k,
                              head_dim_qk=query.shape[2], head_dim_v=value.shape[2], is_causal=is_causal,
                              dropout_p=0.0, mask_dtype=None, mask_requires_grad=False,
                              has_key_padding_mask=False, score_features=variant.features(is_causal), varlen=True)
    except (TypeError, ValueError):
        return None
    backend = _backend(problem)
    return None if backend is None else (backend, variant, _scale(scale, query))


def _flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
               scale, window_size_left, window_size_right, seqused_k, alibi_slopes, block_table, out=None):
    """(out, log-sum-exp) of a served flash forward, as its meta kernel lays them out; None otherwise."""
    # Not served: the debug mask (flash-attn's internal scores), key lengths and paged caches given as
    # seqused_k / block_table, and ALiBi, whose slopes the backward operator is not given.
    if return_debug_mask or seqused_k is not None or block_table is not None or alibi_slopes is not None:
        return None
    call = _flash_call(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       window_size_left, window_size_right, scale)
    if call is None:
        return None
    backend, variant, scale = call
    out = torch.empty_like(query) if out is None else out
    if cum_seq_q is None:
        q, k, v, o = (t.transpose(1, 2) for t in (query, key, value, out))  # fused_attn's (B, H, L, D) views
        lse = backend.forward(q, k, v, None, None, is_causal, scale, o, None, variant).contiguous()
    else:
        lse = query.new_empty((query.shape[1], query.shape[0]), dtype=torch.float32)
        backend.forward_varlen(query, key, value, cum_seq_q.contiguous(), cum_seq_k.contiguous(), max_q, max_k,
                               is_causal, scale, out, lse, None, variant)
    return out, lse


def _flash_grads(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, scale, window_size_left, window_size_right):
    """The gradients of a served flash backward, laid out as query, key and value; None otherwise."""
    call = _flash_call(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       window_size_left, window_size_right, scale)
    if call is None:
        return None
    backend, variant, scale = call
    if cum_seq_q is None:
        q, k, v, o, do = (t.transpose(1, 2) for t in (query, key, value, out, grad_out))
        grads = [g.transpose(1, 2) for g in backend.backward(q, k, v, None, None, is_causal, scale, o, logsumexp,
                                                              do, None, None, None, variant)]
    else:
        grads = backend.backward_varlen(query, key, value, cum_seq_q.contiguous(), cum_seq_k.contiguous(), max_q,
                                        max_k, is_causal, scale, out, logsumexp, grad_out, None, None, variant)
    return tuple(_laid_out_like(g, t) for g, t in zip(grads, (query, key, value)))


def _no_rng(query):
    """The rng state, offset and debug mask of a call without dropout, as the meta kernels shape them."""
    return (torch.zeros(2, dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                   block_table=None, num_splits=None):
    # num_splits only splits flash-attn's work over the keys; the result does not depend on it.
    served = _flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                        block_table)
    return None if served is None else (*served, *_no_rng(query))


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                           seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    served = _flash_run(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, scale, window_size_left, window_size_right, seqused_k, alibi_slopes,
                        block_table, out=out)
    return None if served is None else served[1]


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    return _flash_grads(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, scale, window_size_left, window_size_right)


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    len_q, len_k = query.shape[2], key.shape[2]
    # (B, H, L, D) as flash-attn's (B, L, H, D) views; the output, allocated like the transposed
    # query, comes back in the query's own layout, as the meta kernel says.
    served = _flash_run(*(t.transpose(1, 2) for t in (query, key, value)), None, None, len_q, len_k, dropout_p,
                        is_causal, return_debug_mask, scale, None, None, None, None, None)
    if served is None:
        return None
    out, lse = served
    return (out.transpose(1, 2), lse, None, None, len_q, len_k, *_no_rng(query))


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, philox_seed, philox_offset, *, scale=None):
    grads = _flash_grads(*(t.transpose(1, 2) for t in (grad_out, query, key, value, out)), logsumexp, None, None,
                         max_q, max_k, dropout_p, is_causal, scale, None, None)
    return None if grads is None else tuple(g.transpose(1, 2) for g in grads)


# --- shared ----------------------------------------------------------------------------------------


def _backend(problem: Problem | None):
    """The Backend to run `problem` on (redirect_sdpa's choice), or None for PyTorch."""
    name = None if problem is None else fused_backend_for(problem)
    if name is None:
        return None
    # An automatic choice takes the call; a requested backend is checked here, and one that cannot
    # run the call raises fused_attn's BackendError, as under redirect_sdpa.
    return registry.get(name) if registry.requested_backend(None) is None else registry.choose(problem, name)


def _scale(scale, query) -> float:
    return query.shape[-1] ** -0.5 if scale is None else float(scale)


def _bound(bound) -> int:
    return UNBOUNDED if bound is None or bound < 0 else int(bound)


def _laid_out(tensor, physical_layout):
    """`tensor` with the strides of `torch.empty_permuted(tensor.shape, physical_layout)`: compiled
    graphs read the operators' results with the strides their meta kernels promised (inductor
    asserts them)."""
    strides, step = [0] * tensor.dim(), 1
    for dim in reversed(physical_layout):
        strides[dim], step = step, step * tensor.shape[dim]
    strides = tuple(strides)
    if tensor.stride() == strides:
        return tensor
    if all(a == b or size == 1 for a, b, size in zip(tensor.stride(), strides, tensor.shape)):
        return tensor.as_strided(tensor.shape, strides)  # only size-1 dims differ (a decode step's L_q): a view
    return torch.empty_permuted(tensor.shape, physical_layout, dtype=tensor.dtype,
                                device=tensor.device).copy_(tensor)


def _laid_out_like(grad, tensor):
    """`grad`, or a copy of it, with the strides of `torch.empty_like(tensor)` (the meta kernels' promise)."""
    if grad.stride() == tensor.stride():
        return grad
    target = torch.empty_like(tensor)
    return grad if grad.stride() == target.stride() else target.copy_(grad)


# (operator, dispatch key, kernel). A kernel takes the operator's arguments as the dispatcher passes
# them and returns its results, or None for a call it leaves to PyTorch's own kernel.
KERNELS = (
    ("_scaled_dot_product_flash_attention_for_cpu", "CPU", _cpu_forward),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", "CPU", _cpu_backward),
    ("_scaled_dot_product_flash_attention", "CUDA", _sdpa_flash_forward),
    ("_scaled_dot_product_flash_attention_backward", "CUDA", _sdpa_flash_backward),
    ("_flash_attention_forward", "CUDA", _flash_forward),
    ("_flash_attention_forward_no_dropout_inplace", "CUDA", _flash_forward_inplace),
    ("_flash_attention_backward", "CUDA", _flash_backward),
)


@functools.cache  # schemas and kernels are fixed for the process; activation stays cheap
def check_signature(op: torch._ops.OpOverload, kernel) -> None:
    """Raises unless `kernel` takes `op`'s arguments as the dispatcher passes them to a Python kernel:
    the schema's names in its order, keyword-only where it says so, and its defaults (an argument
    equal to its default may be left out of the call)."""
    empty = inspect.Parameter.empty
    expected = [(a.name, a.kwarg_only, a.default_value if a.has_default_value() else empty)
                for a in op._schema.arguments]
    got = [(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default)
           for p in inspect.signature(kernel).parameters.values()]
    if got != expected:
        raise RuntimeError(f"fused_attn's kernel for {op._schema.name} does not match this torch's schema "
                           f"{op._schema}; fused_attn's SDPA plug-in supports torch 2.13")


def _pytorch_kernel(op: torch._ops.OpOverload, key: str):
    """PyTorch's own kernel of `op` at `key`, as the dispatcher has it now; None if this build has
    none (the CUDA operators of a CPU build)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op._schema.name, key):
        return None
    return torch.library.get_kernel(op, key)


def call_pytorch(name: str, key: str, original, keyset, args, kwargs):
    """Runs a call on PyTorch's own kernel (the only route to it while we are active; tests spy on it)."""
    if original is None:
        raise RuntimeError(f"aten::{name}: fused_attn leaves this call to PyTorch, whose build has no {key} "
                           "kernel for it")
    return original.call_boxed(keyset, *args, **kwargs)


def _dispatched(name: str, key: str, kernel, original):
    def run(keyset, *args, **kwargs):
        served = kernel(*args, **kwargs)
        return call_pytorch(name, key, original, keyset, args, kwargs) if served is None else served

    return run


def activate() -> Activation:
    """The `register_fn` of "fused_attn": registers our kernels; `activate_flash_attention_impl` calls
    it (after removing any implementation active before, so PyTorch's kernels are the ones saved)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            # Overriding aten's kernels is what activation asks for; the dispatcher's warning says so.
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for name, key, kernel in KERNELS:
                op = getattr(torch.ops.aten, name).default
                check_signature(op, kernel)
                library.impl(name, _dispatched(name, key, kernel, _pytorch_kernel(op, key)), key, with_keyset=True)
    except BaseException:
        library._destroy()
        raise
    return Activation(library)
