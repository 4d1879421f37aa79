"""The `cuda` backend: the FlashAttention-2 CUDA kernels of csrc/cuda, compiled into fused_attn._C.

For CUDA machines where Triton is missing or unwanted (`FUSED_ATTN_BACKEND=cuda`), and a second,
independent GPU implementation to cross-check the first. Chosen automatically on CUDA tensors only
when the `triton` backend cannot run the call (it comes after it in the registry's order).

It reaches the kernels through the ops `torch.ops.fused_attn.flash_forward` / `flash_backward`,
whose CUDA implementation csrc/cuda/flash_cuda.cu registers. fp16 and bf16 products run on tensor
cores with fp32 accumulation; fp32 runs exactly on CUDA cores (no TF32), whatever
`torch.backends.cuda.matmul.allow_tf32` says. Needs compute capability 8.0 or newer, and a device the extension was
built for (`built_architectures`: setup.py's TORCH_CUDA_ARCH_LIST, by default cubins for 8.0, 8.6, 9.0, 10.0 and
12.0 and PTX that the driver compiles for later devices). Dropout draws
csrc/dropout.h's stream, the same elements as every other backend; the backward also gives the
gradient of a learned additive mask.

Sinks (fused_attn/scores.py) are folded in where the forward kernels finalise each row's
log-sum-exp (the long-query kernel's epilogue, the decode combine kernel); the backward kernels take
that log-sum-exp and need nothing more, and the sinks' own gradient is `scores.sink_gradient`, in
Python above the ops.

Forward calls with few query rows (L_q <= 16, a GQA group's G · L_q <= 64 rows, head dims <= 128, no
dropout: generation steps) run split-KV decode kernels: one block per (batch, key/value head, split of
the keys) for the whole query group, splits chosen from the problem and the SM count, and a combine
kernel merging them by log-sum-exp. FUSED_ATTN_CUDA_DECODE=0 turns them off; FUSED_ATTN_CUDA_DECODE_SPLITS
forces a split count.

Packed batches (`attention_varlen`) run in one launch per kernel through the ops
`flash_forward_varlen` / `flash_backward_varlen`: every block reads its sequence's bounds from
cu_seqlens itself (the grid is made for the longest sequences; blocks past their sequence's end
exit), so nothing synchronises with the host when max_seqlen_q/k are given (otherwise they are read
from the lengths).

Mask programs (fused_attn.masks) run in the forward, decode and both backward kernels: each kernel block
lies inside one 128 × 128 tile of the program, so its state decides the block once (EMPTY: skipped before
any load; FULL: nothing read per score; PARTIAL: one bit per score). A packed batch with a program runs one
sequence at a time (fused_attn.backends.packed: its bounds read on the host), each with its row of the
program, since the varlen kernels' tiles do not follow each sequence's own positions; a paged cache is
gathered for the ordinary forward (Backend.forward_paged), which takes it.
"""

from __future__ import annotations

import re

import torch

from .. import _extension
from ..problem import Problem
from ..scores import FEATURES, PLAIN
from . import packed
from .extension import ExtensionBackend, dropout_args

MAX_GRID_DIM = 65535  # heads and batch index the y and z dimensions of the grid


def has_cuda_kernels() -> bool:
    """Whether fused_attn._C registered its CUDA kernels (it does when built by a CUDA torch + nvcc)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("fused_attn::flash_forward", "CUDA")


def built_architectures() -> tuple[str, ...]:
    """What nvcc built fused_attn._C's CUDA kernels for, as setup.py recorded it: "sm_XY" cubins and "compute_XY"
    PTX; empty for an extension without CUDA kernels (or built before it recorded them)."""
    recorded = getattr(_extension._C, "cuda_architectures", "")
    return tuple(name.strip() for name in recorded.split(",") if name.strip())


def runs_on(architecture: str, capability: tuple[int, int]) -> bool:
    """Whether code built for `architecture` ("sm_86", "sm_90a", "compute_120") runs on a device of `capability`, by
    CUDA's compatibility rules: a cubin sm_XY on X.Z for every Z >= Y (an architecture-specific sm_XYa on X.Y alone);
    PTX compute_XY, compiled by the driver, on X.Y and every later capability. A name it cannot read may run (the
    launch then says whether it does)."""
    parsed = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", architecture)
    if parsed is None:
        return True
    kind, major, minor, suffix = parsed.groups()
    built = (int(major), int(minor))
    if suffix == "a":
        return tuple(capability) == built
    if kind == "sm" or suffix == "f":  # a family-specific build runs on its major's later minors, as a cubin does
        return capability[0] == built[0] and capability[1] >= built[1]
    return tuple(capability) >= built


class CudaBackend(ExtensionBackend):
    name = "cuda"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_head_dim = 256
    takes_dropout = True
    takes_mask_gradient = True
    takes_score_variants = frozenset(FEATURES)
    takes_varlen = True  # the kernels read each sequence's bounds: one launch, no host synchronisation

    def unavailable(self) -> str | None:
        if (reason := super().unavailable()) is not None:
            return reason
        if not has_cuda_kernels():
            return ("the C++ extension fused_attn._C was built without CUDA kernels (it needs a "
                    "CUDA build of torch and nvcc at build time)")
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def device_refusals(self, problem: Problem) -> list[str]:
        reasons = super().device_refusals(problem)
        if not reasons:
            capability = torch.cuda.get_device_capability(problem.device)
            name = f"{capability[0]}.{capability[1]}"
            built = built_architectures()
            if capability < (8, 0):
                reasons.append(f"needs compute capability 8.0 or newer, got {name}")
            elif built and not any(runs_on(architecture, capability) for architecture in built):
                reasons.append(f"fused_attn._C has no kernel image for compute capability {name}: it was built for "
                               f"{', '.join(built)} (TORCH_CUDA_ARCH_LIST at install; reinstall with {name} in it)")
        return reasons

    def refusals(self, problem: Problem) -> list[str]:
        reasons = super().refusals(problem)
        if problem.batch > MAX_GRID_DIM or problem.heads_q > MAX_GRID_DIM:
            reasons.append(f"batch and query heads up to {MAX_GRID_DIM}, got {problem.batch} and "
                           f"{problem.heads_q}")
        return reasons

    def forward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                       scale, out, lse, dropout=None, variant=PLAIN):
        self.check_variant(variant, is_causal)
        if variant.block_tiles is not None:  # one sequence at a time, each with its row of the program
            return packed.forward(self, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse,
                                  dropout, variant)
        torch.ops.fused_attn.flash_forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  max_seqlen_k, is_causal, scale, out, lse, *dropout_args(dropout),
                                                  *variant.op_args())

    def backward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                        scale, out, lse, grad_out, grad_lse, dropout=None, variant=PLAIN):
        self.check_variant(variant, is_causal)
        if variant.block_tiles is not None:
            return packed.backward(self, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse,
                                   grad_out, grad_lse, dropout, variant)
        return torch.ops.fused_attn.flash_backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, is_causal, scale, out, lse, grad_out, grad_lse,
                                                          *dropout_args(dropout), *variant.score_args())
