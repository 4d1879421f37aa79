"""Dropout of attention weights: which elements a call drops, the same on every backend.

Element (b, h, i, j) of a call (batch b, query head h, query i, key j) is dropped iff

    philox4x32_10(counter, key)[J % 4] < threshold(p),    I = query_start + i,  J = key_start + j
    counter = (J // 4, I, b * H_q + h, offset),   key = (seed mod 2^32, seed div 2^32)

(in a packed batch, `attention_varlen`, sequence b is a one-sequence call: counter (J // 4, I, h,
offset + b)), with Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011: the
generator of cuRAND's philox, PyTorch's CUDA dropout and Triton's `tl.rand`), and kept elements are
scaled by 1 / (1 - p). One block of Philox output serves four neighbouring keys. The decision is a
pure function of (seed, offset, b, h, I, J): it depends on no tile size, thread count or launch
order, so the reference, the CPU, CUDA and Triton kernels drop the same elements for the same seed
and offset, and a backward regenerates the forward's mask instead of storing it. A call's
(query_start, key_start) are 0; a call on a block of a longer sequence (ring attention's steps) gives
its first query's and first key's positions there (`at_positions`), and so drops exactly what the
call on the whole sequence drops in that block.

The comparison is on the 32-bit integer, never on a float, so no backend's rounding can flip a
decision: threshold(p) = round(p * 2^32), at most 2^32 - 1.

A call's rng is an int64 tensor (4,): (seed, offset, query_start, key_start). Each call draws a fresh
62-bit seed, with offset and positions 0, from torch's generator of the tensors' device
(a `torch.randint` on that device: no host synchronisation, traceable by torch.compile), or from the
`generator` it is given: `torch.manual_seed` reproduces a run, and each call advances the generator,
so two calls drop different elements.

This module is the Python statement of the formula; csrc/dropout.h states it for the C++ kernels
(CPU and CUDA) and the Triton kernels implement it in
`triton_kernels._dropout_bits`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Philox4x32 constants: the round multipliers and the Weyl sequence that bumps the key.
MULTIPLIER_0 = 0xD2511F53
MULTIPLIER_1 = 0xCD9E8D57
KEY_BUMP_0 = 0x9E3779B9
KEY_BUMP_1 = 0xBB67AE85
ROUNDS = 10
MASK_32 = 0xFFFFFFFF


def threshold(dropout_p: float) -> int:
    """The 32-bit integer below which an element is dropped: p·2³² rounded half away from zero, as
    the C++ kernels' std::llround does."""
    return min(math.floor(dropout_p * 2.0 ** 32 + 0.5), MASK_32)


def _mulhilo(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * multiplier, for int64 tensors holding 32-bit values.

    Computed on 16-bit halves of the multiplier, so no intermediate exceeds 2^49: int64 never
    overflows.
    """
    low_part = a * (multiplier & 0xFFFF)
    high_part = a * (multiplier >> 16)
    high = ((low_part >> 16) + high_part) >> 16
    low = (low_part + ((high_part & 0xFFFF) << 16)) & MASK_32
    return high & MASK_32, low


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """The four 32-bit outputs of Philox4x32-10 for counters (c0, c1, c2, c3) and key (k0, k1): int64
    tensors (or ints, for the key) holding 32-bit values, broadcastable; int64 tensors."""
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    for round_index in range(ROUNDS):
        if round_index:
            k0, k1 = (k0 + KEY_BUMP_0) & MASK_32, (k1 + KEY_BUMP_1) & MASK_32
        high_0, low_0 = _mulhilo(c0, MULTIPLIER_0)
        high_1, low_1 = _mulhilo(c2, MULTIPLIER_1)
        c0, c1, c2, c3 = high_1 ^ c1 ^ k0, low_1, high_0 ^ c3 ^ k1, low_0
    return c0, c1, c2, c3


RNG_SIZE = 4  # (seed, offset, query_start, key_start)


def check_rng(rng, device: torch.device) -> None:
    """A ValueError naming `dropout_rng` unless it is a call's (seed, offset, query_start, key_start):
    int64 (4,) on `device`."""
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64 or tuple(rng.shape) != (RNG_SIZE,) \
            or rng.device != device:
        described = (f"{tuple(rng.shape)} {rng.dtype} on {rng.device}" if isinstance(rng, torch.Tensor)
                     else type(rng).__name__)
        raise ValueError(f"dropout_rng: expected an int64 tensor (4,) of (seed, offset, query_start, key_start) "
                         f"on {device}, got {described}")


class Dropout(NamedTuple):
    """What a call asks of dropout: the probability and its (seed, offset, query_start, key_start), an
    int64 tensor (4,) on the tensors' device, so that kernels read it without a host synchronisation and torch.compile
    traces it as data."""

    p: float
    rng: torch.Tensor

    @property
    def threshold(self) -> int:
        return threshold(self.p)

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)


def bits(rng: torch.Tensor, batch: int, heads: int, len_q: int, len_k: int) -> torch.Tensor:
    """The 32-bit random integer of every element (B, H_q, L_q, L_k), as int64 on rng's device."""
    as_long = dict(dtype=torch.int64, device=rng.device)
    seed, offset, query_start, key_start = rng.unbind()
    keys = torch.arange(len_k, **as_long) + key_start
    queries = (torch.arange(len_q, **as_long) + query_start)[:, None, None]
    batch_heads = torch.arange(batch * heads, **as_long)[:, None, None, None]
    outputs = philox4x32_10(keys // 4, queries, batch_heads, offset & MASK_32, seed & MASK_32,
                            (seed >> 32) & MASK_32)
    # Output j % 4 of each block: stack the four and pick along the last axis.
    stacked = torch.stack(outputs, dim=-1)
    picked = stacked.gather(-1, (keys % 4).expand(stacked.shape[:-1]).unsqueeze(-1)).squeeze(-1)
    return picked.reshape(batch, heads, len_q, len_k)


def keep_mask(dropout: Dropout, batch: int, heads: int, len_q: int, len_k: int) -> torch.Tensor:
    """Bool (B, H_q, L_q, L_k): True where the element is kept."""
    return bits(dropout.rng, batch, heads, len_q, len_k) >= dropout.threshold


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def next_rng(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A call's (seed, offset, query_start, key_start) as an int64 tensor (4,) on `device`: a seed drawn
    from `generator` or the default generator of `device` (advancing it), the rest 0."""
    options = dict(dtype=torch.int64, device=device)
    # Without a generator argument, so that torch.compile traces the draw as any random op.
    draw = {} if generator is None else {"generator": generator}
    seed = torch.randint(0, 2 ** 62, (1,), **draw, **options)
    return torch.cat([seed, torch.zeros(RNG_SIZE - 1, **options)])


def shifted_rng(rng: torch.Tensor, offset: int = 0, query_start: int = 0, key_start: int = 0) -> torch.Tensor:
    """`rng` with its offset and positions advanced: the stream of sequence `offset` of a packed batch, or
    of the block whose first query and key sit at `query_start` and `key_start` of the call's sequence."""
    return rng + torch.tensor([0, offset, query_start, key_start], dtype=torch.int64, device=rng.device)


def peek_rng(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """The (seed, offset) the next call with `generator` (or the default one of `device`) will use,
    leaving the generator as it was."""
    chosen = _default_generator(device) if generator is None else generator
    state = chosen.get_state()
    try:
        return next_rng(device, chosen)
    finally:
        chosen.set_state(state)
