"""The Triton kernels of the `triton` backend and the code that launches them.

FlashAttention-2 in structure:

    forward    one program per (query block, batch, query head); online softmax in fp32 over key
               blocks, in base 2 with the scale folded into one multiplier; key blocks outside the
               band (causal, a sliding window, either diagonal alignment) are not visited. Writes the output and the natural log-sum-exp (fp32).
               Dropout zeroes the elements of fused_attn.dropout's stream (`_dropout_bits`) after the
               row sums, and the output is scaled by 1 / (1 - p).
    backward   deterministic, no atomics:
               preprocess  delta = rowsum(dO * O) - grad_lse, one program per query block;
               dK/dV       one program per (key block, batch, key/value head), looping over the query
                           heads of its GQA group in a fixed order and, for each, over query blocks;
                           it also writes dS, a learned additive mask's gradient, where asked;
               dQ          one program per query block, looping over key blocks.

Packed batches (fused_attn.varlen, VARLEN): the tensors arrive as (B, H, total, D) views with a batch
stride of 0; each program reads its sequence's bounds from the cumulative lengths (`_packed_sequence`)
and the grid is made for the longest sequence, so one launch per kernel serves the whole batch.
Calls with few query rows take the split-KV kernels of `triton_decode` instead of the forward here.

Paged key/value caches (fused_attn.kvcache; PAGED, the forward and the decode kernels): key j of batch row b
is row j % block_size of block block_table[b, j // block_size] (`_key_offsets`). An 8-bit cache (fused_attn.quantization; KV8) is read in place: each K and V tile
is converted where it is loaded, exactly, into the query's dtype (`_cache_values`), and the scales apply in
registers. A key's scale multiplies its column of scores, (q . k8) * scale: per stored key (TOKEN_SCALES) a
vector loaded through the same lookup as the keys (`_token_scales`), per sequence folded into the score
scale once per program. Per stored key, the V tile is dequantized (each row times its scale, rounded once
into the query's dtype: the values the dequantized cache holds; scaling P instead could push its products
below fp16's normal range); per sequence, the accumulator is scaled once after the key loop
(`_value_scaled`). Nothing dequantized is written back.

float8_e4m3fn and Triton: a torch.float8_e4m3fn tensor is a pointer to tl.float8e4nv ("*fp8e4nv"), which
Triton's NVIDIA backend supports from sm_89 on only; for sm_80 it refuses to compile a kernel that takes
one ("type fp8e4nv not supported in this architecture": no emulation; so Triton 3.7.1 and 3.9.0). There
the kernels read the bits (a uint8 view, `cache_blocks`) and convert them with integer operations; from
sm_89 on Triton converts the type itself (`reads_fp8_type`). The interpreter stores fp8 as uint8 and
converts it in NumPy; it runs the bits' conversion, the one sm_80 runs.

The score variants of fused_attn.scores are constexpr switches: BANDED (query i sees keys
i + DIAG - LEFT .. i + DIAG + RIGHT; causal is RIGHT = 0; a side without a bound gets L_Q + L_K,
which no index pair reaches), SOFTCAP and HAS_ALIBI, applied by `_variant_scores` and `_in_band`
in every kernel alike. Attention sinks (HAS_SINKS, the forward kernels only) enter where a row's
log-sum-exp is finalised (`_fold_sink`): one exp per row, the key loop unchanged. The backward needs no
switch for them: it recomputes the weights from the log-sum-exp the forward returned, which holds the
sink (the sinks' own gradient is fused_attn.scores.sink_gradient, in Python).

A mask program (fused_attn.masks; HAS_PROGRAM, the long-query kernels) says per tile of TILE × TILE
(query rows × keys) whether it is empty, full or partial (csrc/block_mask.h). A block of the kernels lies
inside one tile (BLOCK_M and BLOCK_N are powers of two up to TILE, and every loop visits blocks that start
at multiples of their size). With a program, the key loop (dK/dV: the query loop) runs over the tiles of
the block's row (column) of the program, one load of a tile's state (`_program_tile`) deciding it: an empty
tile is skipped whole (no K/V loads, no products); the blocks of the others run in an inner loop with no
branch around its loads, so that Triton still pipelines them (a branch there would keep them out of the
multi-buffered pipeline); a full tile costs nothing per score, and only a partial one reads its bits
(`_program_visible`). What the program hides adds to the band, masks and padding.

Every tensor is read and written through its own strides: the slices of a packed projection, permuted
views, a mask viewed as (B, H_q, L_q, L_k) with stride-0 broadcast dimensions, the output written into
the merged (B, L, H * D) layout. Nothing is made contiguous. Head dimensions are padded to a power of
two of at least 16 inside the kernels (with load/store masks), lengths need not be block multiples.
Offsets are computed in int64, so no tensor or mask size can overflow them.

Tensor descriptors (DESCRIPTORS; `tl.make_tensor_descriptor`, TMA on sm_90 and later): a variant of the forward
kernel that reads Q, K and V and writes O, and of the backward's dK/dV and dQ kernels that read Q, K, V and dO and
write dK, dV and dQ, through descriptors of each (batch row, head)'s (L, D) matrix, made on the device
(`_rows_descriptor`), instead of pointer tiles; everything else, scores, masks, padding, dropout, sinks, mask
programs, the log-sum-exp, delta and a learned bias's gradient, is the same code and goes through pointers. TMA
zero-fills rows and columns past a matrix's end, as the pointer loads' masks do; key padding, which a descriptor
cannot skip, is zeroed after the load (`_descriptor_rows`). WARP_SPECIALIZE adds Triton's automatic warp
specialization of each kernel's loop: the forward's and dQ's over keys, dK/dV's over queries. The variant is an
extra autotuning candidate on devices of DESCRIPTOR_CAPABILITY, beside the pointer configs, never the only one, for
calls whose layouts TMA can read and that it serves (`descriptor_refusals`: a paged cache and packed batches keep
pointers; the backward's two kernels take it together, when every tensor of both allows); if Triton cannot compile it, the kernels go back to pointers for the
process. FUSED_ATTN_TRITON_DESCRIPTORS=1 runs it wherever it serves a call (the interpreter's tests), =0 never
(`descriptor_mode`). It is offered from Triton 3.7 on, its warp-specialized form from 3.9 on (the releases where
the static report compiles them without spills; triton_compat). Descriptors made on the device take global
scratch memory, 128 bytes each per program, which triton_compat.scratch_allocator gives from torch's allocator.
They have not run on a GPU here: the interpreter checks them and the static report compiles them for sm_90 and
sm_100 (bench/triton_report.py).

Precision of fp32 inputs on a GPU: the two matrix products per tile follow
`torch.backends.cuda.matmul.allow_tf32`, as `torch.matmul` does for PyTorch users: TF32 tensor cores
("tf32") when it is True, full fp32 products ("ieee") when it is False, which is PyTorch's default.
fp16 and bf16 operands always use tensor cores with fp32 accumulation; the probabilities and dS are
rounded to the input dtype before their products, as in FlashAttention. Triton's interpreter ignores
the precision and computes fp32 products exactly.

Configs (tile sizes, warps, stages): a default per kernel, GPU generation (sm_80 / sm_90 tables), dtype
size and head dim, each verified by ahead-of-time compilation (bench/triton_report.py). On a GPU the
kernels are autotuned over the defaults and their neighbours, keyed on the lengths, group size, head
dims, dtypes and features (AUTOTUNE_KEY), pruned to the configs whose shared memory fits the device
and, with a mask program, whose blocks fit its tiles (FUSED_ATTN_TRITON_AUTOTUNE=0 uses the defaults).
Under the interpreter the default config runs directly: no autotuning.

This module is imported lazily, on the first launch, so that `triton.jit` sees TRITON_INTERPRET as the
caller (the test configuration) has set it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os

import torch
import triton
import triton.language as tl

from .. import masks
from ..scores import PLAIN, UNBOUNDED
from . import triton_compat, triton_tuning

logger = logging.getLogger("fused_attn")
LOG2E = math.log2(math.e)
# A mask program's layout, as the kernels read it (fused_attn.masks, csrc/block_mask.h).
PROGRAM_TILE = tl.constexpr(masks.TILE)
PROGRAM_WORDS = tl.constexpr(masks.WORDS)
PROGRAM_EMPTY = tl.constexpr(masks.EMPTY)
PROGRAM_FULL = tl.constexpr(masks.FULL)


# ---------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 counters (c0, c1, c2, c3) of any shape, key (k0, k1)."""
    for _ in tl.static_range(10):
        high_0 = tl.umulhi(c0, 0xD2511F53)
        high_1 = tl.umulhi(c2, 0xCD9E8D57)
        low_0 = c0 * 0xD2511F53
        low_1 = c2 * 0xCD9E8D57
        c0 = high_1 ^ c1 ^ k0
        c2 = high_0 ^ c3 ^ k1
        c1 = low_1
        c3 = low_0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _dropout_bits(RNG, batch_head, sequence, offs_m, start_n, BLOCK_N: tl.constexpr):
    """The 32-bit random integers of a (query rows `offs_m`, keys start_n .. start_n + BLOCK_N) tile,
    uint32 [len(offs_m), BLOCK_N]: the formula of fused_attn.dropout (Philox4x32-10 on counter
    (J // 4, I, batch_head, offset + sequence), key = seed, output J % 4, with I and J the stream's
    positions, query_start + i and key_start + j; see `_dropout_stream`). `start_n` is a multiple of 4.
    One Philox block serves four keys, so the rounds run on a quarter of the tile; when key_start is not
    a multiple of 4 (a block of a longer sequence, as ring attention's), on two quarters, each quad of
    keys taking lanes of two neighbouring blocks."""
    seed = tl.load(RNG)
    offset = (tl.load(RNG + 1) + sequence) & 0xFFFFFFFF
    rows = offs_m + tl.load(RNG + 2)
    first = start_n + tl.load(RNG + 3)  # the stream's position of key start_n
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    # Quad q of the tile holds keys 4q .. 4q + 3 of it, which are lanes shift .. 3 of the stream's quad
    # `base + q` and lanes 0 .. shift - 1 of the next one (shift 0 when key_start is a multiple of 4).
    shift = first % 4
    base = first // 4 + tl.arange(0, BLOCK_N // 4)
    zero = (rows[:, None] * 0 + base[None, :] * 0).to(tl.uint32)
    counters = (zero + rows[:, None].to(tl.uint32), zero + batch_head.to(tl.uint32), zero + offset.to(tl.uint32))
    c0, c1, c2, c3 = _philox4x32_10(zero + base[None, :].to(tl.uint32), *counters, k0, k1)
    if shift != 0:
        # What this quad's block gives first, so that only three of its lanes stay live while the next
        # block's rounds run (register pressure).
        c0 = tl.where(shift == 1, c1, tl.where(shift == 2, c2, c3))
        c1 = tl.where(shift == 1, c2, c3)
        d0, d1, d2, _ = _philox4x32_10(zero + (base + 1)[None, :].to(tl.uint32), *counters, k0, k1)
        c1 = tl.where(shift == 3, d0, c1)
        c2 = tl.where(shift == 1, c3, tl.where(shift == 2, d0, d1))
        c3 = tl.where(shift == 1, d0, tl.where(shift == 2, d1, d2))
    # join appends a last axis: [rows, quads, a, b] holds output a + 2b of this nesting, so output
    # 2a + b of the quad is at row-major position 4 * quad + 2a + b, the key it belongs to.
    lanes = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(lanes, [rows.shape[0], BLOCK_N])


@triton.jit
def _dropout_stream(off_b, off_h, H_Q, VARLEN: tl.constexpr):
    """(batch_head, sequence) of `_dropout_bits` for batch row off_b, query head off_h: b * H_q + h and 0;
    in a packed batch, sequence b is a one-sequence call with offset + b (fused_attn.varlen)."""
    batch_head = off_b * H_Q + off_h
    sequence = 0
    if VARLEN:  # one return: Triton requires every return of a function to have the same types
        batch_head = off_h
        sequence = off_b
    return batch_head, sequence


@triton.jit
def _packed_sequence(CU_Q, CU_K, off_b, L_Q, L_K, DIAG, VARLEN: tl.constexpr):
    """(first query token, first key token, L_Q, L_K, DIAG) of batch row off_b. In a packed batch
    (VARLEN) the row is sequence off_b of cumulative lengths CU_Q / CU_K: its tokens start there, its
    own lengths replace the bounds L_Q / L_K the grid was made for, and DIAG, 1 for bottom-right
    alignment and 0 for top-left, becomes its own diagonal L_K - L_Q or 0."""
    q_start = 0
    k_start = 0
    if VARLEN:  # one return: Triton requires every return of a function to have the same types
        q_start = tl.load(CU_Q + off_b).to(tl.int64)
        k_start = tl.load(CU_K + off_b).to(tl.int64)
        L_Q = (tl.load(CU_Q + off_b + 1) - q_start).to(tl.int32)
        L_K = (tl.load(CU_K + off_b + 1) - k_start).to(tl.int32)
        DIAG = DIAG * (L_K - L_Q)
    return q_start, k_start, L_Q, L_K, DIAG


