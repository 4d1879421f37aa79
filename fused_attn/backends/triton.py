"""The `triton` backend: FlashAttention-2 kernels written in Triton (see `triton_kernels`).

Chosen automatically for CUDA tensors. Forward calls with few query rows (L_q <= 16) run the split-KV
decode kernels of `triton_decode` (FUSED_ATTN_TRITON_DECODE=0 turns them off); packed batches
(`attention_varlen`) run in one launch per kernel; paged key/value caches are read through their block
table (`forward_paged`), 8-bit ones (fused_attn.quantization: int8 or float8_e4m3fn blocks with float32
scales per sequence or per stored key) in place, dequantized where the kernels load them
(`reads_quantized_cache`). Mask programs (fused_attn.masks) run in the long-query kernels at every L_q; a
packed batch with one runs one sequence at a time (fused_attn.backends.packed, each sequence with its row
of the program: the varlen launch does not take one), and a paged cache takes none. Attention sinks fold
into the forward kernels' log-sum-exp, so the backward kernels take them through the lse. With
TRITON_INTERPRET=1 set before the kernels are first imported, it also accepts CPU tensors and runs the
same kernels through Triton's interpreter; it is never chosen automatically for them (`backend="triton"`
asks for it).
"""

from __future__ import annotations

import os
import sys

import torch

from .. import quantization
from ..problem import Problem
from ..scores import FEATURES, PLAIN, ScoreVariant
from . import packed, triton_compat
from .base import Backend

def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels_built_for_gpu() -> bool:
    """Whether the kernels were already imported as GPU kernels (TRITON_INTERPRET set too late)."""
    module = sys.modules.get(f"{__package__}.triton_kernels")
    return module is not None and not module.interpreting()


def _kernels():
    # Imported on first use so that `triton.jit` reads TRITON_INTERPRET as the caller left it.
    from . import triton_kernels
    return triton_kernels


def _no_key_seen(query, out) -> torch.Tensor:
    """A call with nothing to launch, no rows or rows that see no key: output 0, lse -inf."""
    out.zero_()
    return torch.full(query.shape[:3], float("-inf"), dtype=torch.float32, device=query.device)


def _check_scales(query, k_blocks, v_blocks, k_scale, v_scale) -> None:
    """What the kernels rely on to read a paged cache's scales (Backend.forward_paged): float32 (B, H_kv) or
    (num_blocks, block_size, H_kv) for 8-bit blocks, both alike; none for blocks of the query's dtype."""
    quantized = quantization.is_quantized(k_blocks)
    dtype = k_blocks.dtype if quantized else query.dtype
    if k_blocks.dtype != dtype or v_blocks.dtype != dtype:
        raise TypeError(f"triton: k_blocks, v_blocks: expected both of query's dtype {query.dtype} or both of one "
                        f"8-bit dtype, got {k_blocks.dtype} and {v_blocks.dtype}")
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"triton: k_scale, v_scale: scales are for an 8-bit cache, got {k_blocks.dtype} blocks")
        return
    layouts = ((query.shape[0], k_blocks.shape[2]), tuple(k_blocks.shape[:3]))
    expected = layouts[1] if isinstance(k_scale, torch.Tensor) and k_scale.dim() == 3 else layouts[0]
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.device != query.device \
                or tuple(scales.shape) != expected:
            raise ValueError(f"triton: {name}: {k_blocks.dtype} blocks need float32 scales on {query.device} of "
                             f"shape {layouts[0]} or {layouts[1]}, both alike, got "
                             f"{getattr(scales, 'dtype', type(scales).__name__)} of shape "
                             f"{tuple(getattr(scales, 'shape', ()))}")


# The constexprs of triton_kernels.NOT_WARP_SPECIALIZED, as a call's launches set them.
_WARP_SPECIALIZATION_CONSTEXPRS = {
    "SOFTCAP": lambda problem: "softcap" in problem.score_features,
    "HAS_ALIBI": lambda problem: "alibi" in problem.score_features,
    "HAS_KPM": lambda problem: problem.has_key_padding_mask,
    "HAS_SINKS": lambda problem: "sinks" in problem.score_features,
    "HAS_PROGRAM": lambda problem: "mask_program" in problem.score_features,
    "PAGED": lambda problem: problem.paged,
    "MASK_KIND": lambda problem: problem.mask_dtype is not None,
}


