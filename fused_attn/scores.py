"""What a call asks of its scores beyond the masks: the diagonal's alignment, a sliding window, a
softcap, ALiBi and attention sinks. One value, `ScoreVariant`, carries them from the public functions to
the kernels.

Query i sees key j iff

    -left <= j - (i + offset) <= right        (a bound of -1 is unbounded)

with offset = 0 when the diagonal is aligned top-left (SDPA's `is_causal`) and L_k - L_q when it is
aligned bottom-right (flash-attn's: the last query sits on the last key, as in a KV-cache step), or any
integer given as the alignment (a block of a longer sequence: queries from position p against keys from
position p', offset p - p', as ring attention's steps are).
`is_causal` is right = 0, with or without a window. A visible score s = scale * q_i . k_j becomes

    softcap * tanh(s / softcap)               (softcap > 0, Gemma 2's logit cap)
    + attn_mask[b, h, i, j]                   (an additive mask; a bool one hides keys)
    - slope[b, h] * |i + offset - j|          (ALiBi, alibi_slopes)

in that order, before the softmax. The reference backend materialises these terms; the kernels
compute them from the indices, and skip the key blocks a window hides entirely.

Sinks (gpt-oss, StreamingLLM): one learned logit per query head, sinks[h], joins every row's softmax as
a column that carries no value. Row i's weights are exp(s_ij - lse_i) with

    lse_i = log(exp(sinks[h]) + sum_j visible exp(s_ij))

so the weights of a row sum to less than 1; a row that sees no key gives output 0 and lse sinks[h]. The
kernels fold the sink in where the log-sum-exp is finalised, and their backward needs nothing more than
that log-sum-exp; the sinks' own gradient is `sink_gradient` below, one term per row.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys

import torch

from . import _extension

UNBOUNDED = -1
ALIGNMENTS = ("top_left", "bottom_right")
# What a backend may declare it takes (Backend.takes_score_variants).
FEATURES = ("bottom_right", "window", "softcap", "alibi", "sinks", "mask_program")


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreVariant:
    """The score options of one call. `alibi_slopes` is (B, H_q) float32 on the tensors' device, stride
    0 over the batch when one slope per head was given. The default value changes nothing."""

    bottom_right: bool = False
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    diagonal_shift: int = 0  # added to the alignment's offset (an integer causal_alignment)
    sinks: torch.Tensor | None = None  # (H_q,) in lse_dtype (float32; float64 for float64 inputs), contiguous
    # A mask program at the kernels' tiling (fused_attn.masks.TILE): int32 tile states (B, H_q, ⌈L_q/TILE⌉,
    # ⌈L_k/TILE⌉), stride 0 where they broadcast, and the int32 bits of its partial tiles (P, TILE, TILE/32).
    block_tiles: torch.Tensor | None = None
    block_bits: torch.Tensor | None = None

    def offset(self, len_q: int, len_k: int) -> int:
        """Key index of query 0's diagonal."""
        return (len_k - len_q if self.bottom_right else 0) + self.diagonal_shift

    def bounds(self, is_causal: bool) -> tuple[int, int]:
        """(left, right) of the visible band, `is_causal` folded in as right = 0."""
        return self.window_left, 0 if is_causal else self.window_right

    def features(self, is_causal: bool) -> tuple[str, ...]:
        """The names of what this call asks beyond plain (top-left) causal attention, as the registry
        matches them against a backend's `takes_score_variants`."""
        left, right = self.bounds(is_causal)
        names = []
        if (self.bottom_right or self.diagonal_shift) and (left != UNBOUNDED or right != UNBOUNDED or self.alibi_slopes is not None):
            names.append("bottom_right")
        if self.window_left != UNBOUNDED or self.window_right != UNBOUNDED:
            names.append("window")
        if self.softcap > 0.0:
            names.append("softcap")
        if self.alibi_slopes is not None:
            names.append("alibi")
        if self.sinks is not None:
            names.append("sinks")
        if self.block_tiles is not None:
            names.append("mask_program")
        return tuple(names)

    def score_args(self) -> tuple:
        """(window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
        block_bits): what the scores of a key take, the flat arguments of the kernels' backward."""
        return (self.window_left, self.window_right, self.bottom_right, self.softcap, self.alibi_slopes,
                self.diagonal_shift, self.block_tiles, self.block_bits)

    def op_args(self) -> tuple:
        """`score_args` and the sinks: the flat arguments of the forward ops and of the Python ops."""
        return (*self.score_args(), self.sinks)


