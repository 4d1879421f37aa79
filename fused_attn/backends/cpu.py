"""The C++ CPU kernels of csrc/cpu (FlashAttention's algorithm, vectorised, oneDNN brgemm for the block
products), reached through the ops `torch.ops.fused_attn.flash_forward` / `flash_backward`.

The kernels follow ATen's choice of instruction set (ATEN_CPU_CAPABILITY caps it). Environment
overrides, for benchmarks and tests: FUSED_ATTN_CPU_BLOCK_Q / FUSED_ATTN_CPU_BLOCK_K (block sizes;
defaults 128 × 512 forward, 64 × 256 backward), FUSED_ATTN_CPU_BRGEMM=0 (the built-in micro-kernel
instead of oneDNN's brgemm), FUSED_ATTN_CPU_ISA=default|avx2|avx512|avx512_bf16 (a compiled copy of
the kernels, up to what the CPU runs).
"""

from __future__ import annotations

import torch

from .. import _extension
from ..problem import Problem
from .base import Backend

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class CpuBackend(Backend):
    name = "cpu"
    devices = ("cpu",)

    def unavailable(self) -> str | None:
        return _extension.missing_reason

    def refusals(self, problem: Problem) -> list[str]:
        reasons = []
        if problem.device.type != "cpu":
            reasons.append(f"runs on CPU tensors only, got device {problem.device}")
        if problem.dtype not in DTYPES:
            reasons.append(f"dtype {problem.dtype} is not one of {DTYPES}")
        if problem.dropout_p > 0.0:
            reasons.append("no dropout (dropout_p > 0)")
        if problem.mask_requires_grad:
            reasons.append("no gradient for attn_mask (the mask requires grad)")
        return reasons

    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out):
        return torch.ops.fused_attn.flash_forward(query, key, value, attn_mask, key_padding_mask,
                                                  is_causal, scale, out)

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                 grad_out, grad_lse):
        return torch.ops.fused_attn.flash_backward(query, key, value, attn_mask, key_padding_mask,
                                                   is_causal, scale, out, lse, grad_out, grad_lse)