# Of those, what the long-query forward alone takes: the backward's kernels read the sinks through the lse, the
# split-KV decode kernel through its combine.
_LONG_QUERY_FORWARD_ONLY = ("HAS_SINKS",)


def _not_warp_specialized(problem: Problem, long_query_forward: bool) -> str | None:
    """Why the autotuner offers a kernel of `problem` (the long-query forward, or another) no warp-specialized
    variant, or None: the installed Triton, or `triton_kernels.warp_specialization_refusal` of the launch's
    constexprs."""
    if (missing := triton_compat.warp_specialization_missing()) is not None:
        return missing
    kernels = _kernels()
    constexprs = {constexpr: applies(problem) and (long_query_forward or constexpr not in _LONG_QUERY_FORWARD_ONLY)
                  for constexpr, applies in _WARP_SPECIALIZATION_CONSTEXPRS.items()}
    constexprs.update(BLOCK_DQK=kernels.padded_head_dim(problem.head_dim_qk),
                      BLOCK_DV=kernels.padded_head_dim(problem.head_dim_v))
    return kernels.warp_specialization_refusal(constexprs)


def _warp_specialization_note(kernels: str, kept_out: str | None) -> str:
    if kept_out is not None:
        return f"no warp-specialized form of {kernels} descriptor variants: {kept_out}"
    return f"warp-specialized forms of {kernels} descriptor variants too, where the device's shared memory fits them"


def _runs_decode(problem: Problem) -> bool:
    """Whether the call's forward runs the split-KV decode kernels: `triton_decode.takes`, asked about tensors of
    the call's shapes that hold no data."""
    from . import triton_decode

    if problem.varlen:  # a packed batch runs the long-query kernels
        return False

    def shaped(heads, length, dim):
        return torch.empty(problem.batch, heads, length, dim, device="meta", dtype=problem.dtype)

    program = ScoreVariant(block_tiles=torch.empty(0, device="meta")) if "mask_program" in problem.score_features \
        else PLAIN
    dropout = problem.dropout_p if problem.dropout_p > 0.0 else None  # `takes` asks only whether there is one
    return triton_decode.takes(shaped(problem.heads_q, problem.len_q, problem.head_dim_qk),
                               shaped(problem.heads_kv, problem.len_k, problem.head_dim_qk),
                               shaped(problem.heads_kv, problem.len_k, problem.head_dim_v), dropout, variant=program)