PLAIN = ScoreVariant()


def from_op_args(window_left: int, window_right: int, bottom_right: bool, softcap: float,
                 alibi_slopes: torch.Tensor | None, diagonal_shift: int = 0, block_tiles: torch.Tensor | None = None,
                 block_bits: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> ScoreVariant:
    return ScoreVariant(bottom_right, window_left, window_right, softcap, alibi_slopes, diagonal_shift, sinks,
                        block_tiles, block_bits)


def _window(window_size) -> tuple[int, int]:
    if window_size is None:
        return UNBOUNDED, UNBOUNDED
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected None or a pair (left, right), got {window_size!r}")
    bounds = []
    for bound in window_size:
        if bound is None:
            bound = UNBOUNDED
        if not isinstance(bound, numbers.Integral) or isinstance(bound, bool) or bound < UNBOUNDED:
            raise ValueError(f"window_size: expected each bound to be an int >= 0, or -1 / None for "
                             f"unbounded, got {window_size!r}")
        bounds.append(int(bound))
    return bounds[0], bounds[1]


def _alibi(alibi_slopes, query: torch.Tensor) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected None or a torch.Tensor, got {type(alibi_slopes).__name__}")
    batch, heads = query.shape[0], query.shape[1]
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected dtype torch.float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != query.device:
        raise ValueError(f"alibi_slopes: expected device {query.device} (as query), got {alibi_slopes.device}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes: expected shape (H_q,) = ({heads},) or (B, H_q) = ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes: expected a tensor that does not require grad (the slopes get no "
                         "gradient); pass alibi_slopes.detach()")
    return alibi_slopes.expand(batch, heads)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for every input dtype but float64, whose gradients need a float64 log-sum-exp."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sinks(sinks, query: torch.Tensor) -> torch.Tensor | None:
    """The sinks as the kernels read them: (H_q,) in `lse_dtype` (the log-sum-exp they join), contiguous.
    The conversion is differentiable, so sinks of another dtype that require grad get their gradient."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected None or a torch.Tensor, got {type(sinks).__name__}")
    heads = query.shape[1]
    if sinks.dtype not in (torch.float32, query.dtype):
        expected = "torch.float32" + ("" if query.dtype == torch.float32 else f" or {query.dtype} (as query)")
        raise TypeError(f"sinks: expected dtype {expected}, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"sinks: expected device {query.device} (as query), got {sinks.device}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks: expected shape (H_q,) = ({heads},), one logit per query head, "
                         f"got {tuple(sinks.shape)}")
    return sinks.to(lse_dtype(query.dtype)).contiguous()


# The variants of calls that set nothing but the alignment, made once: most calls are these.
_UNVARIED = {"top_left": PLAIN, "bottom_right": ScoreVariant(bottom_right=True)}


def variant_of(query: torch.Tensor, causal_alignment: str, window_size, softcap, alibi_slopes,
               sinks=None) -> ScoreVariant:
    """Checks the public keywords and makes the call's ScoreVariant."""
    if (window_size is None and softcap is None and alibi_slopes is None and sinks is None
            and type(causal_alignment) is str):
        unvaried = _UNVARIED.get(causal_alignment)
        if unvaried is not None:
            return unvaried
    shift = 0
    if isinstance(causal_alignment, numbers.Integral) and not isinstance(causal_alignment, bool):
        causal_alignment, shift = "top_left", int(causal_alignment)
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment: expected one of {ALIGNMENTS} or an int (the offset), "
                         f"got {causal_alignment!r}")
    left, right = _window(window_size)
    if softcap is None:
        softcap = 0.0
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not math.isfinite(softcap) \
            or softcap < 0:
        raise ValueError(f"softcap: expected None or a finite number >= 0 (0: no cap), got {softcap!r}")
    return ScoreVariant(causal_alignment == "bottom_right", left, right, float(softcap),
                        _alibi(alibi_slopes, query), shift, _sinks(sinks, query))


def is_causal_bias(attn_mask) -> bool:
    """Whether attn_mask is a `torch.nn.attention.bias.CausalBias`. Its module is not imported here: it loads
    torch._dynamo (over a second), and no CausalBias exists before it is loaded."""
    if attn_mask is None or type(attn_mask) is torch.Tensor:  # a CausalBias is a subclass of Tensor
        return False
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(attn_mask, bias.CausalBias)


