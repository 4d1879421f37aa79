"""Mask programs: which keys each query sees, as data the kernels tile over instead of an L_q × L_k mask.

A mask is first a *mask function*, FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = the
query sees the key), evaluated on broadcast index tensors. Ready-made ones need no Python callable and
combine with `&` and `|`:

    documents(doc_ids)          query and key in the same document (packed sequences; ids per token)
    prefix_lm(prefix_lengths)   keys of each row's prefix seen by every query, causal after it
    chunks(chunk_size)          query and key in the same chunk of `chunk_size` tokens (Llama 4)
    causal(alignment)           key j seen by query i iff j <= i + offset ("top_left" or "bottom_right")
    sliding_window(left, right, alignment)
    kept_keys(kept)             key padding: the keys of each row marked kept (transformers' attention_mask)
    mask_function(fn)           any mask_mod (its tiles classified from index ranges where it allows)

FlexAttention's BlockMask (`create_block_mask`) is taken as it is: `program_of_block_mask` reuses its
block classification and evaluates its mask_mod on its partial blocks only.

`mask_program(mask, batch, heads, len_q, len_k)` builds the `MaskProgram` once per batch; every layer
and the backward reuse it (`attention(..., attn_mask=program)`). It describes each tile of TILE × TILE
(query rows × keys) as empty (never visited), full (nothing read per score) or partial (one bit per
pair, TILE · TILE / 8 bytes): csrc/block_mask.h gives the layout the kernels read. Its memory is 4 bytes
per tile state (per batch row and head it varies with) plus 2 KiB per partial tile, never an L_q × L_k
tensor: the ready-made masks classify tiles from per-tile index ranges and evaluate only the partial
tiles. A plain function is run once on index ranges (fused_attn.mask_ranges) to classify the tiles the same
way; one whose operations those ranges cannot follow is evaluated in slices of rows (ROWS_PER_SLICE × L_k
at a time).
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from typing import Callable

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from . import mask_ranges

TILE = 128  # csrc/block_mask.h: kTile
WORDS = TILE // 32
EMPTY, FULL = -1, -2
PENDING = -3  # a tile state while the program is built: its pairs are to be evaluated
ROWS_PER_SLICE = 4 * TILE  # a plain mask_mod is evaluated on ROWS_PER_SLICE × L_k pairs at a time
TILES_PER_BATCH = 64  # partial tiles evaluated together (TILES_PER_BATCH × TILE² pairs)


@dataclasses.dataclass(frozen=True)
class TileGeometry:
    """The index ranges of a program's tiles: tile t holds rows [lo[t], hi[t]] (inclusive)."""

    len_q: int
    len_k: int
    device: torch.device
    batch: int = 1  # the rows and heads the program holds apart (b and h a mask_mod is called with)
    heads: int = 1

    def _bounds(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = torch.arange(0, max(length, 1), TILE, device=self.device)
        return lo, torch.clamp(lo + TILE - 1, max=max(length - 1, 0))

    def query_bounds(self):
        """(lo, hi) of the query tiles, each (NQ, 1)."""
        lo, hi = self._bounds(self.len_q)
        return lo[:, None], hi[:, None]

    def key_bounds(self):
        """(lo, hi) of the key tiles, each (1, NK)."""
        lo, hi = self._bounds(self.len_k)
        return lo[None, :], hi[None, :]


class MaskMod:
    """A mask function with structure: callable as FlexAttention's mask_mod, and able to say per tile,
    without evaluating its pairs, whether some pair may be seen and whether every pair is."""

    def __call__(self, b, h, q_idx, kv_idx):
        raise NotImplementedError

    def tile_states(self, geometry: TileGeometry):
        """(some, every): bool tensors broadcastable to (B, H, NQ, NK), `some` False only where no pair of
        the tile is seen and `every` True only where all are; None when unknown (evaluate the pairs)."""
        return None

    def resolved(self, len_q: int, len_k: int) -> "MaskMod":
        """This mask with what depends on the call's lengths (a bottom-right alignment) fixed."""
        return self

    def __and__(self, other):
        return _Both(self, _as_mask_mod(other))

    def __or__(self, other):
        return _Either(self, _as_mask_mod(other))

    def __rand__(self, other):
        return _Both(_as_mask_mod(other), self)

    def __ror__(self, other):
        return _Either(_as_mask_mod(other), self)


def _as_mask_mod(mask) -> MaskMod:
    if isinstance(mask, MaskMod):
        return mask
    if callable(mask):
        return mask_function(mask)
    raise TypeError(f"mask: expected a mask_mod(b, h, q_idx, kv_idx) or a fused_attn.masks mask, got "
                    f"{type(mask).__name__}")


class _Both(MaskMod):
    def __init__(self, first: MaskMod, second: MaskMod):
        self.first, self.second = first, second

    def __call__(self, b, h, q_idx, kv_idx):
        return self.first(b, h, q_idx, kv_idx) & self.second(b, h, q_idx, kv_idx)

    def tile_states(self, geometry):
        a, b = self.first.tile_states(geometry), self.second.tile_states(geometry)
        if a is None or b is None:
            return None
        return a[0] & b[0], a[1] & b[1]

    def resolved(self, len_q, len_k):
        return _Both(self.first.resolved(len_q, len_k), self.second.resolved(len_q, len_k))

    def __repr__(self):
        return f"({self.first!r} & {self.second!r})"


class _Either(MaskMod):
    def __init__(self, first: MaskMod, second: MaskMod):
        self.first, self.second = first, second

    def __call__(self, b, h, q_idx, kv_idx):
        return self.first(b, h, q_idx, kv_idx) | self.second(b, h, q_idx, kv_idx)

    def tile_states(self, geometry):
        a, b = self.first.tile_states(geometry), self.second.tile_states(geometry)
        if a is None or b is None:
            return None
        return a[0] | b[0], a[1] | b[1]

    def resolved(self, len_q, len_k):
        return _Either(self.first.resolved(len_q, len_k), self.second.resolved(len_q, len_k))

    def __repr__(self):
        return f"({self.first!r} | {self.second!r})"


class _Function(MaskMod):
    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def tile_states(self, geometry):
        try:
            return mask_ranges.tile_truth(self.fn, geometry.batch, geometry.heads, geometry.query_bounds(),
                                          geometry.key_bounds(), geometry.device)
        except Exception:  # anything the ranges do not follow (or an error the pairs' evaluation will raise)
            return None

    def __repr__(self):
        return f"mask_function({getattr(self.fn, '__name__', self.fn)!r})"


def mask_function(fn: Callable) -> MaskMod:
    """Any FlexAttention mask_mod(b, h, q_idx, kv_idx) -> bool. It is called on broadcast index tensors
    (int64; b and h of shape (…, 1, 1)), so it must be written with tensor operations, as for
    `torch.func.vmap`. The program's build runs it once on index ranges that stand for whole tiles
    (fused_attn.mask_ranges) and evaluates pair by pair only the tiles found neither empty nor full; a function
    whose operations the ranges do not follow (see there) has all its pairs evaluated, ROWS_PER_SLICE rows at a
    time."""
    if isinstance(fn, MaskMod):
        return fn
    if not callable(fn):
        raise TypeError(f"mask_mod: expected a callable (b, h, q_idx, kv_idx) -> bool, got {type(fn).__name__}")
    return _Function(fn)


def _offset(alignment, len_q: int, len_k: int) -> int:
    if alignment == "top_left":
        return 0
    if alignment == "bottom_right":
        return len_k - len_q
    if isinstance(alignment, numbers.Integral) and not isinstance(alignment, bool):
        return int(alignment)
    raise ValueError(f"alignment: expected 'top_left', 'bottom_right' or an int offset, got {alignment!r}")


class _Band(MaskMod):
    """-left <= j - (i + offset) <= right (None: unbounded), the diagonal placed by `alignment`."""

    def __init__(self, left, right, alignment="top_left", offset=None):
        for name, bound in (("left", left), ("right", right)):
            if bound is not None and (not isinstance(bound, numbers.Integral) or isinstance(bound, bool) or bound < 0):
                raise ValueError(f"{name}: expected None (unbounded) or an int >= 0, got {bound!r}")
        if offset is None and alignment != "bottom_right":  # known without the call's lengths
            offset = _offset(alignment, 0, 0)
        self.left, self.right, self.alignment, self.offset = left, right, alignment, offset

    def resolved(self, len_q, len_k):
        return _Band(self.left, self.right, self.alignment, _offset(self.alignment, len_q, len_k))

    def _distance(self, q_idx, kv_idx):
        if self.offset is None:
            raise RuntimeError("a causal or sliding-window mask with a bottom-right alignment needs the call's "
                               "lengths: build it with mask_program(...)")
        return kv_idx - q_idx - self.offset

    def __call__(self, b, h, q_idx, kv_idx):
        distance = self._distance(q_idx, kv_idx)
        seen = torch.ones_like(distance, dtype=torch.bool)
        if self.left is not None:
            seen = seen & (distance >= -self.left)
        if self.right is not None:
            seen = seen & (distance <= self.right)
        return seen

    def tile_states(self, geometry):
        (q_lo, q_hi), (k_lo, k_hi) = geometry.query_bounds(), geometry.key_bounds()
        low, high = self._distance(q_hi, k_lo), self._distance(q_lo, k_hi)  # the tile's distances span [low, high]
        some = torch.ones_like(low, dtype=torch.bool)
        every = torch.ones_like(low, dtype=torch.bool)
        if self.left is not None:
            some, every = some & (high >= -self.left), every & (low >= -self.left)
        if self.right is not None:
            some, every = some & (low <= self.right), every & (high <= self.right)
        return some, every

    def __repr__(self):
        if self.left is None and self.right == 0:
            return f"causal({self.alignment!r})"
        return f"sliding_window({self.left}, {self.right}, {self.alignment!r})"


def causal(alignment="top_left") -> MaskMod:
    """Query i sees key j iff j <= i + offset: offset 0 ("top_left", SDPA's is_causal), L_k - L_q
    ("bottom_right", flash-attn's) or an int."""
    return _Band(None, 0, alignment)


def sliding_window(left=None, right=None, alignment="top_left") -> MaskMod:
    """Query i sees key j iff -left <= j - (i + offset) <= right (None: unbounded), as `window_size`."""
    return _Band(left, right, alignment)


def _per_token(name: str, ids, dtype_kind: str = "integer") -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name}: expected an {dtype_kind} tensor, got {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"{name}: expected shape (L,) or (B, L), got {tuple(ids.shape)}")
    return ids.long().view(1, -1) if ids.dim() == 1 else ids.long()