class TritonBackend(Backend):
    name = "triton"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_head_dim = 256
    takes_dropout = True
    takes_mask_gradient = True
    takes_score_variants = frozenset(FEATURES)  # sinks: folded into the forward's lse (HAS_SINKS)
    takes_varlen = True  # the kernels read each sequence's bounds: one launch, no host synchronisation
    reads_quantized_cache = True  # forward_paged: 8-bit blocks dequantized where the kernels load them

    def unavailable(self) -> str | None:
        if (reason := triton_compat.unsupported()) is not None:
            return reason
        if not torch.cuda.is_available() and not _interpret_requested():
            build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch {torch.__version__}"
            return (f"no CUDA device ({build}); CPU tensors run in Triton's interpreter with "
                    "TRITON_INTERPRET=1")
        return None

    def device_refusals(self, problem: Problem) -> list[str]:
        device = problem.device.type
        if device == "cpu":
            if not _interpret_requested():
                return ["CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1)"]
            if _kernels_built_for_gpu():
                return ["TRITON_INTERPRET=1 was set after the kernels were imported for the GPU"]
            return []
        if device != "cuda":
            return super().device_refusals(problem)
        capability = torch.cuda.get_device_capability(problem.device)
        if capability < (7, 5):
            return [f"needs compute capability 7.5 or newer, got {capability[0]}.{capability[1]}"]
        if problem.dtype == torch.bfloat16 and capability < (8, 0):
            return ["bfloat16 needs compute capability 8.0 or newer"]
        return []

    def notes(self, problem: Problem) -> list[str]:
        """Also, on a GPU, whether the tensor-descriptor (TMA) variants of the kernels that run the call (the forward or
        the split-KV decode kernel, the backward's dK/dV and dQ) are among the autotuner's candidates, and their
        warp-specialized forms, or why not (a call's own layouts may still keep them out:
        `triton_kernels.descriptor_refusals`)."""
        notes = super().notes(problem)
        if problem.device.type != "cuda":
            return notes
        kernels = _kernels()
        reason = kernels.descriptors_unavailable(problem.device)
        if reason is None:
            reason = next(iter(kernels.call_refusals(problem.dtype, paged=problem.paged, packed=problem.varlen)), None)
        if reason is None and kernels.descriptor_mode() == "off":
            reason = f"{kernels.DESCRIPTORS_VARIABLE}=0"
        if reason is not None:
            notes.append(f"its kernels read through pointers only (no tensor-descriptor or warp-specialized variant): "
                         f"{reason}")
            return notes
        decode = _runs_decode(problem)
        forward = "its forward's split-KV decode kernel also tries K and V" if decode else \
            "its forward also tries Q, K, V and O"
        notes.append(f"{forward} through tensor descriptors (TMA), its backward Q, K, V, dO, dQ, dK and dV, where the "
                     "layouts allow")
        forward, backward = _not_warp_specialized(problem, not decode), _not_warp_specialized(problem, False)
        if forward == backward:
            notes.append(_warp_specialization_note("its forward's and backward's", forward))
        else:
            notes += [_warp_specialization_note("its forward's", forward),
                      _warp_specialization_note("its backward's", backward)]
        return notes

    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout=None,
                variant=PLAIN):
        self.check_variant(variant, is_causal)
        if out.numel() == 0 or key.shape[2] == 0:
            return _no_key_seen(query, out)
        kernels = _kernels()
        from . import triton_decode  # after the kernels it builds on

        if triton_decode.takes(query, key, value, dropout, variant=variant):
            return triton_decode.forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out,
                                         variant)
        return kernels.forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out,
                               dropout, variant)

    def forward_paged(self, query, k_blocks, v_blocks, block_table, attn_mask, key_padding_mask, is_causal, scale, out,
                      variant=PLAIN, k_scale=None, v_scale=None):
        self.check_variant(variant, is_causal)
        if variant.block_tiles is not None:  # attention_with_kvcache passes none
            raise ValueError("triton: block_tiles: forward_paged takes no mask program (forward does)")
        _check_scales(query, k_blocks, v_blocks, k_scale, v_scale)
        kernels = _kernels()
        from . import triton_decode

        pages = kernels.Pages(block_table, k_blocks.shape[1], k_scale, v_scale)
        fp8_type = kernels.reads_fp8_type(query.device)
        key, value = kernels.cache_blocks(k_blocks, fp8_type), kernels.cache_blocks(v_blocks, fp8_type)
        if out.numel() == 0 or pages.len_k == 0:
            return _no_key_seen(query, out)
        if triton_decode.takes(query, key, value, None, pages.len_k):
            return triton_decode.forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, variant,
                                         pages)
        return kernels.forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, None, variant,
                               pages)

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                 grad_out, grad_lse, dropout=None, grad_mask=None, variant=PLAIN):
        self.check_variant(variant, is_causal)
        if out.numel() == 0 or key.shape[2] == 0:
            return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        return _kernels().backward(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                                   out, lse, grad_out, grad_lse, dropout, grad_mask, variant)

    def forward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                       scale, out, lse, dropout=None, variant=PLAIN):
        self.check_variant(variant, is_causal)
        if variant.block_tiles is not None:  # one sequence at a time, each with its row of the program
            packed.forward(self, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse, dropout,
                           variant)
            return
        _kernels().forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  is_causal, scale, out, lse, dropout, variant)

    def backward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                        scale, out, lse, grad_out, grad_lse, dropout=None, variant=PLAIN):
        self.check_variant(variant, is_causal)
        if variant.block_tiles is not None:
            return packed.backward(self, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse,
                                   grad_out, grad_lse, dropout, variant)
        return _kernels().backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          is_causal, scale, out, lse, grad_out, grad_lse, dropout, variant)
