"""Backends whose kernels are the C++ ops of fused_attn._C: `torch.ops.fused_attn.flash_forward` and
`flash_backward`, implemented per device (csrc/cpu, csrc/cuda) behind the schemas of csrc/ops.cpp."""

from __future__ import annotations

import torch

from .. import _extension
from ..scores import PLAIN
from .base import Backend


def dropout_args(dropout):
    """(dropout_p, dropout_rng) of the C++ ops."""
    return (0.0, None) if dropout is None else (dropout.p, dropout.rng)


class ExtensionBackend(Backend):
    """Calls the extension's ops; the dispatcher picks the kernel of the tensors' device."""

    def unavailable(self) -> str | None:
        return _extension.missing_reason

    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout=None,
                variant=PLAIN):
        self.check_variant(variant, is_causal)
        return torch.ops.fused_attn.flash_forward(query, key, value, attn_mask, key_padding_mask,
                                                  is_causal, scale, out, *dropout_args(dropout),
                                                  *variant.op_args())

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                 grad_out, grad_lse, dropout=None, grad_mask=None, variant=PLAIN):
        self.check_variant(variant, is_causal)
        return torch.ops.fused_attn.flash_backward(query, key, value, attn_mask, key_padding_mask,
                                                   is_causal, scale, out, lse, grad_out, grad_lse,
                                                   *dropout_args(dropout), grad_mask, *variant.score_args())