def _tile_range(values: torch.Tensor, length: int):
    """Per-tile (min, max) of per-token values (B, L) over tiles of TILE tokens: each (B, N)."""
    pad = (-length) % TILE
    if pad:  # the last tile's missing tokens repeat its last one (they are never visited)
        values = torch.cat([values, values[:, -1:].expand(-1, pad)], dim=1)
    tiles = values.view(values.shape[0], -1, TILE)
    return tiles.amin(dim=2), tiles.amax(dim=2)


class _Groups(MaskMod):
    """Query and key see each other iff their group ids are equal (documents, chunks)."""

    def __init__(self, q_ids: torch.Tensor, kv_ids: torch.Tensor):
        self.q_ids, self.kv_ids = q_ids, kv_ids

    def __call__(self, b, h, q_idx, kv_idx):
        return self._ids(self.q_ids, b, q_idx) == self._ids(self.kv_ids, b, kv_idx)

    @staticmethod
    def _ids(ids, b, idx):
        rows = ids.shape[0]
        batch_index = torch.zeros_like(b) if rows == 1 else b
        return ids[batch_index, idx]

    def tile_states(self, geometry):
        q_min, q_max = _tile_range(self.q_ids, geometry.len_q)
        k_min, k_max = _tile_range(self.kv_ids, geometry.len_k)
        return _same_group((q_min[:, None, :, None], q_max[:, None, :, None]),
                           (k_min[:, None, None, :], k_max[:, None, None, :]))


