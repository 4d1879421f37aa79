"""The C++ CPU kernels of csrc/cpu (FlashAttention's algorithm, vectorised, oneDNN brgemm for the block
products), reached through the ops `torch.ops.fused_attn.flash_forward` / `flash_backward`.

The kernels follow ATen's choice of instruction set (ATEN_CPU_CAPABILITY caps it). Environment
overrides, for benchmarks and tests: FUSED_ATTN_CPU_BLOCK_Q / FUSED_ATTN_CPU_BLOCK_K (block sizes;
defaults 128 × 512 forward, 64 × 256 backward), FUSED_ATTN_CPU_BRGEMM=0 (the built-in micro-kernel
instead of oneDNN's brgemm), FUSED_ATTN_CPU_DECODE=0 (the long-query forward also for L_q <= 16,
where the decode kernels run by default: one item per key/value head and its whole query group, keys
split between threads when heads are few), FUSED_ATTN_CPU_ISA=default|avx2|avx512|avx512_bf16 (a compiled copy of
the kernels, up to what the CPU runs). Paged key/value caches are read through their block table
(`torch.ops.fused_attn.paged_forward`), one cache block at most per key block of the kernels. 8-bit caches
(fused_attn.quantization: float8_e4m3fn or int8 with per-sequence or per-token scales) are read in place too:
each block of keys and values is dequantized into float rows where the kernels load it, and the products then
run in float (for bf16/fp16 queries as well).
"""

from __future__ import annotations

import torch

from ..scores import FEATURES, PLAIN
from .extension import ExtensionBackend


class CpuBackend(ExtensionBackend):
    name = "cpu"
    devices = ("cpu",)
    takes_dropout = True
    takes_mask_gradient = True
    takes_score_variants = frozenset(FEATURES)
    takes_varlen = True
    reads_quantized_cache = True

    def forward_paged(self, query, k_blocks, v_blocks, block_table, attn_mask, key_padding_mask, is_causal, scale, out,
                      variant=PLAIN, k_scale=None, v_scale=None):
        self.check_variant(variant, is_causal)
        return torch.ops.fused_attn.paged_forward(query, k_blocks, v_blocks, block_table, attn_mask, key_padding_mask,
                                                  is_causal, scale, out, *variant.op_args(), k_scale, v_scale)
