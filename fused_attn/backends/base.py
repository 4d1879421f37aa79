"""What every backend provides to the registry and to the autograd op."""

from __future__ import annotations

import torch

from ..problem import Problem


class Backend:
    """A backend declares what it supports and computes the forward and backward of the contract.

    Subclasses set `name` and `devices`, and override `unavailable`, `refusals`, `forward` and
    `backward`. See `fused_attn.problem` for the tensors they receive.
    """

    name: str = ""
    # Device types the backend is chosen for automatically, in the registry's order of preference.
    devices: tuple[str, ...] = ()

    def unavailable(self) -> str | None:
        """Why this backend cannot run at all here (missing build, library...), or None."""
        return None

    def refusals(self, problem: Problem) -> list[str]:
        """Every reason this backend cannot run `problem`; empty when it can."""
        return []

    def forward(self, query, key, value, attn_mask, key_padding_mask, is_causal: bool, scale: float,
                out: torch.Tensor) -> torch.Tensor:
        """Writes the attention output into `out`; returns the log-sum-exp (B, H_q, L_q), in `lse_dtype`."""
        raise NotImplementedError

    def backward(self, query, key, value, attn_mask, key_padding_mask, is_causal: bool, scale: float,
                 out, lse, grad_out, grad_lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (grad_query, grad_key, grad_value), each laid out as `torch.empty_like` of its input
        (the fake kernel promises that layout to torch.compile).

        `grad_lse` is None or the gradient flowing into the returned log-sum-exp; since
        d lse_i / d s_ij = p_ij, it enters as `rowsum(dO * O) - grad_lse` in place of `rowsum(dO * O)`.
        The result must be deterministic: the same inputs give bit-identical gradients.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<fused_attn backend {self.name!r}>"