def _same_group(query_groups, key_groups):
    """(some, every) of "the query's group is the key's" for tiles whose queries' groups span query_groups
    (min, max) and keys' key_groups: some pair may match where the spans meet, all do where both are one group."""
    (q_min, q_max), (k_min, k_max) = query_groups, key_groups
    some = (q_min <= k_max) & (k_min <= q_max)
    every = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
    return some, every


class _Documents(_Groups):
    def __repr__(self):
        return f"documents(<{tuple(self.q_ids.shape)} ids>)"


def documents(doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor | None = None) -> MaskMod:
    """Query i sees key j iff they belong to the same document: `doc_ids` (L,) or (B, L) integers per token
    (sequences packed without cu_seqlens); `kv_doc_ids` the keys' when they differ from the queries'.
    Combine with `causal()` for causal documents."""
    q_ids = _per_token("doc_ids", doc_ids)
    kv_ids = q_ids if kv_doc_ids is None else _per_token("kv_doc_ids", kv_doc_ids)
    if kv_ids.device != q_ids.device:
        raise ValueError(f"kv_doc_ids: expected device {q_ids.device} (as doc_ids), got {kv_ids.device}")
    return _Documents(q_ids, kv_ids)


class _Chunks(MaskMod):
    def __init__(self, chunk_size: int):
        if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
        self.chunk_size = int(chunk_size)

    def __call__(self, b, h, q_idx, kv_idx):
        return q_idx // self.chunk_size == kv_idx // self.chunk_size

    def tile_states(self, geometry):
        (q_lo, q_hi), (k_lo, k_hi) = geometry.query_bounds(), geometry.key_bounds()
        size = self.chunk_size  # chunk numbers grow with the index: a tile's span is that of its ends
        return _same_group((q_lo // size, q_hi // size), (k_lo // size, k_hi // size))

    def __repr__(self):
        return f"chunks({self.chunk_size})"


def chunks(chunk_size: int) -> MaskMod:
    """Query i sees key j iff i // chunk_size == j // chunk_size (Llama 4's `attention_chunk_size`, combined
    with `causal()` there)."""
    return _Chunks(chunk_size)


class _KeyPrefix(MaskMod):
    """Every query sees the keys j < prefix[b]."""

    def __init__(self, lengths: torch.Tensor):
        self.lengths = lengths

    def _length(self, b):
        return self.lengths[torch.zeros_like(b) if self.lengths.shape[0] == 1 else b]

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < self._length(b)

    def tile_states(self, geometry):
        k_lo, k_hi = geometry.key_bounds()
        length = self.lengths.view(-1, 1, 1, 1)
        return k_lo < length, k_hi < length

    def __repr__(self):
        return f"prefix(<{tuple(self.lengths.shape)} lengths>)"


def prefix_lm(prefix_lengths) -> MaskMod:
    """Prefix-LM: the keys of each row's prefix are seen by every query (bidirectional), the rest causally.
    `prefix_lengths`: an int, or (B,) integers per batch row."""
    if isinstance(prefix_lengths, numbers.Integral) and not isinstance(prefix_lengths, bool):
        lengths = torch.tensor([int(prefix_lengths)])
    else:
        lengths = _per_token("prefix_lengths", prefix_lengths).view(-1)
    if bool((lengths < 0).any()):
        raise ValueError(f"prefix_lengths: expected lengths >= 0, got {lengths.tolist()}")
    return _KeyPrefix(lengths) | causal()


class _KeptKeys(MaskMod):
    """Every query sees key j of row b iff kept[b, j]."""

    def __init__(self, kept: torch.Tensor):
        self.kept = kept

    def __call__(self, b, h, q_idx, kv_idx):
        return self.kept[torch.zeros_like(b) if self.kept.shape[0] == 1 else b, kv_idx]

    def tile_states(self, geometry):
        lowest, highest = _tile_range(self.kept.to(torch.int32), geometry.len_k)
        return highest[:, None, None, :] == 1, lowest[:, None, None, :] == 1

    def __repr__(self):
        return f"kept_keys(<{tuple(self.kept.shape)}>)"


def kept_keys(kept: torch.Tensor) -> MaskMod:
    """Key padding as a mask: every query sees key j of batch row b iff kept[b, j]. `kept`: bool or integer
    (nonzero = kept), (L_k,) or (B, L_k); True marks a real token, as transformers' attention_mask (the
    opposite of `key_padding_mask`). Key tiles all padding are empty, so they are never visited."""
    if isinstance(kept, torch.Tensor) and kept.dtype == torch.bool:
        kept = kept.to(torch.uint8)
    return _KeptKeys(_per_token("kept", kept, "integer or bool") != 0)


def _pack_bits(seen: torch.Tensor) -> torch.Tensor:
    """(…, TILE, TILE) bool -> (…, TILE, WORDS) int32: bit j % 32 of word j // 32 is pair j."""
    packed = np.packbits(seen.cpu().numpy(), axis=-1, bitorder="little")  # (…, TILE / 8) bytes
    return torch.from_numpy(packed.view(np.dtype("<i4"))).to(seen.device)


@dataclasses.dataclass(frozen=True, eq=False)
class MaskProgram:
    """A mask as the kernels read it (csrc/block_mask.h): `tiles` int32 (B or 1, H or 1, ⌈L_q/TILE⌉,
    ⌈L_k/TILE⌉), EMPTY, FULL or the index of a partial tile in `bits`, int32 (P, TILE, WORDS).
    Pass it as `attn_mask=` to `attention` (and the functions built on it); build it with `mask_program`."""

    tiles: torch.Tensor
    bits: torch.Tensor
    len_q: int
    len_k: int
    mask_mod: MaskMod
    # The causal or sliding-window part of the mask, (left, right, offset) with -1 unbounded, when it is
    # left to the kernels' own band (the call's window) rather than to the tiles' bits; None otherwise.
    band: tuple[int, int, int] | None = None

    @property
    def batch(self) -> int:
        return self.tiles.shape[0]

    @property
    def heads(self) -> int:
        return self.tiles.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tiles.device

    @property
    def nbytes(self) -> int:
        """The program's memory: its tile states and its partial tiles' bits."""
        return self.tiles.numel() * self.tiles.element_size() + self.bits.numel() * self.bits.element_size()

    def counts(self) -> dict[str, int]:
        """How many tiles are empty, full and partial."""
        return {"empty": int((self.tiles == EMPTY).sum()), "full": int((self.tiles == FULL).sum()),
                "partial": int((self.tiles >= 0).sum())}

    def to(self, device) -> "MaskProgram":
        return dataclasses.replace(self, tiles=self.tiles.to(device), bits=self.bits.to(device))

    def without_band(self) -> "MaskProgram":
        """The same mask with its band in the tiles' bits (for a call whose own diagonal differs), built once."""
        if self.band is None:
            return self
        cached = _UNBANDED.get(self)
        if cached is None:
            cached = _UNBANDED[self] = mask_program(self.mask_mod, None if self.batch == 1 else self.batch,
                                                    None if self.heads == 1 else self.heads, self.len_q,
                                                    self.len_k, self.device, factor_band=False)
        return cached

    def for_call(self, batch: int, heads: int, len_q: int, len_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(tiles viewed as (B, H_q, NQ, NK), bits) for a call of this shape, or a ValueError naming attn_mask."""
        if (len_q, len_k) != (self.len_q, self.len_k):
            raise ValueError(f"attn_mask: a mask program for (L_q, L_k) = ({self.len_q}, {self.len_k}) was given to "
                             f"a call of ({len_q}, {len_k})")
        if self.batch not in (1, batch) or self.heads not in (1, heads):
            raise ValueError(f"attn_mask: a mask program for (B, H) = ({self.batch}, {self.heads}) does not "
                             f"broadcast to the call's (B, H_q) = ({batch}, {heads})")
        if self.device != torch.device(device):
            raise ValueError(f"attn_mask: expected a mask program on {device} (as query), got one on {self.device}; "
                             "move it with .to(device)")
        return self.tiles.expand(batch, heads, -1, -1), self.bits

    def for_sequences(self, batch: int, heads: int, lengths_q: list[int], lengths_k: list[int], device):
        """(tiles viewed as (B, H_q, NQ, NK), bits) for a packed batch of sequences (fused_attn.varlen): sequence
        b reads row b of the program (or its only one) at its own positions, so the program's lengths must
        cover every sequence's."""
        longest_q, longest_k = max(lengths_q, default=0), max(lengths_k, default=0)
        if longest_q > self.len_q or longest_k > self.len_k:
            raise ValueError(f"attn_mask: a mask program for (L_q, L_k) = ({self.len_q}, {self.len_k}) does not "
                             f"cover the longest sequences, ({longest_q}, {longest_k})")
        return self.for_call(batch, heads, self.len_q, self.len_k, device)

    def dense(self) -> torch.Tensor:
        """The mask the program stands for, bool (B or 1, H or 1, L_q, L_k): for the reference and the
        tests (this is the L_q × L_k tensor the kernels never make)."""
        seen = dense_of(self.tiles, self.bits, self.len_q, self.len_k)
        if self.band is not None:
            left, right, offset = self.band
            distance = (torch.arange(self.len_k, device=self.device)[None, :]
                        - torch.arange(self.len_q, device=self.device)[:, None] - offset)
            seen = seen & (distance >= -left if left >= 0 else True) & (distance <= right if right >= 0 else True)
        return seen


def dense_of(tiles: torch.Tensor, bits: torch.Tensor, len_q: int, len_k: int) -> torch.Tensor:
    """The bool (…, L_q, L_k) mask of program tiles (…, NQ, NK) and their bits (P, TILE, WORDS)."""
    rows = torch.arange(len_q, device=tiles.device)
    cols = torch.arange(len_k, device=tiles.device)
    state = tiles[..., rows[:, None] // TILE, cols[None, :] // TILE]
    if bits.shape[0] == 0:
        return state == FULL
    words = bits[state.clamp(min=0), rows[:, None] % TILE, (cols[None, :] % TILE) // 32]
    bit = (words >> (cols[None, :] % 32)) & 1
    return (state == FULL) | ((state >= 0) & (bit == 1))


_UNBANDED: "weakref.WeakKeyDictionary[MaskProgram, MaskProgram]" = weakref.WeakKeyDictionary()


def _inside_words(part: torch.Tensor, len_q: int, len_k: int) -> torch.Tensor:
    """The bits of the pairs inside the lengths of tiles `part` (n, 4) = (b, h, q tile, k tile): (n, TILE, WORDS)
    int32, as _pack_bits lays them out (all ones but in the tiles the lengths cut)."""
    offsets = torch.arange(TILE, device=part.device)
    rows = (part[:, 2:3] * TILE + offsets) < len_q  # (n, TILE)
    keys = (part[:, 3:4] * TILE + torch.arange(0, TILE, 32, device=part.device)).clamp(max=len_k)
    counts = (len_k - keys).clamp(0, 32)  # (n, WORDS): the keys of each word before len_k, its low bits
    words = torch.where(counts == 32, -1, (torch.ones_like(counts) << counts) - 1).to(torch.int32)
    return torch.where(rows[:, :, None], words[:, None, :], 0)


def _evaluate_tiles(mask_mod: MaskMod, where: torch.Tensor, len_q: int, len_k: int):
    """The tiles at `where` (n, 4) = (b, h, q tile, k tile) indices, evaluated pair by pair: (bits (n, TILE, WORDS)
    int32 with the pairs past the lengths 0, some (n,) bool: a pair is seen, every (n,) bool: all are)."""
    device = where.device
    offsets = torch.arange(TILE, device=device)
    lengths_cut_tiles = len_q % TILE != 0 or len_k % TILE != 0
    bits, some, every = [], [], []
    for start in range(0, where.shape[0], TILES_PER_BATCH):
        part = where[start:start + TILES_PER_BATCH]
        b, h = part[:, 0].view(-1, 1, 1), part[:, 1].view(-1, 1, 1)
        q = ((part[:, 2] * TILE).view(-1, 1, 1) + offsets.view(1, TILE, 1)).clamp(max=len_q - 1)
        kv = ((part[:, 3] * TILE).view(-1, 1, 1) + offsets.view(1, 1, TILE)).clamp(max=len_k - 1)
        seen = torch.as_tensor(mask_mod(b, h, q, kv), device=device).expand(part.shape[0], TILE, TILE)
        # Seen and every pair seen are read from the packed words (32 pairs a word), the lengths applied there
        # where they cut a tile.
        words = _pack_bits(seen)
        inside = -1  # all 32 pairs of each word, where no length cuts the tiles
        if lengths_cut_tiles:
            inside = _inside_words(part, len_q, len_k)
            words &= inside
        bits.append(words)
        some.append((words != 0).flatten(1).any(dim=1))
        every.append((words == inside).flatten(1).all(dim=1))
    if not bits:
        return (torch.zeros((0, TILE, WORDS), dtype=torch.int32, device=device),
                torch.zeros(0, dtype=torch.bool, device=device), torch.zeros(0, dtype=torch.bool, device=device))
    return torch.cat(bits), torch.cat(some), torch.cat(every)


def _finish(mask_mod, states: torch.Tensor, evaluated, len_q: int, len_k: int, band=None) -> MaskProgram:
    """The program of tile `states` (B, H, NQ, NK) int32 with PENDING marking the tiles `evaluated` describes
    (`_evaluate_tiles` of them in the order of their nonzero() indices): those none of whose pairs are seen
    become EMPTY, those all of whose pairs are FULL, and the rest partial tiles with consecutive indices."""
    bits, some, every = evaluated
    where = (states == PENDING).nonzero()
    if where.shape[0]:
        partial = some & ~every
        index = torch.cumsum(partial.to(torch.int64), 0) - 1
        value = torch.where(~some, EMPTY, torch.where(every, FULL, index)).to(torch.int32)
        states = states.clone()
        states[where[:, 0], where[:, 1], where[:, 2], where[:, 3]] = value
        bits = bits[partial].contiguous()
    return MaskProgram(states, bits, len_q, len_k, mask_mod, band)


def _check_length(name, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


def _factors(mask_mod: MaskMod) -> list[MaskMod]:
    """The masks whose `&` is mask_mod, at its top level."""
    if isinstance(mask_mod, _Both):
        return _factors(mask_mod.first) + _factors(mask_mod.second)
    return [mask_mod]


def _split_band(mask_mod: MaskMod):
    """(band (left, right, offset) with -1 unbounded, the other factors' `&`) when mask_mod is a band `&` other
    masks, else (None, mask_mod). Several bands of one diagonal intersect; of different diagonals, none splits."""
    factors = _factors(mask_mod)
    bands = [f for f in factors if isinstance(f, _Band)]
    rest = [f for f in factors if not isinstance(f, _Band)]
    if not bands or len({band.offset for band in bands}) != 1:
        return None, mask_mod

    def tightest(bounds):
        bounded = [bound for bound in bounds if bound is not None]
        return min(bounded) if bounded else -1

    band = (tightest(b.left for b in bands), tightest(b.right for b in bands), bands[0].offset)
    other = rest[0] if rest else _EVERYTHING
    for factor in rest[1:]:
        other = _Both(other, factor)
    return band, other


class _Everything(MaskMod):
    """Every key seen (what is left of a mask that is a band alone)."""

    def __call__(self, b, h, q_idx, kv_idx):
        return torch.ones(torch.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=torch.bool, device=q_idx.device)

    def tile_states(self, geometry):
        return torch.ones((), dtype=torch.bool), torch.ones((), dtype=torch.bool)


_EVERYTHING = _Everything()


def mask_program(mask, batch=None, heads=None, len_q=None, len_k=None, device=None, *,
                 factor_band: bool = True) -> MaskProgram:
    """Builds the program of `mask` (a fused_attn.masks mask, or any FlexAttention mask_mod) for calls of
    (B, H_q, L_q, L_k) = (batch, heads, len_q, len_k); batch / heads None: the same for every batch row /
    head (the mask_mod then sees b = 0 / h = 0). `len_k` defaults to `len_q`; `device` to that of the
    mask's tensors, else the CPU.

    A `causal()` or `sliding_window()` combined by `&` with the rest (documents & causal, chunks & causal) is
    left to the kernels' own band, computed from the indices (the call then runs with that window), and the
    tiles' bits hold the rest: a tile the band cuts costs what the band keeps of it. `factor_band=False` keeps
    everything in the bits."""
    mask_mod = _as_mask_mod(mask)
    if len_q is None:
        raise ValueError("len_q: expected the number of queries the program is for")
    len_q = _check_length("len_q", len_q)
    len_k = len_q if len_k is None else _check_length("len_k", len_k)
    programs_batch = 1 if batch is None else _check_length("batch", batch)
    programs_heads = 1 if heads is None else _check_length("heads", heads)
    device = torch.device(device) if device is not None else _device_of(mask_mod)
    mask_mod = mask_mod.resolved(len_q, len_k)
    nq, nk = -(-len_q // TILE), -(-len_k // TILE)
    shape = (programs_batch, programs_heads, nq, nk)
    if len_q == 0 or len_k == 0:
        return MaskProgram(torch.full(shape, EMPTY, dtype=torch.int32, device=device),
                           torch.zeros((0, TILE, WORDS), dtype=torch.int32, device=device), len_q, len_k, mask_mod)
    band, bits_mod = _split_band(mask_mod) if factor_band else (None, mask_mod)
    geometry = TileGeometry(len_q, len_k, device, programs_batch, programs_heads)
    structure = bits_mod.tile_states(geometry)
    if structure is not None and band is not None:
        # A tile is empty where the whole mask sees nothing, full where the bits' part sees everything.
        whole = mask_mod.tile_states(geometry)
        structure = (whole[0] & structure[0], structure[1])
    if structure is not None:
        # Index masks give (NQ, NK) states, per-row ones (B, H, NQ, NK): read the batch and heads as 4-D.
        structure = [state[(None,) * (4 - state.dim())] for state in structure]
        for name, size, held in (("batch", programs_batch, structure[0].shape[0]),
                                 ("heads", programs_heads, structure[0].shape[1])):
            if held not in (1, size):
                raise ValueError(f"{name}: the mask holds {held} rows of its own; pass {name}={held}")
        some, every = (torch.as_tensor(t, device=device).expand(shape) for t in structure)
        states = torch.where(~some, EMPTY, torch.where(every, FULL, PENDING)).to(torch.int32)
        evaluated = _evaluate_tiles(bits_mod, (states == PENDING).nonzero(), len_q, len_k)
        return _finish(mask_mod, states, evaluated, len_q, len_k, band)
    return _evaluated_program(mask_mod, shape, len_q, len_k, device)


def _slice_counts(mask_mod, b, h, q, keys, len_q: int, len_k: int) -> torch.Tensor:
    """How many pairs of each tile of a slice of rows the mask sees: q (R, 1) and keys (1, NK · TILE) indices, past
    the lengths where the slice overhangs them (counted as unseen): (R / TILE, NK) int32. (torch.compile fuses
    it into one pass, about 3× faster on two threads for a document mask at L = 8192, but would compile a
    mask_mod made anew for each batch, a closure over that batch's tensors, again each time, for seconds.)"""
    inside = (q < len_q) & (keys < len_k)
    seen = torch.as_tensor(mask_mod(b, h, q.clamp(max=len_q - 1), keys.clamp(max=len_k - 1)), device=q.device)
    rows, cols = q.shape[0], keys.shape[1]
    seen = torch.broadcast_to(seen & inside, (rows, cols))
    return seen.reshape(rows // TILE, TILE, cols // TILE, TILE).sum(dim=(1, 3), dtype=torch.int32)


def _evaluated_program(mask_mod, shape, len_q, len_k, device) -> MaskProgram:
    """A plain mask_mod's program: every pair counted, ROWS_PER_SLICE query rows × L_k keys at a time, then the
    bits of the tiles neither empty nor full evaluated."""
    batch, heads, nq, nk = shape
    rows = min(ROWS_PER_SLICE, nq * TILE)
    keys = torch.arange(nk * TILE, device=device).view(1, -1)
    in_range = (torch.arange(nq, device=device) * -TILE + len_q).clamp(0, TILE)[:, None] * \
        (torch.arange(nk, device=device) * -TILE + len_k).clamp(0, TILE)[None, :]
    seen = torch.empty((batch, heads, -(-nq * TILE // rows) * rows // TILE, nk), dtype=torch.int32, device=device)
    for b in range(batch):
        for h in range(heads):
            b_index = torch.tensor(b, device=device).view(1, 1)
            h_index = torch.tensor(h, device=device).view(1, 1)
            for row0 in range(0, nq * TILE, rows):
                q = torch.arange(row0, row0 + rows, device=device).view(-1, 1)
                seen[b, h, row0 // TILE:(row0 + rows) // TILE] = _slice_counts(mask_mod, b_index, h_index, q, keys, len_q,
                                                                               len_k)
    seen = seen[:, :, :nq]
    states = torch.where(seen == 0, EMPTY, torch.where(seen == in_range, FULL, PENDING)).to(torch.int32)
    evaluated = _evaluate_tiles(mask_mod, (states == PENDING).nonzero(), len_q, len_k)
    return _finish(mask_mod, states, evaluated, len_q, len_k)


def _device_of(mask_mod) -> torch.device:
    """The device of the tensors a ready-made mask holds (CPU when it holds none)."""
    stack = [mask_mod]
    while stack:
        mask = stack.pop()
        for value in vars(mask).values():
            if isinstance(value, torch.Tensor):
                return value.device
            if isinstance(value, MaskMod):
                stack.append(value)
    return torch.device("cpu")


# --- FlexAttention's BlockMask ----------------------------------------------------------------------


def _block_map(num_blocks: torch.Tensor, indices: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FlexAttention's ordered blocks (num_blocks (B, H, R), indices (B, H, R, n): row r lists the columns
    indices[..., r, :num_blocks[..., r]]) as a bool map (B, H, rows, cols) of the listed blocks."""
    num_blocks, indices = num_blocks[..., :rows], indices[..., :rows, :].long()
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    listed = listed & (indices >= 0) & (indices < cols)  # a column past L_k holds no key
    blocks = torch.zeros((*indices.shape[:-1], cols + 1), dtype=torch.bool, device=indices.device)
    blocks.scatter_(-1, torch.where(listed, indices, cols), True)  # unlisted entries go to the spare column
    return blocks[..., :cols]


def _blocks_in(blocks: torch.Tensor, rows, cols) -> torch.Tensor:
    """How many blocks of `blocks` (B, H, R, C) are set within rows [rows[0], rows[1]] × columns [cols[0],
    cols[1]] (index tensors (NQ, 1) and (1, NK)): (B, H, NQ, NK), from 2-D prefix sums."""
    sums = torch.nn.functional.pad(blocks.to(torch.int32).cumsum(-2).cumsum(-1), (1, 0, 1, 0))
    (r0, r1), (c0, c1) = rows, cols
    return sums[..., r1 + 1, c1 + 1] - sums[..., r0, c1 + 1] - sums[..., r1 + 1, c0] + sums[..., r0, c0]


class _Blocks(MaskMod):
    """A BlockMask as FlexAttention's kernels read it: a pair is seen iff its block is listed full, or listed
    partial and the mask_mod says so; the pairs of unlisted blocks are never seen."""

    def __init__(self, block_mask, len_q: int, len_k: int):
        self.size_q, self.size_k = block_mask.BLOCK_SIZE
        rows, cols = -(-len_q // self.size_q), -(-len_k // self.size_k)
        if block_mask.kv_num_blocks.shape[-1] < rows:
            raise ValueError(f"attn_mask: a BlockMask of {block_mask.kv_num_blocks.shape[-1]} rows of blocks does "
                             f"not cover its {len_q} queries (blocks of {self.size_q})")
        self.partial = _block_map(block_mask.kv_num_blocks, block_mask.kv_indices, rows, cols)
        self.full = None
        if block_mask.full_kv_num_blocks is not None:
            self.full = _block_map(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols)
        self.mask_mod = block_mask.mask_mod

    @staticmethod
    def _at(blocks, b, h, block_q, block_k):
        b = torch.zeros_like(b) if blocks.shape[0] == 1 else b
        h = torch.zeros_like(h) if blocks.shape[1] == 1 else h
        return blocks[b, h, block_q, block_k]

    def __call__(self, b, h, q_idx, kv_idx):
        block_q, block_k = q_idx // self.size_q, kv_idx // self.size_k
        seen = self._at(self.partial, b, h, block_q, block_k) & self.mask_mod(b, h, q_idx, kv_idx)
        if self.full is not None:
            seen = seen | self._at(self.full, b, h, block_q, block_k)
        return seen

    def tile_states(self, geometry):
        (q_lo, q_hi), (k_lo, k_hi) = geometry.query_bounds(), geometry.key_bounds()
        rows, cols = (q_lo // self.size_q, q_hi // self.size_q), (k_lo // self.size_k, k_hi // self.size_k)
        listed = self.partial if self.full is None else self.partial | self.full
        some = _blocks_in(listed, rows, cols) > 0
        if self.full is None:
            return some, torch.zeros_like(some)
        area = (rows[1] - rows[0] + 1) * (cols[1] - cols[0] + 1)  # the blocks a tile overlaps
        return some, _blocks_in(self.full, rows, cols) == area

    def __repr__(self):
        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        return f"block_mask({name!r}, BLOCK_SIZE={self.size_q, self.size_k})"


# A BlockMask is built once and given to every layer: its program is kept until the BlockMask dies.
_BLOCK_MASK_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _block_mask_parts(block_mask) -> tuple:
    """What a BlockMask's program is made of: its program is made again when any of them is replaced."""
    return (block_mask.mask_mod, block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices, block_mask.seq_lengths, block_mask.BLOCK_SIZE)


def program_of_block_mask(block_mask: BlockMask) -> MaskProgram:
    """The mask program of FlexAttention's BlockMask (`create_block_mask`, `BlockMask.from_kv_blocks`), on its
    device, for calls of (B, H_q, L_q, L_k) = (B, H, *seq_lengths) of its kv_num_blocks (B, H, rows): B or H
    1 is the same for every batch row or head, and the mask_mod sees b = 0 or h = 0 there.

    It means what FlexAttention's kernels compute: unlisted blocks are empty, full blocks
    (`full_kv_num_blocks`) are seen whole, and the mask_mod decides the pairs of the other listed blocks
    (all of them where the BlockMask has no full blocks; a `noop_mask` then sees them whole). (FlexAttention
    in eager mode evaluates the mask_mod on every pair instead; the two agree for a BlockMask that
    `create_block_mask` made.) The block classification is reused: where its BLOCK_SIZE is the program's
    TILE, the mask_mod is evaluated only on the partial blocks. The mask_mod is called on broadcast index
    tensors, as `mask_function` says. The program is made once per BlockMask and kept as long as it lives
    (made again if its mask_mod or block tensors are replaced)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    parts = _block_mask_parts(block_mask)
    cached = _BLOCK_MASK_PROGRAMS.get(block_mask)
    if cached is not None and all(old is new for old, new in zip(cached[0], parts)):
        return cached[1]
    if block_mask.kv_num_blocks.dim() != 3:
        raise ValueError(f"attn_mask: expected a BlockMask of (B, H) rows of blocks, got kv_num_blocks of shape "
                         f"{tuple(block_mask.kv_num_blocks.shape)}")
    len_q, len_k = (int(length) for length in block_mask.seq_lengths)
    batch, heads = block_mask.kv_num_blocks.shape[:2]
    program = mask_program(_Blocks(block_mask, len_q, len_k), batch, heads, len_q, len_k,
                           device=block_mask.kv_num_blocks.device)
    _BLOCK_MASK_PROGRAMS[block_mask] = (parts, program)
    return program


def _ordered_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bool block map (B, H, R, C) as FlexAttention's ordered rows: (num_blocks, indices), int32."""
    as_int = blocks.to(torch.int32)
    columns = torch.argsort(as_int, dim=-1, descending=True, stable=True)  # the listed ones first, in order
    return as_int.sum(-1, dtype=torch.int32), columns.to(torch.int32)


def _band_covers(program: MaskProgram):
    """Where the program's band (if any) keeps every pair of a tile: bool (NQ, NK), or True."""
    if program.band is None:
        return True
    left, right, offset = program.band
    band = _Band(None if left < 0 else left, None if right < 0 else right, offset=offset)
    return band.tile_states(TileGeometry(program.len_q, program.len_k, program.device))[1]


def block_mask_of_program(program: MaskProgram) -> BlockMask:
    """FlexAttention's BlockMask of a mask program, BLOCK_SIZE (TILE, TILE), meaning the same mask: the tiles
    seen whole (full, and not cut by the program's band) as full blocks, the other tiles it visits as the
    blocks of its mask_mod. `program_of_block_mask` gives this program back, not a new one, as long as the
    BlockMask lives: a program so travels where code keeps BlockMasks as they are (transformers hands 4-D
    masks and BlockMasks to every layer untouched)."""
    if not isinstance(program, MaskProgram):
        raise TypeError(f"program: expected a fused_attn.masks.MaskProgram, got {type(program).__name__}")
    full = (program.tiles == FULL) & _band_covers(program)
    block_mask = BlockMask.from_kv_blocks(*_ordered_blocks((program.tiles != EMPTY) & ~full), *_ordered_blocks(full),
                                          BLOCK_SIZE=TILE, mask_mod=program.mask_mod,
                                          seq_lengths=(program.len_q, program.len_k))
    _BLOCK_MASK_PROGRAMS[block_mask] = (_block_mask_parts(block_mask), program)
    return block_mask


def as_program(attn_mask) -> MaskProgram | None:
    """The mask program an attn_mask stands for (itself, or a BlockMask's), or None for anything else."""
    if isinstance(attn_mask, MaskProgram):
        return attn_mask
    if isinstance(attn_mask, BlockMask):
        return program_of_block_mask(attn_mask)
    return None


def with_program(attn_mask, variant, is_causal: bool, query: torch.Tensor, key: torch.Tensor):
    """(attn_mask, variant) of a call: a mask program (or a BlockMask, as its program) given as attn_mask moves
    into the variant (its tiles viewed as (B, H_q, NQ, NK), its band into the call's window); a tensor or None
    stays where it is."""
    program = as_program(attn_mask)
    if program is None:
        return attn_mask, variant  # a tensor or None; anything else is refused by the mask checks
    len_q, len_k = query.shape[2], key.shape[2]
    if program.band is not None:
        banded = _with_band(variant, is_causal, program.band, len_q, len_k)
        if banded is None:
            program = program.without_band()
        else:
            variant = banded
    tiles, bits = program.for_call(query.shape[0], query.shape[1], len_q, len_k, query.device)
    return None, dataclasses.replace(variant, block_tiles=tiles, block_bits=bits)


def with_sequences_program(attn_mask, variant, is_causal: bool, query: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor):
    """`with_program` for a packed batch (fused_attn.varlen): the program's row b is sequence b's, at its own
    positions (the lengths are read on the host). Its band joins the call's window only where it needs no
    diagonal offset (each sequence has its own diagonal); otherwise it stays in the bits."""
    if attn_mask is None:
        return variant
    program = as_program(attn_mask)
    if program is None:
        raise TypeError(f"attn_mask: expected None, a mask program (fused_attn.masks.mask_program) or a BlockMask "
                        f"for a packed batch, got {type(attn_mask).__name__}")
    if program.band is not None:
        banded = _with_band(variant, is_causal, program.band, program.len_q, program.len_k)
        if banded is None or banded.diagonal_shift or banded.bottom_right != variant.bottom_right:
            program = program.without_band()
        else:
            variant = banded
    lengths_q, lengths_k = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    tiles, bits = program.for_sequences(len(lengths_q), query.shape[1], lengths_q, lengths_k, query.device)
    return dataclasses.replace(variant, block_tiles=tiles, block_bits=bits)


def _with_band(variant, is_causal: bool, band, len_q: int, len_k: int):
    """The call's variant with the program's band (left, right, offset) joined to its window, or None when the
    two cannot share one diagonal (the call has a band or ALiBi distances about another one)."""
    left, right, offset = band
    call_left, call_right = variant.bounds(is_causal)
    has_own_diagonal = call_left != -1 or call_right != -1 or variant.alibi_slopes is not None
    if has_own_diagonal and variant.offset(len_q, len_k) != offset:
        return None

    def tighter(a: int, b: int) -> int:
        return b if a == -1 else a if b == -1 else min(a, b)

    window = dict(window_left=tighter(variant.window_left, left), window_right=tighter(variant.window_right, right))
    if has_own_diagonal:
        return dataclasses.replace(variant, **window)
    return dataclasses.replace(variant, bottom_right=False, diagonal_shift=offset, **window)