@triton.jit
def _key_offsets(PAGES, off_b, offs_n, col_ok, stride_b, stride_n, stride_tb, PAGE_SIZE, PAGED: tl.constexpr):
    """Offsets from K (or V, by its strides) of keys offs_n of batch row off_b: off_b * stride_b + n * stride_n;
    in a paged cache (PAGED), the key's block PAGES[off_b, n // PAGE_SIZE] (table row stride stride_tb)
    times the block stride stride_b, plus its row n % PAGE_SIZE times stride_n."""
    offsets = off_b * stride_b + offs_n.to(tl.int64) * stride_n
    if PAGED:  # one return: Triton requires every return of a function to have the same types
        block = tl.load(PAGES + off_b * stride_tb + offs_n // PAGE_SIZE, mask=col_ok, other=0).to(tl.int64)
        offsets = block * stride_b + (offs_n % PAGE_SIZE).to(tl.int64) * stride_n
    return offsets


@triton.jit
def _cache_values(x, dtype):
    """A tile of K or V as loaded, in `dtype` (the query's), exactly: a tile of that dtype as it is; int8 values;
    float8_e4m3fn values, converted by Triton where the pointer has its fp8 type (sm_89 and later), or, loaded
    as their bits (uint8: sm_80 and the interpreter, `cache_blocks`), the values times 2^-8, which the
    scales undo (`_bits_factor`). e4m3's exponent (bias 7) and mantissa shifted into fp16's (bias 15) give
    2^-8 times the value for normal and subnormal values alike (every one is exact in fp16, bf16 and fp32);
    the magnitude 0x7F is NaN. int8 goes through fp16 too, where it is exact (Triton's interpreter converts int8
    to bf16 as integer bits)."""
    if x.dtype == tl.uint8:
        bits = x.to(tl.int32)
        magnitude = bits & 0x7F
        half = tl.where(magnitude == 0x7F, 0x7E00, (magnitude << 7) | ((bits & 0x80) << 8))
        x = half.to(tl.int16).to(tl.float16, bitcast=True)
    elif x.dtype == tl.int8:
        x = x.to(tl.float16)
    return x.to(dtype)


@triton.jit
def _bits_factor(CACHE):
    """What the scales of a cache read through pointer CACHE are multiplied by: 2^8 for float8_e4m3fn bits,
    whose values `_cache_values` gives times 2^-8; else 1."""
    factor = 1.0
    if CACHE.dtype.element_ty == tl.uint8:
        factor = 256.0
    return factor


@triton.jit
def _token_scales(SCALES, PAGES, off_b, offs_n, load_ok, stride_sb, stride_sn, stride_tb, PAGE_SIZE, factor,
                  PAGED: tl.constexpr):
    """The float32 scales of keys offs_n (0 where not load_ok) times `factor`, from SCALES (one kv head's, in the
    blocks' layout without D: strides stride_sb between blocks, stride_sn between rows), through the same
    lookup as the keys (`_key_offsets`)."""
    rows = _key_offsets(PAGES, off_b, offs_n, load_ok, stride_sb, stride_sn, stride_tb, PAGE_SIZE, PAGED)
    return tl.load(SCALES + rows, mask=load_ok, other=0.0) * factor


@triton.jit
def _dequantized_values(v, dtype, SCALES, PAGES, off_b, offs_n, load_ok, stride_sb, stride_sn, stride_tb, PAGE_SIZE,
                        factor, PAGED: tl.constexpr, TOKEN_SCALES: tl.constexpr):
    """An 8-bit V tile [keys, D] of keys offs_n as `dtype` for P V: with TOKEN_SCALES, each key's values times its
    scale (`_token_scales`) rounded once into `dtype`, as the dequantized cache holds them (a rescaled P
    could fall below fp16's normal range); else the 8-bit values, whose sequence scale the caller applies to the
    accumulator."""
    if TOKEN_SCALES:
        scales = _token_scales(SCALES, PAGES, off_b, offs_n, load_ok, stride_sb, stride_sn, stride_tb, PAGE_SIZE,
                               factor, PAGED)
        v = (_cache_values(v, tl.float32) * scales[:, None]).to(dtype)
    else:
        v = _cache_values(v, dtype)
    return v


@triton.jit
def _value_scaled(acc, l_i, v_scale):
    """The accumulator [rows, D] of P V over an 8-bit V times the sequence's scale, in the rows that saw a key
    (`l_i` != 0, before any sink; NaN where a NaN score was seen): the others keep 0, whatever the scale of a
    sequence without keys holds."""
    return tl.where((l_i != 0.0)[:, None], acc * v_scale, 0.0)


@triton.jit
def _in_band(q_idx, k_idx, DIAG, LEFT, RIGHT):
    """Whether query q_idx sees key k_idx through the band (indices broadcast against each other)."""
    distance = k_idx - (q_idx + DIAG)
    return (distance >= -LEFT) & (distance <= RIGHT)


@triton.jit
def _program_tile(TILES, q_first, k_first, stride_tilem, stride_tilen):
    """The mask program's state of the tile holding query q_first and key k_first (TILES: the states of
    one batch row and query head, (NQ, NK) with these strides)."""
    return tl.load(TILES + (q_first // PROGRAM_TILE) * stride_tilem + (k_first // PROGRAM_TILE) * stride_tilen)


@triton.jit
def _program_bits(BITS, state, q_idx, start_n, BLOCK_N: tl.constexpr):
    """[rows, BLOCK_N] bool: whether queries q_idx ([rows, 1], inside one tile) see keys start_n ..
    start_n + BLOCK_N - 1 (start_n a multiple of BLOCK_N) in the program's partial tile `state`: bit j % 32
    of word (j % TILE) // 32 of row i % TILE of the tile in BITS. The block's keys are the bits of
    cdiv(BLOCK_N, 32) consecutive words of each row (a part of one word when BLOCK_N < 32): those words
    are loaded, one per (row, word), and spread into their bits, never one load per score."""
    row = state.to(tl.int64) * PROGRAM_TILE + q_idx % PROGRAM_TILE
    first_keys = start_n + 32 * tl.arange(0, (BLOCK_N + 31) // 32)  # the block's first key in each of its words
    words = tl.load(BITS + row * PROGRAM_WORDS + ((first_keys % PROGRAM_TILE) // 32)[None, :])
    lanes = (start_n + tl.arange(0, BLOCK_N // ((BLOCK_N + 31) // 32))) % 32
    # [rows, words, lanes] in row-major order is [rows, keys]. Signed words: the arithmetic shift keeps
    # bit 0 the bit asked for.
    bits = (words[:, :, None] >> lanes[None, None, :]) & 1
    return tl.reshape(bits, [q_idx.shape[0], BLOCK_N]) != 0


@triton.jit
def _program_visible(visible, BITS, state, q_idx, start_n, BLOCK_N: tl.constexpr, HAS_PROGRAM: tl.constexpr,
                     KEYS_FIRST: tl.constexpr):
    """`visible` [rows, keys] (KEYS_FIRST: [keys, rows], the dK/dV kernel's tiles) and what the program
    shows of the block in tile `state` (`_program_bits`); a full tile hides nothing and reads nothing."""
    if HAS_PROGRAM:
        if state >= 0:
            sees = _program_bits(BITS, state, q_idx, start_n, BLOCK_N)
            if KEYS_FIRST:
                sees = tl.trans(sees)
            visible = visible & sees
    return visible


@triton.jit
def _masked(s, visible, q_idx, k_idx, q_rows, mask_base, mask_offs, stride_mask, DIAG, LEFT, RIGHT, BITS, state,
            start_n, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr, BANDED: tl.constexpr, HAS_PROGRAM: tl.constexpr,
            KEYS_FIRST: tl.constexpr):
    """(s, visible) of a tile once the band, the mask program and a boolean mask have hidden their keys from
    `visible`, and an additive mask is added to the base-2 scores `s`. `q_idx` and `k_idx` broadcast to the
    tile ([rows, keys]; KEYS_FIRST: [keys, rows], the dK/dV kernel's), `q_rows` are the query indices
    [rows, 1] of the program's bits (`_program_visible`); the mask's elements are at mask_base [tile rows, 1]
    plus the int64 indices mask_offs of the tile's columns times stride_mask."""
    if BANDED:
        visible = visible & _in_band(q_idx, k_idx, DIAG, LEFT, RIGHT)
    visible = _program_visible(visible, BITS, state, q_rows, start_n, BLOCK_N, HAS_PROGRAM, KEYS_FIRST)
    if MASK_KIND == 1:
        attend = tl.load(mask_base + mask_offs[None, :] * stride_mask, mask=visible, other=0)
        visible = visible & (attend != 0)
    if MASK_KIND == 2:
        bias = tl.load(mask_base + mask_offs[None, :] * stride_mask, mask=visible, other=0.0)
        s = s + bias.to(tl.float32) * 1.4426950408889634
    return s, visible


@triton.jit
def _variant_scores(s, q_idx, k_idx, slope2, softcap2, DIAG, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Base-2 scores (scale * log2(e) folded in) capped and with ALiBi added, and the cap's derivative
    1 - tanh² (1 without a cap). `softcap2` and `slope2` are the cap and the slope times log2(e)."""
    cap_grad = 1.0
    if SOFTCAP:
        # tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh).
        t = 2.0 * tl.sigmoid(2.0 * s / softcap2) - 1.0
        s = softcap2 * t
        cap_grad = 1.0 - t * t
    if HAS_ALIBI:
        distance = (q_idx + DIAG - k_idx).to(tl.float32)
        s = s - slope2 * tl.abs(distance)
    return s, cap_grad


@triton.jit
def _span(SPANS, off_b):
    """[first, end) of the keys batch row `off_b`'s padding leaves (SPANS: int32 (B, 2); end <= L_K)."""
    return tl.load(SPANS + 2 * off_b), tl.load(SPANS + 2 * off_b + 1)


@triton.jit
def _within_span(first, end, lo, hi, BLOCK_N: tl.constexpr):
    """Key bounds [lo, hi) narrowed to the span [first, end); lo stays a multiple of BLOCK_N."""
    return tl.maximum(lo, first // BLOCK_N * BLOCK_N), tl.minimum(hi, end)


@triton.jit
def _in_span(offs_n, first, end):
    """Which keys offs_n lie in the span [first, end) (first <= end): the keys whose K and V may be loaded.
    Padding holds whatever its owner left there (an unwritten cache, NaN, inf), and hiding its scores
    does not hide that: 0 * NaN in P V (or in dP = dO V^T, dS K) is NaN."""
    # One unsigned compare (keys before first wrap to large values): the loops that use it sit at the
    # register limit (bench.triton_report), where a second compare per key made ptxas spill.
    return (offs_n - first).to(tl.uint32) < (end - first).to(tl.uint32)


@triton.jit
def _rows_descriptor(base, rows, stride_row, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A tensor descriptor (TMA on sm_90 and later) of the (rows, COLS) matrix at `base`, row stride stride_row and
    unit column stride, read and written in blocks of (BLOCK_ROWS, BLOCK_COLS): a load fills the elements past
    its bounds with 0, a store leaves them out. The caller checked what TMA needs (`descriptor_refusals`): base
    and row stride multiples of 16 bytes."""
    return tl.make_tensor_descriptor(base, shape=[rows, COLS], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def _descriptor_rows(desc, first, load_ok, HAS_KPM: tl.constexpr):
    """The block of rows first, first + 1, .. of descriptor `desc` (`_rows_descriptor`), rows past its end 0; with
    HAS_KPM also the rows outside `load_ok`: a descriptor reads every row of the block, and padding may hold NaN
    (`_in_span`)."""
    block = desc.load([first, 0])
    if HAS_KPM:
        block = tl.where(load_ok[:, None], block, 0.0)
    return block


@triton.jit
def _store_rows(base, block, first, rows, stride_row, stride_col, COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """Writes `block` into rows first, first + 1, .. of the (rows, COLS) matrix at `base`, leaving out what lies past
    its bounds: through a descriptor (`_rows_descriptor`) with DESCRIPTORS, else through pointers."""
    if DESCRIPTORS:
        _rows_descriptor(base, rows, stride_row, COLS, BLOCK_ROWS, BLOCK_COLS).store([first, 0], block)
    else:
        offs = first + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        tl.store(base + offs.to(tl.int64)[:, None] * stride_row + cols[None, :] * stride_col, block,
                 mask=(offs < rows)[:, None] & (cols[None, :] < COLS))


@triton.jit
def _visible_scores(q, k_t, q_idx, offs_n, row_ok, col_ok, mask_base, stride_mn, kpm_base, stride_pn, slope2,
                    softcap2, qk_scale, DIAG, LEFT, RIGHT, BITS, state, start_n, MASK_KIND: tl.constexpr,
                    HAS_KPM: tl.constexpr, BANDED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    HAS_PROGRAM: tl.constexpr, PRECISION: tl.constexpr):
    """The base-2 scores of a (query rows, keys) tile, every variant and mask applied, -inf where a key
    is hidden, and the softcap's derivative (`_variant_scores`). `q_idx` [rows, 1] are the rows' query
    indices, `mask_base` [rows, 1] their mask pointers, `slope2` a scalar or [rows, 1]; `k_t` is
    [D, keys] of keys start_n ..; `state` the mask program's tile holding the block (HAS_PROGRAM), its
    bits in BITS."""
    offs_n64 = offs_n.to(tl.int64)
    # Scores in base-2 units: exp2(s * scale * log2(e)) = exp(s * scale).
    s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
    s, cap_grad = _variant_scores(s, q_idx, offs_n[None, :], slope2, softcap2, DIAG, SOFTCAP, HAS_ALIBI)
    s, visible = _masked(s, col_ok[None, :] & row_ok[:, None], q_idx, offs_n[None, :], q_idx, mask_base, offs_n64,
                         stride_mn, DIAG, LEFT, RIGHT, BITS, state, start_n, offs_n.shape[0], MASK_KIND, BANDED,
                         HAS_PROGRAM, False)
    if HAS_KPM:
        padded = tl.load(kpm_base + offs_n64 * stride_pn, mask=col_ok, other=1)
        visible = visible & (padded == 0)[None, :]
    return tl.where(visible, s, float("-inf")), cap_grad


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One key block of the online softmax: (p, alpha, m_new, l_new) for base-2 scores `s` and the
    running row max `m_i` and sum `l_i`; the accumulator is to be scaled by alpha."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _fold_sink(m_i, l_i, sink2):
    """The sink's logit (base 2: times log2(e), never times the score scale) joins the finished online
    softmax of a row as one more score without a value: (alpha, m, l) with m = max(m_i, sink2),
    l = l_i * alpha + 2^(sink2 - m) and alpha = 2^(m_i - m), by which the accumulator is to be scaled.
    A row that saw no key gets m = sink2, l = 1, alpha = 0; a sink of -inf changes nothing, and with
    both -inf l stays 0 (the row's output 0, lse -inf)."""
    m_new = tl.maximum(m_i, sink2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    return alpha, m_new, l_i * alpha + tl.exp2(sink2 - m_safe)


@triton.jit
def _attn_fwd_keys(m_i, l_i, acc, lo, hi, state, q, k_base, v_base, k_desc, v_desc, PAGES, ks_base, vs_base, off_b,
                   offs_m, offs_dqk, offs_dv, row_ok, mask_base, kpm_base, RNG, drop_bh, drop_sequence, BITS, stride_kb,
                   stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tb, PAGE_SIZE, stride_ksb, stride_ksn,
                   stride_vsb, stride_vsn, stride_mn, stride_pn, L_K, span_first, span_end, qk_scale, drop_threshold,
                   slope2, softcap2, DIAG, LEFT, RIGHT, D_QK: tl.constexpr, D_V: tl.constexpr, MASK_KIND: tl.constexpr,
                   HAS_KPM: tl.constexpr, BANDED: tl.constexpr, HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                   HAS_ALIBI: tl.constexpr, PAGED: tl.constexpr, KV8: tl.constexpr, TOKEN_SCALES: tl.constexpr,
                   HAS_PROGRAM: tl.constexpr, PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's key blocks lo, lo + BLOCK_N, .. below hi (lo a multiple of BLOCK_N), all in the mask
    program's tile `state` (PROGRAM_FULL without a program): the row max, row sum and accumulator after them.
    With HAS_KPM only the keys of the span [span_first, span_end) are read, block table entries included.
    With DESCRIPTORS, K and V are read through the descriptors k_desc and v_desc of the batch row's kv head
    (`_rows_descriptor`; never a paged cache), else through pointers; WARP_SPECIALIZE asks Triton to split the
    loop into warps that load and warps that compute (`tl.range`'s warp_specialize).
    An 8-bit cache (KV8) is dequantized as it is loaded (`_cache_values`); with TOKEN_SCALES the scales of each
    key (ks_base, vs_base: the kv head's) multiply its scores and its values, else the caller folded the
    sequence's into qk_scale and scales the accumulator."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < L_K
        load_ok = col_ok
        if HAS_KPM:  # the scores keep col_ok, the padding mask hides the rest: fewer registers than one mask
            load_ok = _in_span(offs_n, span_first, span_end)
        if DESCRIPTORS:
            k_t = tl.trans(_descriptor_rows(k_desc, start_n, load_ok, HAS_KPM))
        else:
            k_rows = _key_offsets(PAGES, off_b, offs_n, load_ok, stride_kb, stride_kn, stride_tb, PAGE_SIZE, PAGED)
            k_t = tl.load(k_base + k_rows[None, :] + offs_dqk[:, None] * stride_kd,
                          mask=load_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)
        key_scale = qk_scale
        if KV8:  # scores = (q . k8) * scale per key column
            k_t = _cache_values(k_t, q.dtype)
            if TOKEN_SCALES:
                key_scale = qk_scale * _token_scales(ks_base, PAGES, off_b, offs_n, load_ok, stride_ksb, stride_ksn,
                                                     stride_tb, PAGE_SIZE, _bits_factor(k_base), PAGED)[None, :]
        s, _ = _visible_scores(q, k_t, offs_m[:, None], offs_n, row_ok, col_ok, mask_base, stride_mn, kpm_base,
                               stride_pn, slope2, softcap2, key_scale, DIAG, LEFT, RIGHT, BITS, state, start_n,
                               MASK_KIND, HAS_KPM, BANDED, SOFTCAP, HAS_ALIBI, HAS_PROGRAM, PRECISION)
        p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
        if HAS_DROPOUT:
            # The sum above is of the undropped weights; the kept ones are scaled at the end.
            bits = _dropout_bits(RNG, drop_bh, drop_sequence, offs_m, start_n, BLOCK_N)
            p = tl.where(bits.to(tl.int64) >= drop_threshold, p, 0.0)
        if DESCRIPTORS:
            v = _descriptor_rows(v_desc, start_n, load_ok, HAS_KPM)
        else:
            v_rows = _key_offsets(PAGES, off_b, offs_n, load_ok, stride_vb, stride_vn, stride_tb, PAGE_SIZE, PAGED)
            v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd,
                        mask=load_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        if KV8:
            v = _dequantized_values(v, q.dtype, vs_base, PAGES, off_b, offs_n, load_ok, stride_vsb, stride_vsn,
                                    stride_tb, PAGE_SIZE, _bits_factor(v_base), PAGED, TOKEN_SCALES)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, MASK, KPM, SPANS, RNG, ALIBI, CU_Q, CU_K, PAGES, KS, VS, SINKS, TILES, BITS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_pn, stride_ab, stride_ah, stride_tb, PAGE_SIZE,
    stride_ksb, stride_ksn, stride_ksh, stride_vsb, stride_vsn, stride_vsh,
    stride_tileb, stride_tileh, stride_tilem, stride_tilen,
    H_Q, GROUP, L_Q, L_K, qk_scale, drop_threshold, keep_scale, DIAG, LEFT, RIGHT, softcap2,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, BANDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr, PAGED: tl.constexpr,
    KV8: tl.constexpr, TOKEN_SCALES: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_PROGRAM: tl.constexpr,
    PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # With DESCRIPTORS (a config of its own among the autotuner's candidates on sm_90 and later), Q, K and V are read
    # and O is written through tensor descriptors, TMA on the GPU, instead of pointers; every score is computed alike.
    # A flat grid (no 65535 limit on batch x heads); the last query blocks, which see the most keys
    # under a causal mask, are scheduled first.
    num_m = tl.cdiv(L_Q, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = num_m - 1 - pid % num_m
    pid_bh = pid // num_m
    off_b = (pid_bh // H_Q).to(tl.int64)
    off_h = (pid_bh % H_Q).to(tl.int64)
    off_hkv = off_h // GROUP
    q_start, k_start, L_Q, L_K, DIAG = _packed_sequence(CU_Q, CU_K, off_b, L_Q, L_K, DIAG, VARLEN)
    Q += q_start * stride_qm
    O += q_start * stride_om
    LSE += q_start * stride_lm
    K += k_start * stride_kn
    V += k_start * stride_vn
    drop_bh, drop_sequence = _dropout_stream(off_b, off_h, H_Q, VARLEN)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m64 = offs_m.to(tl.int64)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L_Q

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_hkv * stride_kh
    v_base = V + off_hkv * stride_vh
    k_desc = k_base  # the descriptors, with DESCRIPTORS (unused otherwise)
    v_desc = v_base
    if DESCRIPTORS:
        q = _rows_descriptor(q_base, L_Q, stride_qm, D_QK, BLOCK_M, BLOCK_DQK).load([pid_m * BLOCK_M, 0])
        k_desc = _rows_descriptor(k_base + off_b * stride_kb, L_K, stride_kn, D_QK, BLOCK_N, BLOCK_DQK)
        v_desc = _rows_descriptor(v_base + off_b * stride_vb, L_K, stride_vn, D_V, BLOCK_N, BLOCK_DV)
    else:
        q = tl.load(q_base + offs_m64[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                    mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
    mask_base = MASK + off_b * stride_mb + off_h * stride_mh + offs_m64[:, None] * stride_mm
    kpm_base = KPM + off_b * stride_pb
    ks_base = KS + off_hkv * stride_ksh
    vs_base = VS + off_hkv * stride_vsh
    if KV8:
        if not TOKEN_SCALES:  # the sequence's scales: of every score, and of the accumulator at the end
            qk_scale = qk_scale * tl.load(ks_base + off_b * stride_ksb) * _bits_factor(K)
            v_scale = tl.load(vs_base + off_b * stride_vsb) * _bits_factor(V)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * 1.4426950408889634
    lo = 0
    hi = L_K
    if BANDED:
        # Key blocks wholly outside the band of this query block's rows are never visited; the first
        # visited one starts on a multiple of BLOCK_N (dropout's Philox blocks need multiples of 4).
        lo = tl.maximum(0, pid_m * BLOCK_M + DIAG - LEFT) // BLOCK_N * BLOCK_N
        hi = tl.maximum(0, tl.minimum(L_K, (pid_m + 1) * BLOCK_M - 1 + DIAG + RIGHT + 1))
    span_first = 0
    span_end = L_K
    if HAS_KPM:  # keys outside the span the row's padding leaves are never visited
        span_first, span_end = _span(SPANS, off_b)
        lo, hi = _within_span(span_first, span_end, lo, hi, BLOCK_N)
    if VARLEN:  # a query block past its sequence's end (the grid is made for the longest)
        hi = tl.where(pid_m * BLOCK_M < L_Q, hi, lo)
    if HAS_PROGRAM:
        # One scalar test per tile of the program the key range meets skips an empty one; the blocks of the
        # others run in a loop of their own with no branch around their loads, since Triton pipelines the
        # loads of a loop (multi-buffers K and V) only outside any branch. The blocks visited, and their
        # order, are those of one loop over lo .. hi (the same sums, the same dropout bits); each lies inside
        # one tile (BLOCK_N divides TILE, `_fits_program`).
        tiles_base = TILES + off_b * stride_tileb + off_h * stride_tileh
        for tile_n in range(lo // PROGRAM_TILE * PROGRAM_TILE, hi, PROGRAM_TILE):
            state = _program_tile(tiles_base, pid_m * BLOCK_M, tile_n, stride_tilem, stride_tilen)
            if state != PROGRAM_EMPTY:  # an empty tile: no key of it is read
                m_i, l_i, acc = _attn_fwd_keys(
                    m_i, l_i, acc, tl.maximum(lo, tile_n), tl.minimum(hi, tile_n + PROGRAM_TILE), state, q, k_base,
                    v_base, k_desc, v_desc, PAGES, ks_base, vs_base, off_b, offs_m, offs_dqk, offs_dv, row_ok,
                    mask_base, kpm_base, RNG, drop_bh, drop_sequence, BITS, stride_kb, stride_kn, stride_kd, stride_vb,
                    stride_vn, stride_vd, stride_tb, PAGE_SIZE, stride_ksb, stride_ksn, stride_vsb, stride_vsn,
                    stride_mn, stride_pn, L_K, span_first, span_end, qk_scale, drop_threshold, slope2, softcap2, DIAG,
                    LEFT, RIGHT, D_QK, D_V, MASK_KIND, HAS_KPM, BANDED, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, PAGED, KV8,
                    TOKEN_SCALES, HAS_PROGRAM, PRECISION, DESCRIPTORS, WARP_SPECIALIZE, BLOCK_N)
    else:
        m_i, l_i, acc = _attn_fwd_keys(
            m_i, l_i, acc, lo, hi, PROGRAM_FULL, q, k_base, v_base, k_desc, v_desc, PAGES, ks_base, vs_base, off_b,
            offs_m, offs_dqk, offs_dv, row_ok, mask_base, kpm_base, RNG, drop_bh, drop_sequence, BITS, stride_kb,
            stride_kn, stride_kd, stride_vb, stride_vn, stride_vd, stride_tb, PAGE_SIZE, stride_ksb, stride_ksn,
            stride_vsb, stride_vsn, stride_mn, stride_pn, L_K, span_first, span_end, qk_scale, drop_threshold, slope2,
            softcap2, DIAG, LEFT, RIGHT, D_QK, D_V, MASK_KIND, HAS_KPM, BANDED, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, PAGED,
            KV8, TOKEN_SCALES, HAS_PROGRAM, PRECISION, DESCRIPTORS, WARP_SPECIALIZE, BLOCK_N)

    if KV8:
        if not TOKEN_SCALES:
            acc = _value_scaled(acc, l_i, v_scale)
    if HAS_SINKS:  # the head's sink joins each row's softmax here, once (fused_attn.scores)
        sink = tl.load(SINKS + off_h)
        no_key = l_i == 0.0
        alpha, m_i, l_i = _fold_sink(m_i, l_i, sink * 1.4426950408889634)
        acc = acc * alpha[:, None]
    # A row with no visible key: output 0, log-sum-exp -inf (with a sink: 0 and the sink's logit). A NaN score makes
    # l_i NaN (the GPU's maximum passes over NaN, the interpreter's carries it; the exp makes NaN either way): the
    # row's output and lse are NaN, as SDPA's.
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * keep_scale
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if HAS_SINKS:  # the sink alone: its logit exactly, not through base 2
        lse = tl.where(no_key, sink, lse)
    _store_rows(O + off_b * stride_ob + off_h * stride_oh, out.to(O.dtype.element_ty), pid_m * BLOCK_M, L_Q, stride_om,
                stride_od, D_V, BLOCK_M, BLOCK_DV, DESCRIPTORS)
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + offs_m64 * stride_lm, lse, mask=row_ok)


@triton.jit
def _attn_bwd_preprocess(
    O, DO, GRAD_LSE, DELTA, CU_Q,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm, stride_db, stride_dh,
    H_Q, L_Q,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) - grad_lse, fp32, stored (B, H_q, L_q) with strides (stride_db,
    stride_dh, 1) (packed: (H_q, total_q) with a batch stride of 0)."""
    num_m = tl.cdiv(L_Q, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_m
    pid_bh = pid // num_m
    off_b = (pid_bh // H_Q).to(tl.int64)
    off_h = (pid_bh % H_Q).to(tl.int64)
    q_start, _, L_Q, _, _ = _packed_sequence(CU_Q, CU_Q, off_b, L_Q, 0, 0, VARLEN)
    O += q_start * stride_om
    DO += q_start * stride_gm
    GRAD_LSE += q_start * stride_lm
    DELTA += q_start
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m64 = offs_m.to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L_Q
    tile_ok = row_ok[:, None] & (offs_dv[None, :] < D_V)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m64[:, None] * stride_om
                + offs_dv[None, :] * stride_od, mask=tile_ok, other=0.0)
    do = tl.load(DO + off_b * stride_gb + off_h * stride_gh + offs_m64[:, None] * stride_gm
                 + offs_dv[None, :] * stride_gd, mask=tile_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GRAD_LSE:
        # d lse_i / d s_ij = p_ij, so a gradient on the lse enters dS = P * (dP - delta) here.
        grad_lse = tl.load(GRAD_LSE + off_b * stride_lb + off_h * stride_lh + offs_m64 * stride_lm,
                           mask=row_ok, other=0.0)
        delta = delta - grad_lse.to(tl.float32)
    tl.store(DELTA + off_b * stride_db + off_h * stride_dh + offs_m64, delta, mask=row_ok)


@triton.jit
def _attn_dkdv_queries(dk, dv, lo, hi, state, k, v, key_visible, offs_n, col_ok, offs_dqk, offs_dv, off_b, off_h,
                       q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base, DMASK, RNG, BITS, stride_qm,
                       stride_qd,
                       stride_gm, stride_gd, stride_lm, stride_mm, stride_dmb, stride_dmh, stride_dmm, stride_dmn, H_Q,
                       L_Q, qk_scale, drop_threshold, keep_scale, slope2, softcap2, DIAG, LEFT, RIGHT, start_n,
                       D_QK: tl.constexpr, D_V: tl.constexpr, MASK_KIND: tl.constexpr, BANDED: tl.constexpr,
                       HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                       HAS_PROGRAM: tl.constexpr, HAS_MASK_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                       DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """dK (unscaled) and dV after the query blocks lo, lo + BLOCK_M, .. below hi of one query head against
    the key block start_n .. (transposed tiles, keys along rows), all in the mask program's tile `state`
    (PROGRAM_FULL without a program); dS of each element written where HAS_MASK_GRAD. With DESCRIPTORS, Q and dO
    are read through the head's descriptors q_desc and do_desc (`_rows_descriptor`), else through pointers;
    WARP_SPECIALIZE splits the loop into warps that load and warps that compute, as the forward's."""
    offs_n64 = offs_n.to(tl.int64)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WARP_SPECIALIZE):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_m64 = offs_m.to(tl.int64)
        row_ok = offs_m < L_Q
        if DESCRIPTORS:
            q_t = tl.trans(q_desc.load([start_m, 0]))
            do = do_desc.load([start_m, 0])
        else:
            q_t = tl.load(q_base + offs_m64[None, :] * stride_qm + offs_dqk[:, None] * stride_qd,
                          mask=row_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)
            do = tl.load(do_base + offs_m64[:, None] * stride_gm + offs_dv[None, :] * stride_gd,
                         mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        lse = tl.load(lse_base + offs_m64 * stride_lm, mask=row_ok, other=0.0)
        # Rows that see no key have lse -inf and all p 0; 0 keeps exp2 finite for them.
        lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
        delta = tl.load(delta_base + offs_m64, mask=row_ok, other=0.0)

        s_t = tl.dot(k, q_t, input_precision=PRECISION) * qk_scale
        s_t, cap_grad_t = _variant_scores(s_t, offs_m[None, :], offs_n[:, None], slope2, softcap2, DIAG,
                                          SOFTCAP, HAS_ALIBI)
        s_t, visible = _masked(s_t, key_visible[:, None] & row_ok[None, :], offs_m[None, :], offs_n[:, None],
                               offs_m[:, None], mask_base, offs_m64, stride_mm, DIAG, LEFT, RIGHT, BITS, state,
                               start_n, BLOCK_N, MASK_KIND, BANDED, HAS_PROGRAM, True)
        p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if HAS_DROPOUT:
            # dV takes the dropped weights (scaled at the end); dS = P (Z dP / (1 - p) - delta).
            drop_bh, drop_sequence = _dropout_stream(off_b, off_h, H_Q, VARLEN)
            bits_t = tl.trans(_dropout_bits(RNG, drop_bh, drop_sequence, offs_m, start_n, BLOCK_N))
            keep_t = bits_t.to(tl.int64) >= drop_threshold
            dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, input_precision=PRECISION)
            dp_t = tl.where(keep_t, dp_t * keep_scale, 0.0)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_MASK_GRAD:  # each element once: this program owns these keys of this head
            tl.store(DMASK + off_b * stride_dmb + off_h * stride_dmh + offs_m64[None, :] * stride_dmm
                     + offs_n64[:, None] * stride_dmn, ds_t.to(DMASK.dtype.element_ty),
                     mask=row_ok[None, :] & col_ok[:, None])
        if SOFTCAP:  # the mask's gradient is of the capped score; q and k take the cap's derivative
            ds_t = ds_t * cap_grad_t
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, MASK, KPM, SPANS, RNG, ALIBI, TILES, BITS, DK, DV, DMASK, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_pn,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dmb, stride_dmh, stride_dmm, stride_dmn, stride_ab, stride_ah,
    stride_tileb, stride_tileh, stride_tilem, stride_tilen, stride_db, stride_dh,
    H_Q, H_KV, GROUP, L_Q, L_K, qk_scale, sm_scale, drop_threshold, keep_scale, DIAG, LEFT, RIGHT, softcap2,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, BANDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr, HAS_PROGRAM: tl.constexpr,
    HAS_MASK_GRAD: tl.constexpr, PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key block of one key/value head: dK and dV summed over its query heads and query blocks,
    and, with HAS_MASK_GRAD, dS of each of its (query, key) elements, the additive mask's gradient.

    Works on transposed tiles (keys along rows) so that both accumulators are row-major in keys. With DESCRIPTORS
    (as the forward's), K, V, Q and dO are read and dK and dV written through tensor descriptors.
    """
    num_n = tl.cdiv(L_K, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % num_n
    pid_bh = pid // num_n
    off_b = (pid_bh // H_KV).to(tl.int64)
    off_hkv = (pid_bh % H_KV).to(tl.int64)
    q_start, k_start, L_Q, L_K, DIAG = _packed_sequence(CU_Q, CU_K, off_b, L_Q, L_K, DIAG, VARLEN)
    Q += q_start * stride_qm
    DO += q_start * stride_gm
    LSE += q_start * stride_lm
    DELTA += q_start
    K += k_start * stride_kn
    V += k_start * stride_vn
    DK += k_start * stride_dkn
    DV += k_start * stride_dvn

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n64 = offs_n.to(tl.int64)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < L_K
    key_ok = col_ok  # the keys read; dK and dV are written for all of col_ok (0 for padding)
    if HAS_KPM:
        span_first, span_end = _span(SPANS, off_b)
        key_ok = _in_span(offs_n, span_first, span_end)
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    if DESCRIPTORS:
        k = _descriptor_rows(_rows_descriptor(k_base, L_K, stride_kn, D_QK, BLOCK_N, BLOCK_DQK), pid_n * BLOCK_N,
                             key_ok, HAS_KPM)
        v = _descriptor_rows(_rows_descriptor(v_base, L_K, stride_vn, D_V, BLOCK_N, BLOCK_DV), pid_n * BLOCK_N,
                             key_ok, HAS_KPM)
    else:
        k = tl.load(k_base + offs_n64[:, None] * stride_kn + offs_dqk[None, :] * stride_kd,
                    mask=key_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
        v = tl.load(v_base + offs_n64[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=key_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    key_visible = key_ok
    if HAS_KPM:
        padded = tl.load(KPM + off_b * stride_pb + offs_n64 * stride_pn, mask=key_ok, other=1)
        key_visible = key_visible & (padded == 0)

    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo = 0
    hi = L_Q
    if BANDED:
        # Only the queries whose band reaches these keys: query i sees key j iff
        # j - DIAG - RIGHT <= i <= j - DIAG + LEFT.
        lo = tl.maximum(0, pid_n * BLOCK_N - DIAG - RIGHT) // BLOCK_M * BLOCK_M
        hi = tl.maximum(0, tl.minimum(L_Q, (pid_n + 1) * BLOCK_N - 1 - DIAG + LEFT + 1))
    if HAS_KPM:  # a block of padding only meets no query: its dK and dV are 0
        hi = tl.where((span_end <= pid_n * BLOCK_N) | (span_first >= (pid_n + 1) * BLOCK_N), lo, hi)
    if VARLEN:  # a key block past its sequence's end (the grid is made for the longest)
        hi = tl.where(pid_n * BLOCK_N < L_K, hi, lo)
    # The group's query heads in a fixed order, so the sum is the same on every run.
    for g in range(0, GROUP):
        off_h = off_hkv * GROUP + g
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * 1.4426950408889634
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_gb + off_h * stride_gh
        lse_base = LSE + off_b * stride_lb + off_h * stride_lh
        delta_base = DELTA + off_b * stride_db + off_h * stride_dh
        mask_base = MASK + off_b * stride_mb + off_h * stride_mh + offs_n64[:, None] * stride_mn
        q_desc = q_base  # the descriptors, with DESCRIPTORS (unused otherwise)
        do_desc = do_base
        if DESCRIPTORS:
            q_desc = _rows_descriptor(q_base, L_Q, stride_qm, D_QK, BLOCK_M, BLOCK_DQK)
            do_desc = _rows_descriptor(do_base, L_Q, stride_gm, D_V, BLOCK_M, BLOCK_DV)
        if HAS_PROGRAM:  # as in the forward, along the queries: empty tiles skipped, branch-free blocks inside
            tiles_base = TILES + off_b * stride_tileb + off_h * stride_tileh
            for tile_m in range(lo // PROGRAM_TILE * PROGRAM_TILE, hi, PROGRAM_TILE):
                state = _program_tile(tiles_base, tile_m, pid_n * BLOCK_N, stride_tilem, stride_tilen)
                if state != PROGRAM_EMPTY:  # an empty tile: none of its queries is read, its dS is never written
                    dk, dv = _attn_dkdv_queries(
                        dk, dv, tl.maximum(lo, tile_m), tl.minimum(hi, tile_m + PROGRAM_TILE), state, k, v,
                        key_visible, offs_n, col_ok, offs_dqk, offs_dv, off_b, off_h, q_base, do_base, q_desc,
                        do_desc, lse_base, delta_base, mask_base, DMASK, RNG, BITS, stride_qm, stride_qd, stride_gm,
                        stride_gd, stride_lm, stride_mm, stride_dmb, stride_dmh, stride_dmm, stride_dmn, H_Q, L_Q,
                        qk_scale, drop_threshold, keep_scale, slope2, softcap2, DIAG, LEFT, RIGHT, pid_n * BLOCK_N,
                        D_QK, D_V, MASK_KIND, BANDED, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, VARLEN, HAS_PROGRAM,
                        HAS_MASK_GRAD, PRECISION, DESCRIPTORS, WARP_SPECIALIZE, BLOCK_M, BLOCK_N)
        else:
            dk, dv = _attn_dkdv_queries(
                dk, dv, lo, hi, PROGRAM_FULL, k, v, key_visible, offs_n, col_ok, offs_dqk, offs_dv, off_b, off_h,
                q_base, do_base, q_desc, do_desc, lse_base, delta_base, mask_base, DMASK, RNG, BITS, stride_qm,
                stride_qd, stride_gm, stride_gd, stride_lm, stride_mm, stride_dmb, stride_dmh, stride_dmm, stride_dmn,
                H_Q, L_Q, qk_scale, drop_threshold, keep_scale, slope2, softcap2, DIAG, LEFT, RIGHT, pid_n * BLOCK_N,
                D_QK, D_V, MASK_KIND, BANDED, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, VARLEN, HAS_PROGRAM, HAS_MASK_GRAD,
                PRECISION, DESCRIPTORS, WARP_SPECIALIZE, BLOCK_M, BLOCK_N)

    dk = dk * sm_scale
    if HAS_DROPOUT:
        dv = dv * keep_scale
    # Every key row below L_K is written, padding's too (0), as col_ok says.
    _store_rows(DK + off_b * stride_dkb + off_hkv * stride_dkh, dk.to(DK.dtype.element_ty), pid_n * BLOCK_N, L_K,
                stride_dkn, stride_dkd, D_QK, BLOCK_N, BLOCK_DQK, DESCRIPTORS)
    _store_rows(DV + off_b * stride_dvb + off_hkv * stride_dvh, dv.to(DV.dtype.element_ty), pid_n * BLOCK_N, L_K,
                stride_dvn, stride_dvd, D_V, BLOCK_N, BLOCK_DV, DESCRIPTORS)


@triton.jit
def _attn_dq_keys(dq, lo, hi, state, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, offs_m, offs_dqk, offs_dv,
                  row_ok, mask_base, kpm_base, RNG, drop_bh, drop_sequence, BITS, stride_kn, stride_kd, stride_vn,
                  stride_vd, stride_mn, stride_pn, L_K, span_first, span_end, qk_scale, drop_threshold, keep_scale,
                  slope2, softcap2, DIAG, LEFT, RIGHT, D_QK: tl.constexpr, D_V: tl.constexpr, MASK_KIND: tl.constexpr,
                  HAS_KPM: tl.constexpr, BANDED: tl.constexpr, HAS_DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, HAS_PROGRAM: tl.constexpr, PRECISION: tl.constexpr,
                  DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ (unscaled) after the key blocks lo, lo + BLOCK_N, .. below hi, all in the mask program's tile
    `state` (PROGRAM_FULL without a program); with HAS_KPM only the keys of the span [span_first, span_end)
    are read. With DESCRIPTORS, K and V are read through the descriptors k_desc and v_desc (`_rows_descriptor`);
    WARP_SPECIALIZE splits the loop as the forward's."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_n64 = offs_n.to(tl.int64)
        col_ok = offs_n < L_K
        load_ok = col_ok
        if HAS_KPM:  # as in the forward (`_attn_fwd_keys`)
            load_ok = _in_span(offs_n, span_first, span_end)
        if DESCRIPTORS:
            k_t = tl.trans(_descriptor_rows(k_desc, start_n, load_ok, HAS_KPM))
            v_t = tl.trans(_descriptor_rows(v_desc, start_n, load_ok, HAS_KPM))
        else:
            k_t = tl.load(k_base + offs_n64[None, :] * stride_kn + offs_dqk[:, None] * stride_kd,
                          mask=load_ok[None, :] & (offs_dqk[:, None] < D_QK), other=0.0)
            v_t = tl.load(v_base + offs_n64[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                          mask=load_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0)
        s, cap_grad = _visible_scores(q, k_t, offs_m[:, None], offs_n, row_ok, col_ok, mask_base, stride_mn,
                                      kpm_base, stride_pn, slope2, softcap2, qk_scale, DIAG, LEFT, RIGHT, BITS,
                                      state, start_n, MASK_KIND, HAS_KPM, BANDED, SOFTCAP, HAS_ALIBI,
                                      HAS_PROGRAM, PRECISION)
        p = tl.exp2(s - lse2[:, None])  # 0 where hidden (s = -inf; lse2 is finite)
        dp = tl.dot(do, v_t, input_precision=PRECISION)
        if HAS_DROPOUT:
            bits = _dropout_bits(RNG, drop_bh, drop_sequence, offs_m, start_n, BLOCK_N)
            dp = tl.where(bits.to(tl.int64) >= drop_threshold, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * cap_grad
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, MASK, KPM, SPANS, RNG, ALIBI, TILES, BITS, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_pb, stride_pn,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd, stride_ab, stride_ah,
    stride_tileb, stride_tileh, stride_tilem, stride_tilen, stride_db, stride_dh,
    H_Q, GROUP, L_Q, L_K, qk_scale, sm_scale, drop_threshold, keep_scale, DIAG, LEFT, RIGHT, softcap2,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, BANDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr, HAS_PROGRAM: tl.constexpr,
    PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block: dQ = dS K * scale over the key blocks it sees. With DESCRIPTORS (as the forward's), Q, dO,
    K and V are read and dQ written through tensor descriptors."""
    num_m = tl.cdiv(L_Q, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = num_m - 1 - pid % num_m
    pid_bh = pid // num_m
    off_b = (pid_bh // H_Q).to(tl.int64)
    off_h = (pid_bh % H_Q).to(tl.int64)
    off_hkv = off_h // GROUP
    q_start, k_start, L_Q, L_K, DIAG = _packed_sequence(CU_Q, CU_K, off_b, L_Q, L_K, DIAG, VARLEN)
    Q += q_start * stride_qm
    DO += q_start * stride_gm
    LSE += q_start * stride_lm
    DELTA += q_start
    DQ += q_start * stride_dqm
    K += k_start * stride_kn
    V += k_start * stride_vn
    drop_bh, drop_sequence = _dropout_stream(off_b, off_h, H_Q, VARLEN)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m64 = offs_m.to(tl.int64)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L_Q
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    do_base = DO + off_b * stride_gb + off_h * stride_gh
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    k_desc = k_base  # the descriptors, with DESCRIPTORS (unused otherwise)
    v_desc = v_base
    if DESCRIPTORS:
        q = _rows_descriptor(q_base, L_Q, stride_qm, D_QK, BLOCK_M, BLOCK_DQK).load([pid_m * BLOCK_M, 0])
        do = _rows_descriptor(do_base, L_Q, stride_gm, D_V, BLOCK_M, BLOCK_DV).load([pid_m * BLOCK_M, 0])
        k_desc = _rows_descriptor(k_base, L_K, stride_kn, D_QK, BLOCK_N, BLOCK_DQK)
        v_desc = _rows_descriptor(v_base, L_K, stride_vn, D_V, BLOCK_N, BLOCK_DV)
    else:
        q = tl.load(q_base + offs_m64[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                    mask=row_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
        do = tl.load(do_base + offs_m64[:, None] * stride_gm + offs_dv[None, :] * stride_gd,
                     mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    lse = tl.load(LSE + off_b * stride_lb + off_h * stride_lh + offs_m64 * stride_lm,
                  mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + off_b * stride_db + off_h * stride_dh + offs_m64, mask=row_ok, other=0.0)
    mask_base = MASK + off_b * stride_mb + off_h * stride_mh + offs_m64[:, None] * stride_mm
    kpm_base = KPM + off_b * stride_pb

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah) * 1.4426950408889634
    lo = 0
    hi = L_K
    if BANDED:  # as in the forward
        lo = tl.maximum(0, pid_m * BLOCK_M + DIAG - LEFT) // BLOCK_N * BLOCK_N
        hi = tl.maximum(0, tl.minimum(L_K, (pid_m + 1) * BLOCK_M - 1 + DIAG + RIGHT + 1))
    span_first = 0
    span_end = L_K
    if HAS_KPM:  # keys outside the span the row's padding leaves are never visited
        span_first, span_end = _span(SPANS, off_b)
        lo, hi = _within_span(span_first, span_end, lo, hi, BLOCK_N)
    if VARLEN:  # a query block past its sequence's end (the grid is made for the longest)
        hi = tl.where(pid_m * BLOCK_M < L_Q, hi, lo)
    if HAS_PROGRAM:  # as in the forward: empty tiles skipped by a scalar test, branch-free blocks inside
        tiles_base = TILES + off_b * stride_tileb + off_h * stride_tileh
        for tile_n in range(lo // PROGRAM_TILE * PROGRAM_TILE, hi, PROGRAM_TILE):
            state = _program_tile(tiles_base, pid_m * BLOCK_M, tile_n, stride_tilem, stride_tilen)
            if state != PROGRAM_EMPTY:  # an empty tile: no key of it is read
                dq = _attn_dq_keys(
                    dq, tl.maximum(lo, tile_n), tl.minimum(hi, tile_n + PROGRAM_TILE), state, q, do, lse2, delta,
                    k_base, v_base, k_desc, v_desc, offs_m, offs_dqk, offs_dv, row_ok, mask_base, kpm_base, RNG,
                    drop_bh, drop_sequence, BITS, stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_pn,
                    L_K, span_first, span_end, qk_scale, drop_threshold, keep_scale, slope2, softcap2, DIAG, LEFT,
                    RIGHT, D_QK, D_V, MASK_KIND, HAS_KPM, BANDED, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_PROGRAM,
                    PRECISION, DESCRIPTORS, WARP_SPECIALIZE, BLOCK_N)
    else:
        dq = _attn_dq_keys(
            dq, lo, hi, PROGRAM_FULL, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, offs_m, offs_dqk, offs_dv,
            row_ok, mask_base, kpm_base, RNG, drop_bh, drop_sequence, BITS, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_mn, stride_pn, L_K, span_first, span_end, qk_scale, drop_threshold, keep_scale, slope2, softcap2,
            DIAG, LEFT, RIGHT, D_QK, D_V, MASK_KIND, HAS_KPM, BANDED, HAS_DROPOUT, SOFTCAP, HAS_ALIBI, HAS_PROGRAM,
            PRECISION, DESCRIPTORS, WARP_SPECIALIZE, BLOCK_N)

    dq = dq * sm_scale
    _store_rows(DQ + off_b * stride_dqb + off_h * stride_dqh, dq.to(DQ.dtype.element_ty), pid_m * BLOCK_M, L_Q,
                stride_dqm, stride_dqd, D_QK, BLOCK_M, BLOCK_DQK, DESCRIPTORS)


KERNELS = {
    "fwd": _attn_fwd,
    "bwd_preprocess": _attn_bwd_preprocess,
    "bwd_dkdv": _attn_bwd_dkdv,
    "bwd_dq": _attn_bwd_dq,
}


# ---------------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------------

# Kernels with a tensor-descriptor variant (the DESCRIPTORS constexpr), whose loop may be warp-specialized too
# (WARP_SPECIALIZE, all of them), and the devices that run them: TMA, from Hopper on.
DESCRIPTOR_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
WARP_SPECIALIZED_KERNELS = DESCRIPTOR_KERNELS
DESCRIPTOR_CAPABILITY = (9, 0)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options of one kernel; BLOCK_M tiles queries, BLOCK_N keys. For the kernels of
    DESCRIPTOR_KERNELS also the variant: the (L, D) tiles of Q, K, V and O, or of the backward's dO, dQ, dK and dV,
    through tensor descriptors (`descriptors`), and, for WARP_SPECIALIZED_KERNELS, the key loop warp-specialized
    (`warp_specialize`, with descriptors only)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    descriptors: bool = False
    warp_specialize: bool = False

    def __str__(self) -> str:
        text = f"BLOCK_M={self.block_m},BLOCK_N={self.block_n},warps={self.num_warps},stages={self.num_stages}"
        return text + ",descriptors" * self.descriptors + ",warp_specialized" * self.warp_specialize

    def constexprs(self, kernel: str) -> dict:
        """The config's constexpr arguments of `kernel`."""
        values = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        if kernel in DESCRIPTOR_KERNELS:
            values.update(DESCRIPTORS=self.descriptors)
        if kernel in WARP_SPECIALIZED_KERNELS:
            values.update(WARP_SPECIALIZE=self.warp_specialize)
        return values

    def triton_config(self, kernel: str) -> triton.Config:
        return triton.Config(self.constexprs(kernel), num_warps=self.num_warps, num_stages=self.num_stages)


# Defaults by kernel, GPU generation (the sm_80 table below compute capability 9, the sm_90 one from 9
# on), bytes per element (2: fp16/bf16, 4: fp32) and padded head dim (the larger of D_qk and D_v).
# Every entry was compiled for its target (bench/triton_report.py) without spills and, for 2-byte
# types, with tensor-core instructions (HMMA on sm_80, HGMMA on sm_90; HMMA for sm_90's dK/dV at D=256, whose 32 key
# rows are fewer than a warpgroup's) and shared memory within the device limit; tests/test_triton_compile.py keeps
# checking the fp16/bf16 entries of head dims 64 and 128, and on sm_90 and sm_100 fp32's of 128 and bf16's of 256.
# Found on the way: 64 x 64 backward tiles with 4
# warps spilled on sm_80 (dQ at D=64, dK/dV at D=128), 4 warps spilled at D=256, and fp32 in full precision (FMA, no
# tensor cores) needs small tiles, 128-row tiles spilling by hundreds of local loads on sm_90 (fp32's dQ at D=64:
# 64 x 32 with 8 warps used 8 to 16 bytes of stack on sm_90 and sm_100, and dK/dV at D=256 16 x 16 with 4 warps 8
# bytes with dropout; bench/NOTES.md section 58).
_K = KernelConfig
_DEFAULTS = {
    ("fwd", "sm_80", 2): {64: _K(128, 64, 8, 3), 128: _K(128, 32, 8, 3), 256: _K(64, 32, 8, 2)},
    ("fwd", "sm_90", 2): {64: _K(128, 64, 4, 3), 128: _K(128, 64, 8, 3), 256: _K(64, 32, 4, 2)},
    ("bwd_dkdv", "sm_80", 2): {64: _K(32, 128, 8, 2), 128: _K(32, 64, 8, 2), 256: _K(16, 64, 8, 2)},
    ("bwd_dkdv", "sm_90", 2): {64: _K(64, 64, 4, 2), 128: _K(32, 64, 4, 2), 256: _K(16, 32, 8, 2)},
    ("bwd_dq", "sm_80", 2): {64: _K(128, 32, 8, 2), 128: _K(64, 64, 8, 2), 256: _K(64, 32, 8, 2)},
    ("bwd_dq", "sm_90", 2): {64: _K(64, 64, 4, 2), 128: _K(64, 32, 4, 2), 256: _K(64, 16, 4, 2)},
    ("fwd", "sm_80", 4): {64: _K(64, 32, 8, 2), 128: _K(64, 32, 8, 2), 256: _K(32, 16, 4, 2)},
    ("fwd", "sm_90", 4): {64: _K(64, 32, 8, 2), 128: _K(32, 16, 4, 2), 256: _K(32, 16, 4, 2)},
    ("bwd_dkdv", "sm_80", 4): {64: _K(16, 64, 4, 2), 128: _K(16, 64, 8, 2), 256: _K(16, 32, 4, 1)},
    ("bwd_dkdv", "sm_90", 4): {64: _K(16, 64, 4, 2), 128: _K(16, 64, 8, 2), 256: _K(16, 32, 8, 1)},
    ("bwd_dq", "sm_80", 4): {64: _K(64, 16, 4, 2), 128: _K(64, 16, 4, 2), 256: _K(32, 16, 4, 1)},
    ("bwd_dq", "sm_90", 4): {64: _K(32, 32, 4, 2), 128: _K(64, 16, 4, 2), 256: _K(32, 16, 4, 1)},
}


# The preprocess, a row-wise reduction: 32 rows with 8 warps compiled without spills for fp16 and
# fp32 at every head dim on sm_80 and sm_90 (64 rows with 4 warps spilled for fp32 on sm_90).
PREPROCESS_BLOCK_M = 32
PREPROCESS_WARPS = 8
# Shared memory per block, opt-in maximum: A100 (sm_80), H100 (sm_90) and B200 (sm_100).
SHARED_MEMORY_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024}


def padded_head_dim(head_dim: int) -> int:
    """The power of two (at least 16, the smallest `tl.dot` operand) a head dimension is padded to."""
    return max(16, triton.next_power_of_2(head_dim))


def arch_of(capability: tuple[int, int]) -> str:
    """The generation whose configs a device of `capability` launches: "sm_80", "sm_90", or "sm_100" (Blackwell,
    sm_90's tables but where `_BLACKWELL_DEFAULTS` says otherwise)."""
    if capability[0] >= 10:
        return "sm_100"
    return "sm_90" if capability[0] >= 9 else "sm_80"


# fp16/bf16 tiles for launches with dropout (and dK/dV writing a learned bias's gradient) where the
# default spills registers on some supported Triton release: the random bits stay live beside the
# scores. Each chosen by compiling candidates for its target on Triton 3.5 to 3.9
# (bench/triton_report.py): no spills, tensor-core instructions kept (HGMMA on sm_90). Keyed
# (kernel, arch, head dim of the table, bias gradient).
_DROPOUT_DEFAULTS = {
    ("fwd", "sm_90", 64, False): _K(128, 32, 4, 3),
    ("bwd_dkdv", "sm_80", 64, False): _K(16, 128, 8, 2),
    ("bwd_dkdv", "sm_80", 64, True): _K(16, 64, 8, 2),
    ("bwd_dkdv", "sm_80", 128, True): _K(32, 32, 8, 2),
    ("bwd_dkdv", "sm_90", 64, False): _K(32, 64, 4, 2),  # the table's (64, 64, 4, 2) spills with key_start % 4
    ("bwd_dkdv", "sm_90", 64, True): _K(16, 64, 4, 2),
    ("bwd_dkdv", "sm_90", 128, False): _K(16, 64, 8, 2),
    ("bwd_dkdv", "sm_90", 128, True): _K(16, 64, 8, 2),
}


# Packed batches (VARLEN) with dropout, where the sequence bounds' registers tip the tiles above into
# spilling; chosen the same way, on Triton 3.5.1, 3.7.1 and 3.9.0. Keyed (kernel, arch, head dim).
_PACKED_DROPOUT_DEFAULTS = {
    ("fwd", "sm_90", 256): _K(128, 16, 8, 1),  # the table's (64, 32, 4, 2): 16 bytes of stack
    ("bwd_dkdv", "sm_80", 128): _K(32, 32, 8, 2),
    ("bwd_dkdv", "sm_90", 64): _K(32, 64, 4, 2),  # the table's (64, 64, 4, 2) spills on Triton 3.5 and 3.7
    ("bwd_dq", "sm_80", 128): _K(64, 32, 8, 2),
}


# fp16/bf16 tiles for launches with a mask program (HAS_PROGRAM) where the default spills registers: a
# partial tile's bits and the loop over a row's tiles stay live beside the pipelined loads (and, with dropout,
# the random bits). Chosen by compiling candidates for their target on Triton 3.9 (bench/triton_report.py): no
# spills, tensor-core instructions kept. Keyed (kernel, arch, head dim of the table, dropout).
_PROGRAM_DEFAULTS = {
    ("fwd", "sm_80", 64, True): _K(128, 32, 8, 3),  # the table's (128, 64, 8, 3) spills
    ("fwd", "sm_80", 128, True): _K(128, 16, 8, 3),  # the table's (128, 32, 8, 3) spills, (64, 32, 4, 3) too
    ("fwd", "sm_90", 64, False): _K(128, 64, 8, 3),  # the table's (128, 64, 4, 3) spills
    ("fwd", "sm_90", 64, True): _K(128, 32, 8, 3),  # the dropout table's (128, 32, 4, 3) spills
    ("fwd", "sm_90", 128, True): _K(128, 32, 8, 3),  # the table's (128, 64, 8, 3) spills, (64, 64, 4, 3) too
    ("bwd_dkdv", "sm_90", 64, False): _K(64, 64, 8, 2),  # the table's (64, 64, 4, 2) spills through descriptors
    ("bwd_dkdv", "sm_90", 64, True): _K(32, 64, 8, 2),  # the dropout table's (32, 64, 4, 2) too
    ("bwd_dkdv", "sm_90", 128, False): _K(32, 64, 8, 2),  # the table's (32, 64, 4, 2) spills
    ("bwd_dq", "sm_80", 128, False): _K(32, 64, 8, 2),
    ("bwd_dq", "sm_80", 128, True): _K(32, 64, 8, 2),  # the table's (64, 64, 8, 2) spills
    ("bwd_dq", "sm_90", 64, True): _K(64, 64, 8, 2),  # the table's (64, 64, 4, 2) spills
    # The table's (64, 32, 4, 2) spills on Triton 3.6.0 to 3.8.0 (24, 22, 12 local loads/stores; 255 registers on 3.9).
    ("bwd_dq", "sm_90", 128, True): _K(64, 32, 8, 2),
    # At D = 256 the table's (64, 32, 4, 2) used local memory (up to 256 bytes a thread, descriptors too); one stage of
    # 128 x 16 tiles compiled every forward row of sm_90 and sm_100 without (bench/NOTES.md section 58).
    ("fwd", "sm_90", 256, False): _K(128, 16, 8, 1),
    ("fwd", "sm_90", 256, True): _K(128, 16, 8, 1),
    ("fwd", "sm_80", 256, True): _K(64, 16, 8, 2),  # the table's (64, 32, 8, 2): 32 bytes
}


# fp16/bf16 tiles on Blackwell (sm_100) where sm_90's default spills registers there, each compiled for sm_100 on
# Triton 3.9 (bench/triton_report.py): no spills, tcgen05 products (UTCHMMA) kept (the narrow tiles of D = 256 with a
# program, _NARROW_AT_256, are HMMA). Keyed (kernel, head dim of the table), then the features a launch has all of (the
# first entry that matches): SCORES is a softcap, ALiBi or key padding, the others constexprs of the kernels.
_BLACKWELL_DEFAULTS = {
    # sm_90's (128, 64, 4, 3) spills; with a program and dropout, (128, 32, 8, 3)'s descriptor variant does.
    ("fwd", 64): ((("SCORES",), _K(128, 32, 4, 3)), (("KV8",), _K(128, 32, 4, 3)),
                  (("HAS_PROGRAM", "HAS_DROPOUT"), _K(128, 32, 4, 3))),
    # (32, 64, 4, 2) spills with dropout; without, sm_90's (64, 64, 8, 2) has 128 registers a thread here and spills.
    ("bwd_dkdv", 64): ((("HAS_PROGRAM", "HAS_DROPOUT"), _K(16, 64, 4, 2)), (("HAS_PROGRAM",), _K(64, 64, 4, 2))),
    # (16, 64, 8, 2) spills, through descriptors without the score variants too.
    ("bwd_dkdv", 128): ((("HAS_MASK_GRAD", "HAS_DROPOUT"), _K(16, 64, 4, 2)),),
    ("bwd_dq", 64): ((("VARLEN", "HAS_DROPOUT"), _K(64, 32, 4, 2)),),  # (64, 64, 4, 2) spills
    ("bwd_dq", 128): ((("HAS_PROGRAM", "HAS_DROPOUT"), _K(64, 32, 8, 2)),),  # (64, 32, 4, 2) spills
    # An 8-bit cache: sm_90's (64, 32, 4, 2) used 40 to 72 bytes of stack.
    ("fwd", 256): ((("KV8",), _K(128, 16, 8, 1)),),
    # Without a program (_NARROW_AT_256) the tiles that fill a warpgroup compile without local memory here (dK/dV: 64
    # keys, which used 8 bytes on sm_90 even without dropout; dQ: 64 queries).
    ("bwd_dkdv", 256): (((), _K(16, 64, 8, 2)),),
    ("bwd_dq", 256): ((("HAS_DROPOUT",), _K(64, 16, 4, 2)),),
}


# fp16/bf16 at a padded head dim of 256: the backward's tiles whose products fill a warpgroup used local memory with a
# program (up to 760 bytes a thread) and, on some targets, with dropout (up to 248 bytes on sm_90; with a program and
# dropout, sm_90's own narrow table tiles used 80 bytes through descriptors). These, narrower and on one stage for
# dK/dV, are multiplied by warp-level HMMA (bench/NOTES.md section 58). Keyed (kernel, arch): the features (as in
# _BLACKWELL_DEFAULTS) under which a launch takes them, any one of the sets.
_NARROW_TILES = {"bwd_dkdv": _K(16, 32, 8, 1), "bwd_dq": _K(32, 32, 8, 2)}
_NARROW_AT_256 = {
    ("bwd_dkdv", "sm_80"): (("HAS_PROGRAM",), ("HAS_DROPOUT",)),
    ("bwd_dkdv", "sm_90"): (("HAS_PROGRAM", "HAS_DROPOUT"),),
    ("bwd_dkdv", "sm_100"): (("HAS_PROGRAM",),),
    ("bwd_dq", "sm_80"): (("HAS_PROGRAM",),),
    ("bwd_dq", "sm_90"): (("HAS_PROGRAM",), ("HAS_DROPOUT",)),
    ("bwd_dq", "sm_100"): (("HAS_PROGRAM",),),
}


# fp16/bf16 tiles for older Triton releases whose register allocation spills at the tiles above (chosen on 3.9), each
# compiled for its target on the releases it is taken on (bench/triton_report.py; bench/NOTES.md section 44): no
# spills, tensor-core instructions kept. Keyed (kernel, arch, head dim of the table), then (the features a launch has
# all of, as in _BLACKWELL_DEFAULTS; the oldest release that compiles the tiles above without spills; the tiles taken
# before it), the first entry that matches.
_OLD_RELEASE_DEFAULTS = {
    # An 8-bit cache with per-key scales spilled at the table's (128, 64, 8, 3) on 3.5.1 (6 to 44 local loads/stores)
    # and 3.6.0 (16 to 52).
    ("fwd", "sm_80", 64): ((("KV8", "TOKEN_SCALES"), (3, 7), _K(128, 32, 8, 3)),),
    # The same at (128, 32, 8, 3): 18 to 26 on 3.5.1, 2 to 10 on 3.6.0.
    ("fwd", "sm_80", 128): ((("KV8", "TOKEN_SCALES"), (3, 7), _K(64, 32, 8, 3)),),
    # The same at (128, 64, 4, 3): 20 to 22 on 3.5.1, 69 on 3.6.0.
    ("fwd", "sm_90", 64): ((("KV8", "TOKEN_SCALES"), (3, 7), _K(128, 32, 4, 3)),),
    # The score variants with key padding spilled at the Blackwell table's (128, 32, 4, 3) on 3.7.1 (2, at 168
    # registers); (128, 32, 8, 3) leaves 128 registers a thread there and spilled with a program or a packed batch
    # (8 to 12), and 2 stages with a program (20), which keeps the table's. On 3.8.0 an 8-bit cache with a scale per
    # sequence spilled at the table's with the score variants and key padding (float8 10 / 2 fp16 / bf16, int8 2 / 2, at
    # 168 registers), and at (128, 32, 4, 2) (float8 13 / 4); (128, 32, 8, 3) has 118 registers and the same 29 KiB of
    # shared memory. Before 3.8 the score variants' entry comes first; without score variants and key padding
    # (128, 32, 8, 3) spilled on 3.6.0 (2) where the table's did not. Scales per key keep the table's.
    ("fwd", "sm_100", 64): ((("HAS_PROGRAM",), (3, 8), _K(128, 32, 4, 3)), (("SCORES",), (3, 8), _K(128, 32, 4, 2)),
                            (("KV8", "TOKEN_SCALES"), (3, 9), _K(128, 32, 4, 3)),
                            (("KV8", "SCORES"), (3, 9), _K(128, 32, 8, 3))),
    # A program with dropout spilled at the dropout table's (16, 128, 8, 2) on 3.6.0 (6); without dropout at the
    # table's (32, 128, 8, 2) on 3.5.1 (3).
    ("bwd_dkdv", "sm_80", 64): ((("HAS_PROGRAM", "HAS_DROPOUT"), (3, 7), _K(16, 64, 8, 2)),
                                (("HAS_PROGRAM",), (3, 6), _K(16, 128, 8, 2))),
    # A program with dropout spilled at the table's (32, 64, 8, 2) on 3.5.1 and 3.6.0 (6) and 3.7.1 (26).
    ("bwd_dkdv", "sm_80", 128): ((("HAS_PROGRAM", "HAS_DROPOUT"), (3, 8), _K(32, 32, 8, 2)),),
    # A program with dropout spilled at the Blackwell table's (16, 64, 4, 2) on 3.5.1 (5, at 128 registers).
    ("bwd_dkdv", "sm_100", 64): ((("HAS_PROGRAM", "HAS_DROPOUT"), (3, 6), _K(32, 64, 4, 2)),),
    # At D = 256 (bench/NOTES.md section 62): on 3.7.1 a program at the table's (64, 32, 8, 2) used 16 bytes of stack,
    # with dropout at (64, 16, 8, 2) 8.
    ("fwd", "sm_80", 256): ((("HAS_PROGRAM",), (3, 8), _K(64, 16, 8, 1)),),
    # A program with dropout at (128, 16, 8, 1) used 48 bytes on 3.7.1 and 56 on 3.8.0, dropout at the table's
    # (64, 32, 4, 2) 32 and 48, a paged cache 8. sm_100 takes these too, each release its own: 3.7.1's descriptor
    # forward with dropout used 8 bytes there at 3.8.0's tiles, and 3.8.0's 8 to 24 at 3.7.1's.
    ("fwd", "sm_90", 256): ((("HAS_PROGRAM",), (3, 8), _K(64, 16, 8, 1)), (("HAS_DROPOUT",), (3, 8), _K(64, 32, 8, 2)),
                            (("PAGED",), (3, 8), _K(64, 32, 8, 2)), (("HAS_PROGRAM",), (3, 9), _K(64, 16, 8, 2)),
                            (("HAS_DROPOUT",), (3, 9), _K(64, 16, 8, 2)), (("PAGED",), (3, 9), _K(64, 16, 8, 2))),
    ("bwd_dq", "sm_100", 256): ((("HAS_DROPOUT",), (3, 8), _K(64, 16, 8, 2)),),  # (64, 16, 4, 2): 8 bytes
}


# fp32's own entries of the same kind: launches whose tiles (_FLOAT32_DEFAULTS, or the table's) used local memory on
# Triton 3.7.1 or 3.8.0 (bench/NOTES.md section 62), keyed and matched as _OLD_RELEASE_DEFAULTS; sm_100 takes sm_90's
# where it has none. The bytes of stack at the newer tiles are given for each.
_FLOAT32_OLD_RELEASE_DEFAULTS = {
    ("fwd", "sm_80", 64): ((("HAS_PROGRAM",), (3, 8), _K(64, 16, 8, 1)),),  # 16-24
    ("bwd_dkdv", "sm_80", 64): ((("HAS_DROPOUT",), (3, 8), _K(16, 64, 8, 1)),),  # 64
    ("bwd_dq", "sm_80", 64): ((("VARLEN", "HAS_DROPOUT"), (3, 8), _K(16, 32, 8, 1)),),  # 16
    ("bwd_dkdv", "sm_80", 128): ((("HAS_MASK_GRAD", "HAS_DROPOUT"), (3, 8), _K(16, 64, 8, 1)),),  # 40
    ("fwd", "sm_80", 256): ((("HAS_PROGRAM",), (3, 8), _K(16, 16, 8, 1)),),  # 32
    ("bwd_dkdv", "sm_80", 256): ((("HAS_DROPOUT",), (3, 8), _K(16, 16, 4, 1)),),  # 8-864
    ("fwd", "sm_90", 64): ((("KV8",), (3, 8), _K(32, 32, 4, 1)),  # 160-168
                           (("HAS_PROGRAM",), (3, 9), _K(32, 32, 8, 2))),  # 16-24
    ("bwd_dkdv", "sm_90", 64): ((("HAS_PROGRAM",), (3, 9), _K(32, 32, 8, 1)),  # 24-32
                                (("VARLEN", "HAS_DROPOUT"), (3, 8), _K(32, 32, 8, 1))),  # 32
    ("bwd_dq", "sm_90", 64): ((("HAS_PROGRAM",), (3, 9), _K(64, 16, 8, 1)),),  # 24 on 3.8.0
    ("fwd", "sm_90", 128): ((("KV8",), (3, 8), _K(32, 16, 4, 1)),),  # 568-624
    # An 8-bit cache keeps _FLOAT32_DEFAULTS' tiles; the score variants and a paged cache used 2.2 to 7.7 KiB, and on
    # 3.5.1 the table's (32, 16, 4, 2) 32 to 1032 bytes without them.
    ("fwd", "sm_90", 256): ((("KV8",), (3, 8), _K(16, 16, 4, 1)), (("HAS_PROGRAM",), (3, 8), _K(16, 16, 8, 1)),  # 24
                            (("SCORES",), (3, 8), _K(32, 16, 8, 1)), (("PAGED",), (3, 8), _K(32, 16, 8, 1)),
                            ((), (3, 6), _K(32, 16, 8, 1))),
    ("bwd_dkdv", "sm_100", 64): ((("HAS_PROGRAM",), (3, 9), _K(32, 32, 4, 2)),),  # 32; sm_90's used 24 on 3.7.1
    ("bwd_dq", "sm_100", 64): ((("HAS_PROGRAM",), (3, 8), _K(32, 32, 8, 2)),),  # 8; sm_90's 24 on 3.7.1
    ("bwd_dkdv", "sm_100", 128): ((("HAS_DROPOUT",), (3, 8), _K(16, 32, 8, 2)),),  # 232-328
}


# fp32 tiles (products on FMA units) for launches whose table tiles used local memory (Triton 3.9,
# bench/tile_search.py, bench/NOTES.md section 58): an 8-bit cache's conversions, dropout's random bits and a program's
# tile states live beside the fp32 tiles, and one stage keeps the pipelined copies out. Keyed (kernel, arch, head dim of
# the table; sm_100 takes sm_90's), then (the features a launch has all of, as in _BLACKWELL_DEFAULTS), the first entry
# that matches. The table's bytes of stack are given for each.
_FLOAT32_DEFAULTS = {
    ("fwd", "sm_80", 64): ((("KV8",), _K(64, 32, 8, 1)), (("HAS_PROGRAM",), _K(64, 32, 8, 1))),  # 224-240, 8
    ("fwd", "sm_80", 128): ((("KV8",), _K(64, 16, 4, 1)), (("SCORES",), _K(64, 16, 8, 2))),  # 4.8 KiB, 16
    ("fwd", "sm_80", 256): ((("KV8",), _K(16, 16, 4, 1)), (("HAS_PROGRAM",), _K(32, 16, 4, 1))),  # 1.9-4.6 KiB, 8
    ("bwd_dkdv", "sm_80", 64): ((("HAS_MASK_GRAD", "SCORES"), _K(16, 64, 8, 2)),),  # 80
    ("bwd_dkdv", "sm_80", 256): ((("HAS_PROGRAM",), _K(16, 16, 4, 1)),),  # 8-88
    ("bwd_dq", "sm_80", 64): ((("HAS_DROPOUT",), _K(32, 32, 8, 1)), (("SCORES",), _K(32, 32, 8, 1)),  # 16, 8
                              (("HAS_PROGRAM",), _K(32, 32, 8, 1))),  # 32
    ("bwd_dq", "sm_80", 128): ((("HAS_PROGRAM",), _K(64, 16, 4, 1)),  # 64
                               (("VARLEN", "HAS_DROPOUT"), _K(64, 16, 4, 1))),  # 8
    ("fwd", "sm_90", 64): ((("KV8",), _K(64, 32, 4, 1)),),  # 248-272
    ("bwd_dkdv", "sm_90", 64): ((("HAS_DROPOUT",), _K(32, 64, 8, 1)),),  # 40-120
    ("fwd", "sm_90", 128): ((("KV8",), _K(64, 16, 4, 1)),  # 320-352
                            (("HAS_DROPOUT",), _K(32, 32, 8, 1)), (("HAS_PROGRAM",), _K(32, 32, 8, 1))),  # 8-32
    ("bwd_dkdv", "sm_90", 128): ((("HAS_MASK_GRAD",), _K(16, 32, 8, 2)),),  # 56-104
    ("bwd_dq", "sm_90", 128): ((("HAS_PROGRAM",), _K(64, 16, 4, 1)),  # 32
                               (("VARLEN", "HAS_DROPOUT"), _K(64, 16, 4, 1))),  # 32
    ("fwd", "sm_90", 256): ((("KV8",), _K(16, 16, 4, 1)),  # 1.9 KiB
                            (("SCORES",), _K(16, 32, 4, 1)), (("PAGED",), _K(16, 32, 4, 1)),  # 24-48
                            (("HAS_PROGRAM",), _K(16, 32, 4, 1))),
}


def _first_match(entries, constexprs: dict | None) -> KernelConfig | None:
    """The config of the first (features, config) of `entries` whose features a launch with `constexprs` has all of
    (its constexprs that are True, and SCORES: a softcap, ALiBi or key padding), or None."""
    on = {name for name, value in (constexprs or {}).items() if value is True}
    if on & {"SOFTCAP", "HAS_ALIBI", "HAS_KPM"}:
        on.add("SCORES")
    return next((config for features, config in entries if on.issuperset(features)), None)


def _blackwell_default(kernel: str, dim: int, constexprs: dict | None) -> KernelConfig | None:
    """The Blackwell tiles of `kernel` for a launch with `constexprs`, or None where sm_90's hold."""
    return _first_match(_BLACKWELL_DEFAULTS.get((kernel, dim), ()), constexprs)


def _old_release_default(kernel: str, arch: str, dim: int, element_size: int,
                         constexprs: dict | None) -> KernelConfig | None:
    """The tiles of `kernel` on `arch` for a launch with `constexprs` where the installed Triton is older than the
    release an entry of `_OLD_RELEASE_DEFAULTS` (fp32: `_FLOAT32_OLD_RELEASE_DEFAULTS`) names, or None."""
    table = _FLOAT32_OLD_RELEASE_DEFAULTS if element_size > 2 else _OLD_RELEASE_DEFAULTS
    entries = table.get((kernel, arch, dim), ())
    return _first_match(((features, config) for features, release, config in entries
                         if triton_compat.older_than(release)), constexprs)


def default_config(kernel: str, arch: str, head_dim: int, element_size: int,
                   constexprs: dict | None = None) -> KernelConfig:
    """The default of `kernel` on `arch` ("sm_80", "sm_90" or "sm_100") for a padded head dim and, where given,
    the features of the launch (its constexprs: a mask program, dropout, a bias gradient and packed
    batches with dropout have tiles of their own, and so have some launches on older Triton releases)."""
    dim = min(dim for dim in _DEFAULTS[(kernel, "sm_90", 2)] if dim >= head_dim)
    if element_size == 2 and dim == 256 and \
            _first_match(((features, True) for features in _NARROW_AT_256.get((kernel, arch), ())), constexprs):
        return _NARROW_TILES[kernel]
    if (old := _old_release_default(kernel, arch, dim, element_size, constexprs)) is not None:
        return old
    if arch == "sm_100":
        blackwell = _blackwell_default(kernel, dim, constexprs) if element_size == 2 else None
        return blackwell or default_config(kernel, "sm_90", head_dim, element_size, constexprs)
    if element_size > 2 and \
            (wide := _first_match(_FLOAT32_DEFAULTS.get((kernel, arch, dim), ()), constexprs)) is not None:
        return wide
    table = _DEFAULTS[(kernel, arch, 4 if element_size > 2 else 2)]
    dim = min(dim for dim in table if dim >= head_dim)
    if constexprs and constexprs.get("HAS_PROGRAM") and element_size == 2:
        key = (kernel, arch, dim, bool(constexprs.get("HAS_DROPOUT")))
        if key in _PROGRAM_DEFAULTS:
            return _PROGRAM_DEFAULTS[key]
    if constexprs and constexprs.get("HAS_DROPOUT") and element_size == 2:
        if constexprs.get("VARLEN") and (kernel, arch, dim) in _PACKED_DROPOUT_DEFAULTS:
            return _PACKED_DROPOUT_DEFAULTS[(kernel, arch, dim)]
        key = (kernel, arch, dim, bool(constexprs.get("HAS_MASK_GRAD")))
        if key in _DROPOUT_DEFAULTS:
            return _DROPOUT_DEFAULTS[key]
    return table[dim]


def shared_memory_estimate(kernel: str, config: KernelConfig, block_dqk: int, block_dv: int,
                           element_size: int, dropout: bool = False) -> int:
    """An upper estimate of a config's shared memory, to prune autotuning candidates.

    The streamed operand tiles are buffered `num_stages` deep; the resident tile and the
    probabilities (or dS) routed through shared memory to the second product count once. Dropout
    adds one tile of 32-bit random integers, whose four interleaved Philox outputs are laid out
    again through shared memory. The backward kernels count one more (keys, D_qk) tile: on sm_100, whose
    tcgen05 products read both operands from shared memory, they take up to 13% more than the rest
    (bench/triton_report.py). A warp-specialized loop counts its streamed tiles two stages deeper: split into
    partitions on sm_90, the backward's took up to 28 % more than this estimate of the plain variant.
    """
    m, n, stages = config.block_m, config.block_n, max(1, config.num_stages) + (2 if config.warp_specialize else 0)
    if kernel in ("fwd", "bwd_dq"):
        streamed = n * (block_dqk + block_dv)
        resident = m * (block_dqk + block_dv) + m * n
    else:
        streamed = m * (block_dqk + block_dv)
        resident = n * (block_dqk + block_dv) + 2 * m * n
    if kernel != "fwd":
        resident += n * block_dqk
    return (stages * streamed + resident) * element_size + (4 * m * n if dropout else 0)


def _candidates(kernel: str) -> list[KernelConfig]:
    """Autotuning candidates: every default plus neighbours in tile size, warps and stages."""
    found = []
    for (name, _, _), table in _DEFAULTS.items():
        if name != kernel:
            continue
        for config in table.values():
            for variant in (config,
                            dataclasses.replace(config, num_stages=config.num_stages + 1),
                            dataclasses.replace(config, num_warps=8 if config.num_warps == 4 else 4),
                            dataclasses.replace(config, block_n=config.block_n * 2),
                            dataclasses.replace(config, block_m=config.block_m * 2)):
                if variant not in found:
                    found.append(variant)
    return found


# ---------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------

def interpreting() -> bool:
    """Whether the kernels of this module were built for Triton's interpreter (CPU tensors)."""
    return type(_attn_fwd).__name__ == "InterpretedFunction"


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _mask_args(attn_mask, key_padding_mask, dummy):
    """Kernel pointer arguments for the masks; a bool tensor is read as bytes through a free view."""
    if attn_mask is None:
        mask, kind, mask_strides = dummy, 0, (0, 0, 0, 0)
    elif attn_mask.dtype == torch.bool:
        mask, kind, mask_strides = attn_mask.view(torch.uint8), 1, attn_mask.stride()
    else:
        mask, kind, mask_strides = attn_mask, 2, attn_mask.stride()
    if key_padding_mask is None:
        padding, padding_strides, spans = dummy, (0, 0), dummy
    else:
        padding, padding_strides = key_padding_mask.view(torch.uint8), key_padding_mask.stride()
        spans = padding_spans(key_padding_mask)
    return mask, kind, tuple(mask_strides), padding, tuple(padding_strides), spans


def padding_spans(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """int32 (B, 2): for each batch row, [first, end) of the keys that are not padding (an empty range
    when all are), computed where the mask lives, with no host synchronisation."""
    batch, len_k = key_padding_mask.shape
    if len_k == 0:
        return torch.zeros(batch, 2, dtype=torch.int32, device=key_padding_mask.device)
    kept = ~key_padding_mask
    index = torch.arange(len_k, dtype=torch.int32, device=kept.device)
    first = torch.where(kept, index, len_k).amin(1)
    end = torch.where(kept, index + 1, 0).amax(1)
    return torch.stack([first, torch.maximum(first, end)], 1).to(torch.int32)


def _dropout_args(dropout, dummy):
    """(RNG pointer, threshold, keep scale) kernel arguments; a dropout of None reads nothing."""
    if dropout is None:
        return dummy, 0, 1.0
    return dropout.rng, dropout.threshold, dropout.keep_scale


@dataclasses.dataclass(frozen=True)
class Sequences:
    """A packed batch (fused_attn.varlen): cumulative lengths (B + 1,) on the device and the longest
    sequences, which the grid is made for. The packed (total, H, D) tensors reach the kernels as
    (B, H, total, D) views with a batch stride of 0 (`batched`); each program finds its sequence."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def batched(packed: torch.Tensor, batch: int) -> torch.Tensor:
    """A packed (total, H, ...) tensor as a (B, H, total, ...) view, batch stride 0."""
    heads_first = packed.transpose(0, 1)
    return heads_first.unsqueeze(0).expand(batch, *heads_first.shape)


def _sequence_args(sequences: Sequences | None, dummy):
    """(CU_Q, CU_K) kernel pointers and the VARLEN constexpr."""
    if sequences is None:
        return (dummy, dummy), dict(VARLEN=False)
    return (sequences.cu_seqlens_q, sequences.cu_seqlens_k), dict(VARLEN=True)


@dataclasses.dataclass(frozen=True)
class Pages:
    """A paged key/value cache (fused_attn.kvcache): the int32 (B, max_blocks) block table, unit stride
    along the blocks. Key and value reach the kernels as (num_blocks, H_kv, block_size, D) views of
    the blocks (`cache_blocks`), whose batch stride steps between blocks; each key's block is looked up.
    An 8-bit cache (fused_attn.quantization) comes with its float32 scales, k_scale and v_scale: (B, H_kv),
    one per sequence and kv head, or (num_blocks, block_size, H_kv), one per stored key and head, any strides."""

    block_table: torch.Tensor
    block_size: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def len_k(self) -> int:
        return self.block_table.shape[1] * self.block_size


def block_major(blocks: torch.Tensor) -> torch.Tensor:
    """Cache blocks (num_blocks, block_size, H_kv, D) as the (num_blocks, H_kv, block_size, D) view."""
    return blocks.transpose(1, 2)


# Triton has the float8_e4m3fn type (tl.float8e4nv) from sm_89 on: before, it refuses a pointer to it ("type
# fp8e4nv not supported in this architecture"), and the kernels read the bits (`_cache_values`).
FP8_CAPABILITY = (8, 9)


def reads_fp8_type(device: torch.device) -> bool:
    """Whether the kernels read a float8_e4m3fn cache on `device` as that type (Triton converts it), rather than
    as its bits: on GPUs of FP8_CAPABILITY and later; not in the interpreter, which runs the conversion of sm_80."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def cache_blocks(blocks: torch.Tensor, fp8_type: bool) -> torch.Tensor:
    """Cache blocks (num_blocks, block_size, H_kv, D) as the kernels read them: the `block_major` view, and a
    float8_e4m3fn cache's bits as uint8 where Triton has no fp8 type for the device (`reads_fp8_type`)."""
    if blocks.dtype == torch.float8_e4m3fn and not fp8_type:
        blocks = blocks.view(torch.uint8)
    return block_major(blocks)


def _scale_strides(scales: torch.Tensor) -> tuple[int, int, int]:
    """(between blocks or batch rows, between a block's rows, between heads) of one scale layout: a
    sequence's scale, (B, H_kv), is the same for every key of it."""
    if scales.dim() == 2:
        return scales.stride(0), 0, scales.stride(1)
    return tuple(scales.stride())


def page_args(pages: Pages | None, dummy):
    """((PAGES, KS, VS) pointers, (stride_tb, PAGE_SIZE, the scales' 6 strides)) kernel arguments and the PAGED,
    KV8 and TOKEN_SCALES constexprs."""
    if pages is None:
        return (dummy, dummy, dummy), (0, 1, *(0,) * 6), dict(PAGED=False, KV8=False, TOKEN_SCALES=False)
    table = pages.block_table
    if pages.k_scale is None:
        return (table, dummy, dummy), (table.stride(0), pages.block_size, *(0,) * 6), \
            dict(PAGED=True, KV8=False, TOKEN_SCALES=False)
    strides = (*_scale_strides(pages.k_scale), *_scale_strides(pages.v_scale))
    return (table, pages.k_scale, pages.v_scale), (table.stride(0), pages.block_size, *strides), \
        dict(PAGED=True, KV8=True, TOKEN_SCALES=pages.k_scale.dim() == 3)


def _lengths(query, key, sequences: Sequences | None, pages: Pages | None = None) -> tuple[int, int]:
    """The L_Q and L_K the grid is made for: the longest sequences of a packed batch; a paged cache's
    max_blocks · block_size keys."""
    if pages is not None:
        return query.shape[2], pages.len_k
    if sequences is None:
        return query.shape[2], key.shape[2]
    return sequences.max_seqlen_q, sequences.max_seqlen_k


def _variant_args(variant, is_causal, len_q, len_k, dummy, packed=False):
    """A call's score variant (fused_attn.scores) as kernel arguments: (ALIBI pointer, its (B, H_q)
    strides, (DIAG, LEFT, RIGHT, softcap2)) and its constexprs. An unbounded side of the band gets
    L_Q + L_K (+ the diagonal's shift), which no index pair reaches. A `packed` batch gets DIAG 1 for bottom-right alignment
    (each program computes its sequence's own diagonal)."""
    left, right = variant.bounds(is_causal)
    if packed and variant.diagonal_shift:  # refused by fused_attn.varlen before it gets here
        raise ValueError("diagonal_shift: a packed batch takes each sequence's own diagonal, not an offset")
    beyond = len_q + len_k + abs(variant.diagonal_shift)
    slopes = variant.alibi_slopes
    pointer, strides = (dummy, (0, 0)) if slopes is None else (slopes, tuple(slopes.stride()))
    diagonal = int(variant.bottom_right) if packed else variant.offset(len_q, len_k)
    runtime = (diagonal, beyond if left == UNBOUNDED else left,
               beyond if right == UNBOUNDED else right, variant.softcap * LOG2E)
    constexprs = dict(BANDED=left != UNBOUNDED or right != UNBOUNDED, SOFTCAP=variant.softcap > 0.0,
                      HAS_ALIBI=slopes is not None)
    return pointer, strides, runtime, constexprs


def sink_args(variant, heads_q: int, dummy):
    """(SINKS pointer, {"HAS_SINKS": ...}) of the forward kernels: the variant's sinks, (H_q,) float32
    contiguous on the tensors' device (fused_attn.scores), or `dummy` (never read). The backward kernels
    take none: the log-sum-exp they are given holds the sinks already."""
    sinks = variant.sinks
    if sinks is None:
        return dummy, dict(HAS_SINKS=False)
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads_q,) or not sinks.is_contiguous() \
            or sinks.device != dummy.device:
        raise ValueError(f"sinks: expected a contiguous ({heads_q},) float32 tensor on {dummy.device}, got "
                         f"{sinks.dtype} of shape {tuple(sinks.shape)} on {sinks.device}")
    return sinks, dict(HAS_SINKS=True)


def program_args(variant, batch: int, heads_q: int, len_q: int, len_k: int, dummy):
    """(TILES, BITS pointers, the tiles' 4 strides) of the long-query kernels and {"HAS_PROGRAM": ...}: the
    variant's mask program (fused_attn.masks), its int32 tile states viewed as (B, H_q, NQ, NK) with any
    strides and the int32 (P, TILE, WORDS) bits of its partial tiles, contiguous; or `dummy` (never read).
    A program without partial tiles hands over `dummy` for its (empty) bits, which no state points into."""
    tiles, bits = variant.block_tiles, variant.block_bits
    if tiles is None:
        return dummy, dummy, (0, 0, 0, 0), dict(HAS_PROGRAM=False)
    shape = (batch, heads_q, triton.cdiv(len_q, masks.TILE), triton.cdiv(len_k, masks.TILE))
    if tiles.dtype != torch.int32 or tuple(tiles.shape) != shape or tiles.device != dummy.device:
        raise ValueError(f"block_tiles: expected an int32 tensor of shape {shape} on {dummy.device}, got "
                         f"{tiles.dtype} of shape {tuple(tiles.shape)} on {tiles.device}")
    row_shape = (masks.TILE, masks.WORDS)
    if bits is None or bits.dtype != torch.int32 or bits.dim() != 3 or tuple(bits.shape[1:]) != row_shape \
            or not bits.is_contiguous() or bits.device != dummy.device:
        got = "None" if bits is None else f"{bits.dtype} of shape {tuple(bits.shape)} on {bits.device}"
        raise ValueError(f"block_bits: expected a contiguous int32 tensor of shape (P, {masks.TILE}, {masks.WORDS}) "
                         f"on {dummy.device}, got {got}")
    return tiles, bits if bits.numel() else dummy, tuple(tiles.stride()), dict(HAS_PROGRAM=True)


def forward_args(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, dropout=None,
                 variant=PLAIN, sequences: Sequences | None = None, pages: Pages | None = None):
    """(positional args, constexprs) of `_attn_fwd` for one call, shared by the launch and the AOT report.
    With `pages`, key and value are the cache's `cache_blocks` views."""
    batch, heads_q, _, dim_qk = query.shape
    heads_kv, dim_v = key.shape[1], value.shape[3]
    len_q, len_k = _lengths(query, key, sequences, pages)
    page_pointers, page_values, page_constexprs = page_args(pages, lse)
    mask, kind, mask_strides, padding, padding_strides, spans = _mask_args(attn_mask, key_padding_mask, query)
    rng, drop_threshold, keep_scale = _dropout_args(dropout, lse)
    alibi, alibi_strides, variant_values, variant_constexprs = _variant_args(variant, is_causal, len_q, len_k, lse,
                                                                             sequences is not None)
    bounds, packed_constexprs = _sequence_args(sequences, lse)
    sinks, sink_constexprs = sink_args(variant, heads_q, lse)
    tiles, bits, tile_strides, program_constexprs = program_args(variant, batch, heads_q, len_q, len_k, lse)
    args = (query, key, value, out, lse, mask, padding, spans, rng, alibi, *bounds, *page_pointers, sinks, tiles, bits,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(), *lse.stride(),
            *mask_strides, *padding_strides, *alibi_strides, *page_values, *tile_strides,
            heads_q, heads_q // heads_kv, len_q, len_k, float(scale) * LOG2E,
            drop_threshold, keep_scale, *variant_values)
    constexprs = dict(D_QK=dim_qk, D_V=dim_v, BLOCK_DQK=padded_head_dim(dim_qk),
                      BLOCK_DV=padded_head_dim(dim_v), MASK_KIND=kind,
                      HAS_KPM=key_padding_mask is not None, **variant_constexprs, **packed_constexprs,
                      **page_constexprs, HAS_DROPOUT=dropout is not None, **sink_constexprs, **program_constexprs,
                      PRECISION=_precision(query.dtype))
    return args, constexprs


def preprocess_args(out, grad_out, grad_lse, delta, sequences: Sequences | None = None):
    """`delta` is (B, H_q, L_q) with a unit last stride (packed: (B, H_q, total) with batch stride 0)."""
    batch, heads_q, len_q, dim_v = out.shape
    len_q = len_q if sequences is None else sequences.max_seqlen_q
    glse, glse_strides = (grad_lse, grad_lse.stride()) if grad_lse is not None else (delta, (0, 0, 0))
    bounds, packed_constexprs = _sequence_args(sequences, delta)
    args = (out, grad_out, glse, delta, bounds[0], *out.stride(), *grad_out.stride(), *glse_strides,
            *delta.stride()[:2], heads_q, len_q)
    constexprs = dict(D_V=dim_v, BLOCK_DV=padded_head_dim(dim_v), HAS_GRAD_LSE=grad_lse is not None,
                      **packed_constexprs, BLOCK_M=PREPROCESS_BLOCK_M)
    return args, constexprs


def backward_args(kernel, query, key, value, attn_mask, key_padding_mask, is_causal, scale, grad_out, lse,
                  delta, grads, dropout=None, grad_mask=None, variant=PLAIN, sequences: Sequences | None = None):
    """(positional args, constexprs) of `_attn_bwd_dkdv` (grads = (dk, dv), and the mask's gradient
    where asked for) or `_attn_bwd_dq` (grads = (dq,))."""
    batch, heads_q, _, dim_qk = query.shape
    heads_kv, dim_v = key.shape[1], value.shape[3]
    len_q, len_k = _lengths(query, key, sequences)
    mask, kind, mask_strides, padding, padding_strides, spans = _mask_args(attn_mask, key_padding_mask, query)
    common = (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *lse.stride(),
              *mask_strides, *padding_strides)
    grad_strides = tuple(stride for grad in grads for stride in grad.stride())
    sizes = (heads_q, heads_kv) if kernel == "bwd_dkdv" else (heads_q,)
    extra = {}
    if kernel == "bwd_dkdv":  # it also writes the mask's gradient, where asked for (HAS_MASK_GRAD)
        grads = (*grads, lse if grad_mask is None else grad_mask)
        grad_strides += (0, 0, 0, 0) if grad_mask is None else tuple(grad_mask.stride())
        extra = dict(HAS_MASK_GRAD=grad_mask is not None)
    rng, drop_threshold, keep_scale = _dropout_args(dropout, lse)
    alibi, alibi_strides, variant_values, variant_constexprs = _variant_args(variant, is_causal, len_q, len_k, lse,
                                                                             sequences is not None)
    bounds, packed_constexprs = _sequence_args(sequences, lse)
    tiles, bits, tile_strides, program_constexprs = program_args(variant, batch, heads_q, len_q, len_k, lse)
    args = (query, key, value, grad_out, lse, delta, mask, padding, spans, rng, alibi, tiles, bits, *grads, *bounds,
            *common, *grad_strides, *alibi_strides, *tile_strides, *delta.stride()[:2], *sizes, heads_q // heads_kv,
            len_q, len_k, float(scale) * LOG2E, float(scale), drop_threshold, keep_scale, *variant_values)
    constexprs = dict(D_QK=dim_qk, D_V=dim_v, BLOCK_DQK=padded_head_dim(dim_qk),
                      BLOCK_DV=padded_head_dim(dim_v), MASK_KIND=kind,
                      HAS_KPM=key_padding_mask is not None, **variant_constexprs, **packed_constexprs,
                      HAS_DROPOUT=dropout is not None, **program_constexprs, **extra,
                      PRECISION=_precision(query.dtype))
    return args, constexprs


def _autotune_enabled() -> bool:
    return os.environ.get("FUSED_ATTN_TRITON_AUTOTUNE", "1") != "0"


@functools.lru_cache(maxsize=None)
def _device_limits(index: int) -> tuple[tuple[int, int], int]:
    properties = triton.runtime.driver.active.utils.get_device_properties(index)
    return torch.cuda.get_device_capability(index), properties["max_shared_mem"]


def _device_index(tensor) -> int:
    index = tensor.device.index
    return torch.cuda.current_device() if index is None else index


def _fitting(kernel, configs, tensor, constexprs):
    """The configs whose estimated shared memory fits the device of `tensor`."""
    _, max_shared = _device_limits(_device_index(tensor))
    size = tensor.element_size()
    return [config for config in configs
            if shared_memory_estimate(kernel, config, constexprs["BLOCK_DQK"], constexprs["BLOCK_DV"],
                                      size, constexprs.get("HAS_DROPOUT", False)) <= max_shared]


# Configs forced per kernel name, bypassing defaults and autotuning (see `forced_configs`).
_forced: dict[str, KernelConfig] = {}


@contextlib.contextmanager
def forced_configs(**configs: KernelConfig):
    """Within the block, launch the named kernels ("fwd", "bwd_dkdv", "bwd_dq") at these configs.

    Tests use it to cover many blocks per row and column with small problems under the interpreter.
    """
    saved = dict(_forced)
    _forced.update(configs)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def _fits_program(config: KernelConfig, constexprs) -> bool:
    """Whether a launch's blocks each lie inside one tile of its mask program, if it has one: one state
    per block (`_program_tile`) needs BLOCK_M and BLOCK_N to divide masks.TILE."""
    return not constexprs.get("HAS_PROGRAM") or max(config.block_m, config.block_n) <= masks.TILE


def _default_for(kernel, tensor, constexprs) -> KernelConfig:
    """The default config for this device, or the smallest candidate that fits it if it does not."""
    if kernel in _forced:
        return _forced[kernel]
    head_dim = max(constexprs["BLOCK_DQK"], constexprs["BLOCK_DV"])
    if tensor.device.type != "cuda":
        return default_config(kernel, "sm_80", head_dim, tensor.element_size(), constexprs)
    capability, _ = _device_limits(_device_index(tensor))
    config = default_config(kernel, arch_of(capability), head_dim, tensor.element_size(), constexprs)
    if _fitting(kernel, [config], tensor, constexprs):
        return config
    smaller = _fitting(kernel, _candidates(kernel), tensor, constexprs)
    return min(smaller, key=lambda c: (c.block_m * c.block_n, c.num_stages)) if smaller else config


AUTOTUNE_KEY = ("L_Q", "L_K", "GROUP", "D_QK", "D_V", "MASK_KIND", "HAS_KPM", "BANDED", "HAS_DROPOUT",
                "SOFTCAP", "HAS_ALIBI", "VARLEN", "HAS_PROGRAM", "PRECISION")


def autotune_key(kernel: str) -> list[str]:
    """AUTOTUNE_KEY, and the kernels' own features: the dK/dV kernel's bias gradient; the forward's 8-bit
    cache, its scales' layout and its sinks (which keep the warp-specialized variant out: a choice made without
    them must not serve a call with them)."""
    own = {"bwd_dkdv": ["HAS_MASK_GRAD"], "fwd": ["KV8", "TOKEN_SCALES", "HAS_SINKS"]}
    return list(AUTOTUNE_KEY) + own.get(kernel, [])


@functools.lru_cache(maxsize=None)
def _autotuned(kernel: str, descriptors: bool = False):
    """`kernel` autotuned over its candidates, keyed on the problem, pruned to what fits the device; with
    `descriptors` (calls the tensor-descriptor variant can serve, `descriptor_refusals`) also over that variant
    of each candidate kept, and the default's warp-specialized where Triton offers it, or over those alone
    (FUSED_ATTN_TRITON_DESCRIPTORS=1). Calls it cannot serve have an autotuner of their own: their choice is
    never the cached choice of one it can."""
    candidates = _candidates(kernel)

    def prune(configs, named_args, **constexprs):
        tensor = named_args["Q"]
        default = _default_for(kernel, tensor, constexprs)
        fitting = [c for c in _fitting(kernel, candidates, tensor, constexprs) if _fits_program(c, constexprs)]
        head_dim = max(constexprs["BLOCK_DQK"], constexprs["BLOCK_DV"])
        # Keep the neighbourhood of this head dim's default: tiles no larger than twice its own.
        near = [c for c in fitting if c.block_m * c.block_n <= 2 * default.block_m * default.block_n
                and (head_dim < 256 or c.num_stages <= 2)]
        chosen = [default] + [c for c in near if c != default]
        if descriptors:
            variants = [dataclasses.replace(c, descriptors=True) for c in chosen]
            specialized = dataclasses.replace(default, descriptors=True, warp_specialize=True)
            if kernel in WARP_SPECIALIZED_KERNELS and triton_compat.warp_specialization() \
                    and warp_specializable(constexprs) and _fitting(kernel, [specialized], tensor, constexprs):
                variants.append(specialized)
            chosen = variants if descriptor_mode() == "on" else chosen + variants
        return [c.triton_config(kernel) for c in chosen]

    # The autotuner adds the tensors' dtypes; the constexprs must be named, or a config tuned for
    # one head dim would be reused for another.
    tuner = triton.autotune(configs=[c.triton_config(kernel) for c in candidates], key=autotune_key(kernel),
                            prune_configs_by={"early_config_prune": prune})(KERNELS[kernel])
    return triton_tuning.registered(kernel + "+descriptors" * descriptors, tuner)


# Launch features under which the warp-specialized forward spills registers on sm_100 (bench/triton_report.py: the
# score variants with key padding, and mask programs, by hundreds of local loads), or which the report does not
# compile it with (masks, paged caches): the autotuner offers it only without them. The warp-specialized backward
# and decode kernel (triton_decode) are compiled, and offered, for the same calls (the decode's with sinks too:
# its combine folds them in).
# By constexpr, as the registry names the feature.
NOT_WARP_SPECIALIZED = {"SOFTCAP": "softcap", "HAS_ALIBI": "ALiBi slopes", "HAS_KPM": "key padding",
                        "HAS_SINKS": "attention sinks", "HAS_PROGRAM": "a mask program", "PAGED": "a paged cache",
                        "MASK_KIND": "an attn_mask"}
# The widest padded head dim the warp-specialized variants are offered for: at 256 the forward's and dK/dV's used local
# memory on sm_100 (336 and 16 bytes a thread at their default tiles; bench/NOTES.md section 58).
WARP_SPECIALIZED_MAX_HEAD_DIM = 128


def warp_specialization_refusal(constexprs: dict) -> str | None:
    """Why a launch with `constexprs` (at least BLOCK_DQK and BLOCK_DV) is offered no warp-specialized variant, or
    None: the autotuners' condition, and the registry's words for it."""
    found = [name for constexpr, name in NOT_WARP_SPECIALIZED.items() if constexprs.get(constexpr)]
    if found:
        return f"{', '.join(found)}: its builds spilled registers with them or were not compiled with them"
    if max(constexprs["BLOCK_DQK"], constexprs["BLOCK_DV"]) > WARP_SPECIALIZED_MAX_HEAD_DIM:
        return f"head dims over {WARP_SPECIALIZED_MAX_HEAD_DIM}: its builds used local memory there"
    return None


def warp_specializable(constexprs: dict) -> bool:
    return warp_specialization_refusal(constexprs) is None


DESCRIPTORS_VARIABLE = "FUSED_ATTN_TRITON_DESCRIPTORS"
_DESCRIPTOR_MODES = {"": "auto", "auto": "auto", "1": "on", "0": "off"}


def descriptor_mode() -> str:
    """FUSED_ATTN_TRITON_DESCRIPTORS: "auto" (unset) makes the tensor-descriptor variants (DESCRIPTOR_KERNELS)
    extra autotuning candidates on devices of DESCRIPTOR_CAPABILITY, pointers running elsewhere, at fixed configs and
    in the interpreter; "1" ("on") runs the variant in every launch it can serve (the interpreter's tests of it);
    "0" ("off") never."""
    value = os.environ.get(DESCRIPTORS_VARIABLE, "").strip().lower()
    if value not in _DESCRIPTOR_MODES:
        raise ValueError(f"{DESCRIPTORS_VARIABLE}: expected 0, 1 or auto, got {value!r}")
    return _DESCRIPTOR_MODES[value]


# Why the tensor-descriptor variant stopped being a candidate in this process: Triton failed to compile it.
_descriptor_failure: list[str] = []


def _layout_refusal(name: str, tensor: torch.Tensor) -> str | None:
    """Why a (B, H, L, D) tensor cannot be read or written through descriptors of its (L, D) matrices, or None: a
    descriptor's last stride is 1, its row stride and base address multiples of 16 bytes (each matrix's base is
    the tensor's plus whole batch and head strides)."""
    if tensor.shape[3] > 1 and tensor.stride(3) != 1:
        return f"{name}: stride {tensor.stride(3)} along the head dim, not 1"
    size = tensor.element_size()
    steps = [tensor.stride(2)] + [tensor.stride(d) for d in (0, 1) if tensor.shape[d] > 1]
    if any(stride * size % 16 for stride in steps) or tensor.data_ptr() % 16:
        return f"{name}: strides {tuple(tensor.stride())} of {size}-byte elements or address not multiples of 16 bytes"
    return None


# What a descriptor of a (batch row, head)'s matrix cannot serve.
PAGED_REFUSAL = "a paged cache: its keys are gathered through the block table, not rows of one matrix"
PACKED_REFUSAL = "a packed batch: a sequence may be empty, and a TMA descriptor needs at least one row"
# fp32 products run on FMA units (tensor cores only with TF32), where TMA relieves no bottleneck, and the descriptor
# variants hold whole fp32 tiles in registers: at their default tiles 122 of 210 builds for sm_100 used local memory,
# up to 7 KiB a thread (bench/NOTES.md, sections 57 and 58).
FLOAT32_REFUSAL = "float32 tensors: the descriptor variants' fp32 builds use local memory; fp32 runs on pointers"


def call_refusals(dtype: torch.dtype, paged: bool, packed: bool) -> list[str]:
    """What of a call, its tensors' layouts aside, keeps the descriptor variants out (empty: nothing)."""
    return [reason for reason, applies in ((PACKED_REFUSAL, packed), (PAGED_REFUSAL, paged),
                                           (FLOAT32_REFUSAL, dtype == torch.float32)) if applies]


def descriptors_unavailable(device: torch.device) -> str | None:
    """Why no call on `device` can run the tensor-descriptor variant, or None: the installed Triton, the device
    (TMA from DESCRIPTOR_CAPABILITY on; the interpreter runs them anywhere), an earlier failure to compile it."""
    if _descriptor_failure:
        return _descriptor_failure[0]
    if (missing := triton_compat.tensor_descriptors()) is not None:
        return missing
    if device.type == "cuda" and not interpreting():
        capability, _ = _device_limits(device.index if device.index is not None else torch.cuda.current_device())
        if capability < DESCRIPTOR_CAPABILITY:
            return (f"tensor descriptors (TMA) need compute capability 9.0 or newer, got "
                    f"{capability[0]}.{capability[1]}")
    return None


def descriptor_refusals(tensors: dict[str, torch.Tensor], pages: Pages | None = None,
                        sequences: Sequences | None = None) -> list[str]:
    """Why a kernel cannot read and write `tensors` ({name: (B, H, L, D) tensor}, e.g. the forward's query, key,
    value and out, or the backward's, `backward_tensors`) through tensor descriptors (`_rows_descriptor`) in this
    call (empty: it can): `descriptors_unavailable`, what a descriptor cannot follow, and each tensor's layout
    (`_layout_refusal`).
    Everything else (masks, padding, dropout, ALiBi, sinks, mask programs) is read through pointers in both
    variants."""
    first = next(iter(tensors.values()))
    reasons = []
    if (unavailable := descriptors_unavailable(first.device)) is not None:
        reasons.append(unavailable)
    reasons += call_refusals(first.dtype, paged=pages is not None, packed=sequences is not None)
    for name, tensor in tensors.items():
        if (refusal := _layout_refusal(name, tensor)) is not None:
            reasons.append(refusal)
    return reasons


def backward_tensors(query, key, value, grad_out, grads) -> dict[str, torch.Tensor]:
    """What the backward's dK/dV and dQ kernels read and write through descriptors, by name: `grads` is (dq, dk,
    dv)."""
    return dict(query=query, key=key, value=value, grad_out=grad_out, grad_query=grads[0], grad_key=grads[1],
                grad_value=grads[2])


def _served(name: str, tensors, pages, sequences) -> list[str]:
    """`descriptor_refusals` of a call, logged (debug) when the descriptor variant of `name` cannot serve it."""
    refusals = descriptor_refusals(tensors, pages, sequences)
    if refusals and logger.isEnabledFor(logging.DEBUG):
        logger.debug("fused_attn: the triton %s's descriptor variant cannot serve this call: %s", name,
                     "; ".join(refusals))
    return refusals


def tuned_with_descriptors(launch, device) -> bool:
    """Runs `launch` (an autotuner over descriptor variants) with the scratch memory descriptors take; whether it
    ran. A Triton that cannot build the variant leaves it for pointers, in this process from now on."""
    try:
        with triton_compat.scratch_allocator(device):
            launch()
        return True
    except (triton.CompilationError, RuntimeError) as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        lines = str(error).strip().splitlines() or [""]
        _descriptor_failure.append(f"triton could not build the descriptor variant "
                                   f"({type(error).__name__}: {lines[0]})")
        logger.warning("fused_attn: %s; the triton kernels run through pointers from now on", _descriptor_failure[0])
        return False


def _launch(kernel: str, programs_along, args, constexprs, tensor, descriptors: bool = False):
    """Runs `kernel`: autotuned on a GPU, at its default config in the interpreter. `descriptors`: the call can run
    the kernel's tensor-descriptor variant (`descriptor_refusals` found nothing), which FUSED_ATTN_TRITON_DESCRIPTORS
    governs (`descriptor_mode`); a forced config of that variant falls back to pointers where the call cannot."""
    mode = descriptor_mode()
    descriptors = descriptors and mode != "off"
    if tensor.device.type == "cuda" and _autotune_enabled() and not interpreting() and kernel not in _forced:
        def grid(meta):
            return (programs_along(meta["BLOCK_M"], meta["BLOCK_N"]),)
        if descriptors and tuned_with_descriptors(lambda: _autotuned(kernel, True)[grid](*args, **constexprs),
                                                  tensor.device):
            return
        _autotuned(kernel)[grid](*args, **constexprs)
        return
    config = _default_for(kernel, tensor, constexprs)
    if descriptors and mode == "on":
        config = dataclasses.replace(config, descriptors=True)
    elif config.descriptors and not descriptors:
        config = dataclasses.replace(config, descriptors=False, warp_specialize=False)
    if not _fits_program(config, constexprs):  # a forced config: the defaults all fit
        raise ValueError(f"{kernel}: {config} has blocks larger than a mask program's tiles ({masks.TILE})")
    grid = (programs_along(config.block_m, config.block_n),)
    scratch = triton_compat.scratch_allocator(tensor.device) if config.descriptors and tensor.device.type == "cuda" \
        else contextlib.nullcontext()
    with scratch:
        KERNELS[kernel][grid](*args, **constexprs, **config.constexprs(kernel), num_warps=config.num_warps,
                              num_stages=config.num_stages)


def _on_device(tensor: torch.Tensor):
    """The context to launch in: the tensors' GPU made current (Triton launches on the current one)."""
    if tensor.device.type == "cpu" and not interpreting():
        raise RuntimeError("the triton kernels were built for the GPU (TRITON_INTERPRET was not set when "
                           "fused_attn.backends.triton_kernels was first imported); CPU tensors need it")
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def new_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """Uninitialised storage for a gradient, laid out like `tensor`; the kernels write every element
    (the tests replace it by a NaN-filled allocation to check that)."""
    return torch.empty_like(tensor)


def forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out,
            dropout=None, variant=PLAIN, pages: Pages | None = None) -> torch.Tensor:
    """Writes attention into `out` (B, H_q, L_q, D_v); returns the fp32 log-sum-exp (B, H_q, L_q).
    With `pages`, key and value are the cache's `cache_blocks` views."""
    batch, heads_q, len_q, _ = query.shape
    lse = torch.empty((batch, heads_q, len_q), dtype=torch.float32, device=query.device)
    _forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, dropout, variant,
             pages=pages)
    return lse


def _forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, dropout, variant,
             sequences=None, pages=None):
    args, constexprs = forward_args(query, key, value, attn_mask, key_padding_mask, is_causal, scale,
                                    out, lse, dropout, variant, sequences, pages)
    batch, heads_q = query.shape[:2]
    len_q = query.shape[2] if sequences is None else sequences.max_seqlen_q
    refusals = _served("forward", dict(query=query, key=key, value=value, out=out), pages, sequences)
    with _on_device(query):
        _launch("fwd", lambda m, n: triton.cdiv(len_q, m) * batch * heads_q, args, constexprs, query,
                descriptors=not refusals)


def backward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, grad_out,
             grad_lse, dropout=None, grad_mask=None, variant=PLAIN):
    """(dq, dk, dv), each laid out like its input, and dS written into `grad_mask` where given;
    deterministic (no atomics, fixed summation order)."""
    batch, heads_q, len_q, _ = out.shape
    delta = torch.empty((batch, heads_q, len_q), dtype=torch.float32, device=query.device)
    grads = tuple(new_gradient(t) for t in (query, key, value))
    with _on_device(query):
        _backward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, grad_out,
                  grad_lse, dropout, grad_mask, variant, delta, grads)
    return grads


def _backward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse, grad_out,
              grad_lse, dropout, grad_mask, variant, delta, grads, sequences=None):
    """Writes `grads` (dq, dk, dv) through the preprocess, dK/dV and dQ kernels."""
    batch, heads_q = query.shape[:2]
    heads_kv = key.shape[1]
    len_q, len_k = _lengths(query, key, sequences)
    args, constexprs = preprocess_args(out, grad_out, grad_lse, delta, sequences)
    grid = (triton.cdiv(len_q, PREPROCESS_BLOCK_M) * batch * heads_q,)
    KERNELS["bwd_preprocess"][grid](*args, **constexprs, num_warps=PREPROCESS_WARPS, num_stages=1)

    grad_query, grad_key, grad_value = grads
    # One verdict for both kernels, which read and write these tensors between them.
    refusals = _served("backward", backward_tensors(query, key, value, grad_out, grads), None, sequences)
    args, constexprs = backward_args("bwd_dkdv", query, key, value, attn_mask, key_padding_mask, is_causal,
                                     scale, grad_out, lse, delta, (grad_key, grad_value), dropout, grad_mask,
                                     variant, sequences)
    _launch("bwd_dkdv", lambda m, n: triton.cdiv(len_k, n) * batch * heads_kv, args, constexprs, query,
            descriptors=not refusals)
    args, constexprs = backward_args("bwd_dq", query, key, value, attn_mask, key_padding_mask, is_causal,
                                     scale, grad_out, lse, delta, (grad_query,), dropout, variant=variant,
                                     sequences=sequences)
    _launch("bwd_dq", lambda m, n: triton.cdiv(len_q, m) * batch * heads_q, args, constexprs, query,
            descriptors=not refusals)


def longest(cu_seqlens: torch.Tensor, given: int) -> int:
    """The longest sequence: `given`, or read from the lengths (a host synchronisation on a GPU)."""
    if given >= 0:
        return given
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Sequences:
    return Sequences(cu_seqlens_q, cu_seqlens_k, longest(cu_seqlens_q, max_seqlen_q),
                     longest(cu_seqlens_k, max_seqlen_k))


def forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                   out, lse, dropout=None, variant=PLAIN):
    """A packed batch in one launch: writes `out` (total_q, H_q, D_v) and `lse` (H_q, total_q)."""
    batch = cu_seqlens_q.shape[0] - 1
    sequences = _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if batch == 0 or sequences.max_seqlen_q == 0:
        return
    q, k, v, o = (batched(t, batch) for t in (query, key, value, out))
    _forward(q, k, v, None, None, is_causal, scale, o, lse.unsqueeze(0).expand(batch, *lse.shape), dropout,
             variant, sequences)


def backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                    out, lse, grad_out, grad_lse, dropout=None, variant=PLAIN):
    """The packed gradients (dq, dk, dv) in one launch per kernel; `grad_lse` None or (H_q, total_q)."""
    batch = cu_seqlens_q.shape[0] - 1
    sequences = _sequences(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # Every token is written by the program of its sequence (a sequence without queries gets dK = dV = 0
    # from empty loops, one without keys dQ = 0), provided the grid covers each: hence the bounds.
    grads = tuple(new_gradient(t) for t in (query, key, value))
    if batch == 0 or max(sequences.max_seqlen_q, sequences.max_seqlen_k) == 0:
        for grad in grads:
            grad.zero_()
        return grads
    delta = torch.empty((query.shape[1], query.shape[0]), dtype=torch.float32, device=query.device)

    def as_batch(t):
        return None if t is None else t.unsqueeze(0).expand(batch, *t.shape)

    q, k, v, o, g = (batched(t, batch) for t in (query, key, value, out, grad_out))
    with _on_device(query):
        _backward(q, k, v, None, None, is_causal, scale, o, as_batch(lse), g, as_batch(grad_lse), dropout, None,
                  variant, as_batch(delta), tuple(batched(t, batch) for t in grads), sequences)
    return grads