def causal_bias_variant(attn_mask, query: torch.Tensor, key: torch.Tensor) -> str | None:
    """The alignment a `torch.nn.attention.bias.CausalBias` given as attn_mask stands for ("top_left"
    or "bottom_right"), or None when attn_mask is not one."""
    if not is_causal_bias(attn_mask):
        return None
    expected = (query.shape[2], key.shape[2])
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != expected:
        raise ValueError(f"attn_mask: a CausalBias for (L_q, L_k) = {expected} was expected, got one for "
                         f"({attn_mask.seq_len_q}, {attn_mask.seq_len_kv})")
    lower_right = sys.modules["torch.nn.attention.bias"].CausalVariant.LOWER_RIGHT
    return "bottom_right" if attn_mask.variant == lower_right else "top_left"


def terms(variant: ScoreVariant, is_causal: bool, batch: int, heads: int, len_q: int, len_k: int,
          device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The variant as tensors, for the reference: (visible (L_q, L_k) bool or None, ALiBi bias
    (B, H_q, L_q, L_k) float64 or None: exact products of the float32 slopes and the distances)."""
    offset = variant.offset(len_q, len_k)
    distance = (torch.arange(len_k, device=device)[None, :]
                - torch.arange(len_q, device=device)[:, None] - offset)  # j - (i + offset)
    left, right = variant.bounds(is_causal)
    visible = None
    if left != UNBOUNDED or right != UNBOUNDED:
        visible = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
        if left != UNBOUNDED:
            visible &= distance >= -left
        if right != UNBOUNDED:
            visible &= distance <= right
    bias = None
    if variant.alibi_slopes is not None:
        slopes = variant.alibi_slopes.expand(batch, heads).to(torch.float64)
        bias = -slopes[:, :, None, None] * distance.abs().to(torch.float64)
    return visible, bias


def with_sinks(lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None, heads_dim: int = 1):
    """(out, lse) of a call without sinks turned into those of the same call with them:
    lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). For results merged outside the kernels
    (ring attention's steps); `heads_dim` is the heads' dimension of `lse` (its rows follow)."""
    if sinks is None:
        return out, lse
    shape = [1] * lse.dim()
    shape[heads_dim] = -1
    sink = sinks.to(lse.dtype).view(shape)
    merged = torch.logaddexp(lse, sink)
    factor = torch.where(merged == float("-inf"), 0.0, torch.exp(lse - merged))
    return (out.to(factor.dtype) * factor.unsqueeze(-1)).to(out.dtype), merged


def _row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """rowsum(a * b) over the last dimension, in float32 (float64 for float64 inputs), as the kernels take
    it: on the CPU one pass of the extension's `row_dots` over both (each row summed in a fixed order);
    elsewhere both converted, each in its own memory order (`.to` walks a transposed layout slower)."""
    if a.device.type == "cpu" and _extension._C is not None:
        return torch.ops.fused_attn.row_dots(a, b)
    rows = lse_dtype(a.dtype)

    def converted(tensor):
        return tensor if tensor.dtype == rows else torch.empty_like(tensor, dtype=rows).copy_(tensor)

    return torch.linalg.vecdot(converted(a), converted(b))


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
                  grad_lse: torch.Tensor | None, heads_dim: int = 1) -> torch.Tensor:
    """d loss / d sinks, (H_q,) of the sinks' dtype: the sink's weight in each row, p = exp(sink - lse), times the
    gradient its logit gets there, grad_lse - rowsum(dO * O).

    `lse` is the call's log-sum-exp (the sinks in it), the heads at `heads_dim`; `out` and `grad_out` are
    viewed with lse's shape followed by D_v. Each row's rowsum(dO * O) is taken in the log-sum-exp's
    dtype, as the kernels take it (a float64 copy of O and dO would cost ten times the pass itself); the
    terms are summed in float64 in a fixed order (a cumulative sum along each head's rows), so the
    result is bit-identical across runs and thread counts."""
    accumulate = torch.float64
    delta = _row_dots(grad_out.to(out.dtype), out).to(accumulate)
    if grad_lse is not None:
        delta = delta - grad_lse.to(accumulate)
    shape = [1] * lse.dim()
    shape[heads_dim] = -1
    sink = sinks.to(accumulate).view(shape)
    lse = lse.to(accumulate)
    weight = torch.where(lse == float("-inf"), 0.0, torch.exp(sink - lse))
    terms = (-weight * delta).movedim(heads_dim, 0).reshape(sinks.shape[0], -1)
    if terms.shape[1] == 0:
        return torch.zeros_like(sinks)
    return terms.cumsum(dim=1)[:, -1].to(sinks.dtype)
