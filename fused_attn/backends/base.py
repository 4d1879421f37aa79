"""What every backend provides to the registry and to the autograd op."""

from __future__ import annotations

import torch

from . import packed
from ..dropout import Dropout
from ..problem import Problem
from ..scores import PLAIN, ScoreVariant

# How a refusal names each score variant (fused_attn.scores.FEATURES).
SCORE_FEATURE_NAMES = {"bottom_right": "bottom-right causal alignment", "window": "a sliding window",
                       "softcap": "softcap", "alibi": "ALiBi slopes", "sinks": "attention sinks",
                       "mask_program": "a mask program"}


class Backend:
    """A backend declares what it supports and computes the forward and backward of the contract.

    Subclasses set `name`, `devices` and the declarations below, and override `unavailable`,
    `forward` and `backward`; `device_refusals` and `refusals` where they have more to say. See
    `fused_attn.problem` for the tensors they receive.
    """

    name: str = ""
    # Device types the backend is chosen for automatically, in the registry's order of preference.
    devices: tuple[str, ...] = ()
    # What the kernels take: input dtypes, the largest head dim, dropout, a gradient for attn_mask,
    # the score variants of fused_attn.scores.
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    max_head_dim: int | None = None
    takes_dropout: bool = False
    takes_mask_gradient: bool = False
    takes_score_variants: frozenset[str] = frozenset()
    # Packed batches of sequences (fused_attn.varlen): `forward_varlen` / `backward_varlen`.
    takes_varlen: bool = False
    # 8-bit key/value caches (fused_attn.quantization) read by the kernels in place through `forward_paged`;
    # the other backends run on a dequantized copy.
    reads_quantized_cache: bool = False

    def unavailable(self) -> str | None:
        """Why this backend cannot run at all here (missing build, library...), or None."""
        return None

    def device_refusals(self, problem: Problem) -> list[str]:
        """Why the backend cannot run on `problem.device` (by default: a device type it is not for)."""
        if problem.device.type not in self.devices:
            kinds = "/".join(device.upper() for device in self.devices)
            return [f"runs on {kinds} tensors only, got device {problem.device}"]
        return []

    def refusals(self, problem: Problem) -> list[str]:
        """Every reason this backend cannot run `problem`; empty when it can.

        For the devices in `devices`, the answer may depend only on the problem and on what was found
        at import (the registry remembers its automatic choices)."""
        reasons = self.device_refusals(problem)
        if problem.dtype not in self.dtypes:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in self.dtypes)
            reasons.append(f"dtype {problem.dtype} is not supported ({names})")
        if self.max_head_dim is not None and max(problem.head_dim_qk, problem.head_dim_v) > self.max_head_dim:
            reasons.append(f"head dims up to {self.max_head_dim}, got {problem.head_dim_qk} (query/key) "
                           f"and {problem.head_dim_v} (value)")
        if problem.dropout_p > 0.0 and not self.takes_dropout:
            reasons.append("dropout is not supported (dropout_p > 0)")
        if problem.mask_requires_grad and not self.takes_mask_gradient:
            reasons.append("attn_mask requires grad (no mask gradient)")
        if problem.varlen and not self.takes_varlen:
            reasons.append("packed batches (attention_varlen) are not supported yet: the kernels do not read the "
                           "sequence bounds themselves, and a loop over sequences would synchronise with the host")
        for feature in problem.score_features:
            if feature not in self.takes_score_variants:
                reasons.append(f"{SCORE_FEATURE_NAMES[feature]} is not supported yet")
        return reasons

    def check_variant(self, variant: ScoreVariant, is_causal: bool) -> None:
        """Raises when `variant` asks for a score variant the backend does not declare (the registry
        never chooses it for one; a direct call gets the reason instead of a wrong result)."""
        missing = [SCORE_FEATURE_NAMES[f] for f in variant.features(is_causal) if f not in self.takes_score_variants]
        if missing:
            raise ValueError(f"{self.name}: {', '.join(missing)} not supported")

    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal: bool, scale: float,
                out: torch.Tensor, dropout: Dropout | None = None,
                variant: ScoreVariant = PLAIN) -> torch.Tensor:
        """Writes the attention output into `out`; returns the log-sum-exp (B, H_q, L_q), in `lse_dtype`.

        `dropout` (only for backends that declare `takes_dropout`) drops the elements that
        `fused_attn.dropout` defines and scales the kept ones; the log-sum-exp is of the undropped
        scores. `variant` (fused_attn.scores) asks only for what `takes_score_variants` declares."""
        raise NotImplementedError

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal: bool, scale: float,
                 out, lse, grad_out, grad_lse, dropout: Dropout | None = None,
                 grad_mask: torch.Tensor | None = None,
                 variant: ScoreVariant = PLAIN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (grad_query, grad_key, grad_value), each laid out as `torch.empty_like` of its input
        (the fake kernel promises that layout to torch.compile).

        `grad_mask` (only for backends that declare `takes_mask_gradient`) is None, or a zero-filled
        (B, H_q, L_q, L_k) tensor of the additive mask's dtype: the backend writes into it dS, the
        gradient of the scores the mask is added to (after the softcap), which is the gradient of the
        mask, wherever a key is visible (elsewhere it stays 0). Autograd sums it over the mask's broadcast dimensions.

        `grad_lse` is None or the gradient flowing into the returned log-sum-exp; since
        d lse_i / d s_ij = p_ij, it enters as `rowsum(dO * O) - grad_lse` in place of `rowsum(dO * O)`.
        The result must be deterministic: the same inputs give bit-identical gradients.
        """
        raise NotImplementedError

    def forward_paged(self, query, k_blocks, v_blocks, block_table, attn_mask, key_padding_mask, is_causal: bool,
                      scale: float, out: torch.Tensor, variant: ScoreVariant = PLAIN, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` over a paged key/value cache (fused_attn.kvcache): key and value are blocks
        (num_blocks, block_size, H_kv, D), key j of batch row b is row j % block_size of block
        `block_table[b, j // block_size]` (int32 (B, max_blocks), unit stride along the blocks); L_k is
        max_blocks · block_size, and `key_padding_mask` hides every key past each row's end, whose
        blocks need not be valid indices. No dropout (inference).

        An 8-bit cache (fused_attn.quantization: float8_e4m3fn or int8 blocks) comes with its float32
        scales, each either (B, H_kv), one per sequence and kv head, or (num_blocks, block_size, H_kv), one
        per stored key and head in the blocks' layout (any strides); key j stands for its 8-bit values
        times its scale. None: blocks of the query's dtype.

        By default the blocks are gathered into a dense (B, H_kv, L_k, D) copy, dequantized into the
        query's dtype, for `forward` (the definition; backends whose kernels read the block table
        override it)."""
        key, value = (packed.gathered_cache(blocks, scales, block_table, key_padding_mask, query.dtype)
                      for blocks, scales in ((k_blocks, k_scale), (v_blocks, v_scale)))
        return self.forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, None, variant)

    def notes(self, problem: Problem) -> list[str]:
        """What the backend does differently from the kernels' direct path for `problem`, though it runs it
        (e.g. an 8-bit cache dequantized into a copy): the registry reports them with its choices."""
        if problem.cache_dtype is not None and not self.reads_quantized_cache:
            return [f"dequantizes the {str(problem.cache_dtype).removeprefix('torch.')} key/value cache into a "
                    f"{str(problem.dtype).removeprefix('torch.')} copy before its kernels run"]
        return []

    def forward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                       is_causal: bool, scale: float, out: torch.Tensor, lse: torch.Tensor,
                       dropout: Dropout | None = None, variant: ScoreVariant = PLAIN) -> None:
        """A packed batch (fused_attn.varlen): writes `out` (total_q, H_q, D_v) and `lse` (H_q, total_q).

        query (total_q, H_q, D_qk), key (total_k, H_kv, D_qk), value (total_k, H_kv, D_v); sequence b
        is tokens cu_seqlens[b] .. cu_seqlens[b + 1] (int32 or int64 (B + 1,), on the tensors' device);
        `max_seqlen_*` bound the lengths (-1: not given); `variant.alibi_slopes` is (B, H_q). Sequence
        b drops what a one-sequence call with `dropout`'s (seed, offset + b) drops. By default each
        sequence runs `forward` on its strided view, its bounds read on the host."""
        packed.forward(self, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse, dropout,
                       variant)

    def backward_varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                        is_causal: bool, scale: float, out, lse, grad_out, grad_lse, dropout: Dropout | None = None,
                        variant: ScoreVariant = PLAIN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed gradients of query, key and value (`grad_lse`: None or (H_q, total_q))."""
        return packed.backward(self, query, key, value, cu_seqlens_q, cu_seqlens_k, is_causal, scale, out, lse,
                               grad_out, grad_lse, dropout, variant)

    def __repr__(self) -> str:
        return f"<fused_attn backend {self.name!r}>"
