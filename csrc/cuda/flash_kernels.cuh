// FlashAttention-2 forward and backward kernels of the `cuda` backend: bodies only, no torch.
//
// One thread block of kThreads threads per (query block, head, batch) for the forward and the dQ
// pass, per (key block, key/value head, batch) for the dK/dV pass. K/V (or Q/dO) tiles are staged in
// shared memory; softmax runs online in fp32; products of fp16/bf16 tiles run on tensor cores through
// WMMA 16x16x16 fragments with fp32 accumulation, fp32 tiles on the CUDA cores. Every tile product
// reads its operands from shared memory and accumulates into fp32 shared memory, so the per-row
// rescaling of the online softmax never needs the (unspecified) register layout of a fragment.
//
// The backward is deterministic and free of atomics: a dK/dV block loops over the query blocks of
// every query head of its GQA group in a fixed order; dQ is a second kernel, one block per query
// block looping over the key blocks; delta = rowsum(dO * O) - grad_lse comes from a third. The
// gradient of an additive mask, dS, is written by the dK/dV kernel, each element once.
//
// Forward calls with few query rows (generation steps: L_q <= 16) run split-KV ("flash-decoding")
// kernels instead: one block per (batch, key/value head, split of the keys) takes the rows of the
// whole GQA group in one tile, so each K/V block is read once per group, and writes the split's
// normalised output and log-sum-exp into an fp32 workspace; a combine kernel merges the splits by
// their log-sum-exps. The split count comes from the problem and the SM count (flash_dispatch.h).
//
// Attention sinks (fused_attn/scores.py: one logit per query head that joins every row's softmax and
// carries no value) are folded in where a forward finalises a row's log-sum-exp: the long-query
// kernel's epilogue and the decode combine kernel (fold_sink). The online softmax is unchanged, so a
// call without sinks (a null pointer) runs the same code; the backward needs no change, since it
// recomputes P = exp(s - lse) with the lse the forward returned, the sink in it.
//
// Packed batches (attention_varlen) run the same forward and backward kernels, one launch each: the
// grid's batch index is the sequence, and each block reads its sequence's bounds from cu_seqlens
// itself (enter_sequence), its grid made for the longest sequences; blocks past their sequence's end
// exit at once.
//
// Mask programs (csrc/block_mask.h, fused_attn/masks.py) describe visibility per tile of kTile x kTile.
// Every kernel block (BM x BN, both dividing kTile, starting at multiples of their size) lies inside
// one program tile of each query head, so one load of its state decides the block: EMPTY, the block is
// skipped before its tiles are loaded (the same branch for every thread, so the barriers still
// match); FULL, nothing is read per score; PARTIAL, final_score tests the pair's bit. The decode
// kernel's rows belong to the G query heads of a GQA group: it skips a key block only when the tiles
// of all G heads are EMPTY there, and each row tests its own head's state.
//
// Dropout and the mask gradient are runtime arguments, as causal masking is: every instance carries
// them, so the compile report (bench/cuda_report.py) covers them. Dropout regenerates csrc/dropout.h's
// stream, one Philox block per thread and four consecutive keys, in the forward and in both backward
// kernels; nothing of size L_q x L_k is stored.
//
// The same source compiles with nvcc and, for the tests, with a host C++ compiler against
// tests/emulation/cuda_emulation.h, which defines CUDA_EMULATION and supplies the CUDA names used
// here (blocks, threads, shared memory, barriers, warp shuffles, WMMA fragments).
#pragma once

#ifndef CUDA_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../block_mask.h"
#include "../dropout.h"

#ifndef CUDA_EMULATION
// The block's dynamic shared memory (the emulation provides one buffer per emulated block instead).
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
  extern __shared__ __align__(128) unsigned char fused_attn_shared_storage[];
  return fused_attn_shared_storage;
}
#endif

namespace fused_attn_cuda {

// Head (b, h) of a (B, H, L, D) tensor: its first element, through the tensor's own strides.
template <typename T, typename Pointer>
__device__ __forceinline__ T* head_of(Pointer base, const int64_t* stride, int b, int h) {
  return static_cast<T*>(base) + b * stride[0] + h * stride[1];
}

constexpr int kThreads = 128;  // 4 warps per block, every kernel
// Every kernel is declared __launch_bounds__(kThreads, 1): at most kThreads threads and at least
// one resident block per SM (shared memory allows one to three anyway), so ptxas may use up to 255
// registers. With __launch_bounds__(kThreads) alone it spilled a few bytes in some instances.
constexpr int kWarps = kThreads / 32;
// The largest dynamic shared memory a block may use: 99 KB, the opt-in limit of sm_86 and sm_89,
// the smallest among the default targets (sm_80 allows 163 KB, sm_90 227 KB).
constexpr int kMaxSharedBytes = 99 * 1024;
constexpr int kMaxHeadDim = 256;

// Every (element type, padded head dim) the extension ships; the dispatcher (flash_dispatch.h) and
// the compile report (bench/cuda_report.py) both expand this list. Head dims are padded up to the
// next entry; the padding columns are loaded as zeros and never stored.
#define FUSED_ATTN_CUDA_FOR_EACH_INSTANCE(X)                                              \
  X(__half, 32) X(__half, 64) X(__half, 128) X(__half, 256)                               \
  X(__nv_bfloat16, 32) X(__nv_bfloat16, 64) X(__nv_bfloat16, 128) X(__nv_bfloat16, 256)   \
  X(float, 32) X(float, 64) X(float, 128) X(float, 256)

// The template head dim serving a problem whose largest head dim is `dim`; 0 if none does.
constexpr int padded_head_dim(int dim) {
  return dim <= 32 ? 32 : dim <= 64 ? 64 : dim <= 128 ? 128 : dim <= 256 ? 256 : 0;
}

// The split-KV decode kernels (flash_decode_kernel) serve forward calls of up to kDecodeMaxQueries
// query rows whose GQA group's rows, G · L_q, fit a tile of kDecodeMaxRows, at head dims up to
// kDecodeMaxHeadDim, without dropout. Their instances: the element types and head dims above, each
// with a tile of 16 or 64 rows (decode_block_m).
constexpr int kDecodeMaxQueries = 16, kDecodeMaxRows = 64, kDecodeMaxHeadDim = 128;
// Keys are split while each split keeps at least this many (and the blocks are fewer than two per SM).
constexpr int kDecodeMinKeysPerSplit = 256;

#define FUSED_ATTN_CUDA_DECODE_TILES(X, T, D) X(T, D, 16) X(T, D, 64)
#define FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE(X)                                                   \
  FUSED_ATTN_CUDA_DECODE_TILES(X, __half, 32) FUSED_ATTN_CUDA_DECODE_TILES(X, __half, 64)             \
  FUSED_ATTN_CUDA_DECODE_TILES(X, __half, 128) FUSED_ATTN_CUDA_DECODE_TILES(X, __nv_bfloat16, 32)     \
  FUSED_ATTN_CUDA_DECODE_TILES(X, __nv_bfloat16, 64) FUSED_ATTN_CUDA_DECODE_TILES(X, __nv_bfloat16, 128) \
  FUSED_ATTN_CUDA_DECODE_TILES(X, float, 32) FUSED_ATTN_CUDA_DECODE_TILES(X, float, 64)               \
  FUSED_ATTN_CUDA_DECODE_TILES(X, float, 128)

// The tile rows of the decode instance serving a GQA group of `rows` query rows.
constexpr int decode_block_m(int rows) { return rows <= 16 ? 16 : 64; }

enum MaskKind : int { kNoMask = 0, kBoolMask = 1, kAdditiveMask = 2 };

// What every kernel reads: the problem of fused_attn/problem.py, strides in elements.
struct AttentionParams {
  const void* q;  // (B, H_q, L_q, D_qk)
  const void* k;  // (B, H_kv, L_k, D_qk)
  const void* v;  // (B, H_kv, L_k, D_v)
  int64_t q_stride[4], k_stride[4], v_stride[4];
  const void* mask;  // (B, H_q, L_q, L_k) view, stride 0 where it broadcasts; bool or element type
  int mask_kind;
  int64_t mask_stride[4];
  const uint8_t* key_padding;  // (B, L_k) bool, true = ignore the key; may be null
  int64_t key_padding_stride[2];
  // With key_padding: int32 (B, 2), for each batch row [first, end) of the keys not padded; the
  // key blocks outside it are never visited, and no key outside it is loaded (KeyRows).
  const int* key_spans;
  int batch, heads_q, heads_kv, group, len_q, len_k, dim_qk, dim_v;
  float scale;
  // The band (fused_attn/scores.py): with `banded`, query i sees keys i + diagonal - window_left
  // through i + diagonal + window_right; is_causal is window_right 0, an unbounded side len_q + len_k.
  bool banded;
  int diagonal, window_left, window_right;
  float softcap;              // > 0: scaled scores become softcap * tanh(s / softcap)
  const float* alibi;         // (B, H_q) slopes, or null: adds -slope * |i + diagonal - j|
  int64_t alibi_stride[2];
  // Sinks: (H_q,) float32 natural-log logits, or null. Row i of head h takes sinks[h] as one more
  // score with no value (never dropped); only the forward kernels read it (fold_sink).
  const float* sinks;
  // Dropout: the call's (seed, offset, query_start, key_start), int64 in the tensors' memory, read by
  // the kernels themselves (no host synchronisation, so CUDA graphs replay it); null without dropout.
  const int64_t* dropout_rng;
  uint32_t drop_threshold;  // an element is dropped when its 32-bit integer is below this
  float keep_scale;         // 1 / (1 - p); 1 without dropout
  bool bottom_right;        // diagonal = len_k - len_q (each sequence's own in a packed batch) ...
  int diagonal_shift;       // ... + this (an integer alignment, fused_attn/scores.py)
  // A packed batch (fused_attn/varlen.py), or null: batch row b is sequence b, tokens
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of the (B, H, total, D) views, batch stride 0, of the packed
  // (total, H, D) tensors, keys likewise; len_q and len_k are the longest sequences (the grid's), and
  // total_q, total_k the packed tokens. No masks or key padding then. See enter_sequence.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q, total_k;
  // A mask program (csrc/block_mask.h), absent when program.tiles is null; never with a packed batch.
  fused_attn::BlockProgram program;
};

struct ForwardParams {
  AttentionParams attn;
  void* out;  // (B, H_q, L_q, D_v)
  int64_t out_stride[4];
  float* lse;  // (B, H_q, L_q)
  int64_t lse_stride[3];
};

struct BackwardParams {
  AttentionParams attn;
  const void* grad_out;  // (B, H_q, L_q, D_v)
  int64_t grad_out_stride[4];
  const float* lse;  // (B, H_q, L_q)
  int64_t lse_stride[3];
  const float* delta;  // (B, H_q, L_q): rowsum(dO * O) - grad_lse
  int64_t delta_stride[3];
  void* grad_q;
  int64_t grad_q_stride[4];
  void* grad_k;
  int64_t grad_k_stride[4];
  void* grad_v;
  int64_t grad_v_stride[4];
  void* grad_mask;  // (B, H_q, L_q, L_k) of the element type, zero-filled, or null: dS is written here
  int64_t grad_mask_stride[4];
};

// The split-KV decode: each (batch, key/value head, split of the keys) block writes its normalised
// partial output and log-sum-exp for the G · L_q rows of its query group (row r: query r % L_q of
// query head h_kv · G + r / L_q); the combine kernel merges the splits into `out` and `lse`.
struct DecodeParams {
  AttentionParams attn;
  float* part_out;  // (B, H_kv, splits, G · L_q, D_v), contiguous
  float* part_lse;  // (B, H_kv, splits, G · L_q), contiguous; -inf where the split saw no key
  int splits, keys_per_split;  // split s holds keys [s · keys_per_split, (s + 1) · keys_per_split)
};

struct CombineParams {
  const float* part_out;  // as DecodeParams
  const float* part_lse;
  void* out;  // (B, H_q, L_q, D_v)
  int64_t out_stride[4];
  float* lse;  // (B, H_q, L_q), contiguous
  const float* sinks;  // (H_q,) or null, as AttentionParams::sinks: folded in with the splits
  int batch, heads_q, heads_kv, group, len_q, dim_v, splits;
};

struct DeltaParams {
  const void* out;  // (B, H, L_q, D_v)
  int64_t out_stride[4];
  const void* grad_out;
  int64_t grad_out_stride[4];
  const float* grad_lse;  // (B, H, L_q) or null
  int64_t grad_lse_stride[3];
  float* delta;  // (B, H, L_q), contiguous
  int batch, heads, len_q, dim_v;
};

// ---- element types --------------------------------------------------------------------------

template <typename T>
struct Element;

template <>
struct Element<float> {
  static constexpr bool tensor_cores = false;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};

template <>
struct Element<__half> {
  static constexpr bool tensor_cores = true;
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};

template <>
struct Element<__nv_bfloat16> {
  static constexpr bool tensor_cores = true;
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// ---- tile configurations ----------------------------------------------------------------------

// Shared-memory row pitches: tiles of the element type get 8 extra columns (16 bytes for fp16, a
// multiple of 8 elements as WMMA requires), fp32 tiles 4, so that consecutive rows fall on other
// banks.
__host__ __device__ constexpr int pitch(int columns) { return columns + 8; }
__host__ __device__ constexpr int pitch_f32(int columns) { return columns + 4; }
// Every shared buffer starts on a 128-byte boundary (WMMA needs 32).
__host__ __device__ constexpr int buffer_bytes(int rows, int row_pitch, int element_bytes) {
  return (rows * row_pitch * element_bytes + 127) / 128 * 128;
}

__host__ __device__ constexpr int forward_shared_bytes(int e, int head, int bm, int bn) {
  return buffer_bytes(bm, pitch(head), e)            // Q
         + 2 * buffer_bytes(bn, pitch(head), e)      // K, V
         + buffer_bytes(bm, pitch_f32(bn), 4)        // S
         + buffer_bytes(bm, pitch(bn), e)            // P
         + buffer_bytes(bm, pitch_f32(head), 4)      // O accumulator
         + buffer_bytes(bm, 1, 4);                   // 1 / row sum
}

__host__ __device__ constexpr int backward_kv_shared_bytes(int e, int head, int bm, int bn) {
  return 2 * buffer_bytes(bn, pitch(head), e)        // K, V
         + 2 * buffer_bytes(bn, pitch_f32(head), 4)  // dK, dV accumulators
         + 2 * buffer_bytes(bm, pitch(head), e)      // Q, dO
         + 2 * buffer_bytes(bm, pitch_f32(bn), 4)    // S, dP
         + 2 * buffer_bytes(bm, pitch(bn), e)        // P, dS
         + 2 * buffer_bytes(bm, 1, 4);               // lse, delta
}

__host__ __device__ constexpr int backward_q_shared_bytes(int e, int head, int bm, int bn) {
  return 2 * buffer_bytes(bm, pitch(head), e)        // Q, dO
         + buffer_bytes(bm, pitch_f32(head), 4)      // dQ accumulator
         + 2 * buffer_bytes(bn, pitch(head), e)      // K, V
         + 2 * buffer_bytes(bm, pitch_f32(bn), 4)    // S, dP
         + buffer_bytes(bm, pitch(bn), e)            // dS
         + 2 * buffer_bytes(bm, 1, 4);               // lse, delta
}

enum KernelKind : int { kForwardKernel, kBackwardKVKernel, kBackwardQKernel };

struct Tile {
  int m, n;  // query rows, key rows
};

__host__ __device__ constexpr int shared_bytes_of(int kind, int e, int head, Tile t) {
  return kind == kForwardKernel     ? forward_shared_bytes(e, head, t.m, t.n)
         : kind == kBackwardKVKernel ? backward_kv_shared_bytes(e, head, t.m, t.n)
                                     : backward_q_shared_bytes(e, head, t.m, t.n);
}

// The largest tile, in this order of preference, whose shared memory fits kMaxSharedBytes. Tensor
// cores need multiples of 16; a block's kThreads threads split BM rows into groups of
// kThreads / BM lanes of one warp for the row reductions, hence BM >= 4 and a power of two.
__host__ __device__ constexpr Tile pick_tile(int kind, int element_bytes, int head, bool tensor_cores) {
  constexpr Tile candidates[] = {{64, 64}, {64, 32}, {32, 64}, {32, 32}, {64, 16},
                                 {16, 64}, {32, 16}, {16, 32}, {16, 16}, {16, 8}};
  for (Tile t : candidates) {
    if (tensor_cores && t.n % 16 != 0) continue;
    if (shared_bytes_of(kind, element_bytes, head, t) <= kMaxSharedBytes) return t;
  }
  return Tile{0, 0};
}

template <int KIND, typename T, int HEAD>
struct Config {
  static constexpr Tile tile = pick_tile(KIND, sizeof(T), HEAD, Element<T>::tensor_cores);
  static constexpr int block_m = tile.m;
  static constexpr int block_n = tile.n;
  static constexpr int shared_bytes = shared_bytes_of(KIND, sizeof(T), HEAD, tile);
  static_assert(block_m > 0, "no tile fits the shared-memory budget");
  static_assert(kThreads % block_m == 0 && kThreads / block_m <= 32, "row groups must fit a warp");
  static_assert(HEAD % 16 == 0 && block_m % 16 == 0, "tiles are made of 16x16 fragments");
  static_assert(block_n % 4 == 0, "a thread's Philox block covers four consecutive keys");
};

// The decode tile: BM query rows (a GQA group's, padded) and the forward's buffers, with the most
// keys per block of 64, 32, 16 that fit the budget.
__host__ __device__ constexpr int decode_block_n(int element_bytes, int head, int bm) {
  return forward_shared_bytes(element_bytes, head, bm, 64) <= kMaxSharedBytes   ? 64
         : forward_shared_bytes(element_bytes, head, bm, 32) <= kMaxSharedBytes ? 32
                                                                               : 16;
}

template <typename T, int HEAD, int BM>
struct DecodeConfig {
  static constexpr int block_m = BM;
  static constexpr int block_n = decode_block_n(sizeof(T), HEAD, BM);
  static constexpr int shared_bytes = forward_shared_bytes(sizeof(T), HEAD, BM, block_n);
  static_assert(shared_bytes <= kMaxSharedBytes, "no decode tile fits the shared-memory budget");
  static_assert(kThreads % BM == 0 && kThreads / BM <= 32 && BM % 16 == 0, "rows as in the forward");
};

// ---- small device helpers ---------------------------------------------------------------------

__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_int(int a, int b) { return a > b ? a : b; }

// Carves the block's dynamic shared memory into buffers, in the order of the *_shared_bytes sums.
struct SharedCarver {
  unsigned char* next;
  template <typename U>
  __device__ __forceinline__ U* take(int rows, int row_pitch) {
    U* buffer = reinterpret_cast<U*>(next);
    next += buffer_bytes(rows, row_pitch, sizeof(U));
    return buffer;
  }
};

// 16 bytes: the widest load a thread issues.
struct alignas(16) Chunk16 {
  uint32_t words[4];
};

// Loads rows [row0, row0 + ROWS) x columns [0, COLS) of a strided matrix into shared memory,
// zero-filling rows outside [row_first, row_end) and columns >= cols_valid (padding of length and head
// dim; for K and V also the keys of a batch row's padding, KeyRows): those are never read. Consecutive
// threads read consecutive columns, coalesced when the column stride is 1; then, when every row starts
// on 16 bytes and holds whole 16-byte chunks, in 16-byte loads.
template <typename T, int ROWS, int COLS>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int64_t row_stride,
                                          int64_t col_stride, int row0, int row_first, int row_end,
                                          int cols_valid) {
  constexpr int VEC = 16 / sizeof(T);
  // row_first <= row < row_end as one unsigned compare (0 <= row_first <= row_end).
  const unsigned rows_valid = static_cast<unsigned>(row_end - row_first);
  static_assert(COLS % VEC == 0, "whole chunks per tile row");
  const bool chunked = col_stride == 1 && row_stride % VEC == 0 && cols_valid % VEC == 0 &&
                       reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (chunked) {  // the same for every thread of the block
    constexpr int CHUNKS = COLS / VEC;
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += kThreads) {
      const int r = e / CHUNKS, c = e % CHUNKS * VEC, row = row0 + r;
      Chunk16 chunk = {};  // all-zero bits: 0 in every element type
      if (static_cast<unsigned>(row - row_first) < rows_valid && c < cols_valid)
        chunk = *reinterpret_cast<const Chunk16*>(src + row * row_stride + c);
      *reinterpret_cast<Chunk16*>(dst + r * ld + c) = chunk;
    }
    return;
  }
  for (int e = threadIdx.x; e < ROWS * COLS; e += kThreads) {
    const int r = e / COLS, c = e % COLS, row = row0 + r;
    T value = Element<T>::store(0.0f);
    if (static_cast<unsigned>(row - row_first) < rows_valid && c < cols_valid)
      value = src[row * row_stride + c * col_stride];
    dst[r * ld + c] = value;
  }
}

__device__ __forceinline__ void fill_f32(float* dst, int count, float value) {
  for (int e = threadIdx.x; e < count; e += kThreads) dst[e] = value;
}

// Reductions across the GROUP consecutive lanes (a power of two) that share one row.
template <int GROUP>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int offset = GROUP / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

template <int GROUP>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = GROUP / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Index of element (row, col) of a matrix stored row-major (COL false) or column-major.
template <bool COL>
__device__ __forceinline__ int at(int row, int col, int ld) {
  return COL ? col * ld + row : row * ld + col;
}

// C (M x N, fp32, row-major, pitch ldc) = or += A (M x K) * B (K x N), all in shared memory, computed
// by the whole block. A and B are row- or column-major (A_COL / B_COL): Kᵀ is K read column-major,
// Pᵀ is P read column-major. The caller synchronises before (operands ready) and after (C ready).
template <typename T, int M, int N, int K, bool A_COL, bool B_COL, bool ACCUMULATE>
__device__ __forceinline__ void block_gemm(const T* a, int lda, const T* b, int ldb, float* c,
                                           int ldc) {
  if constexpr (Element<T>::tensor_cores) {
    // Tensor cores: each warp owns whole 16x16 output tiles, in turn.
    namespace wmma = nvcuda::wmma;
    using ALayout = std::conditional_t<A_COL, wmma::col_major, wmma::row_major>;
    using BLayout = std::conditional_t<B_COL, wmma::col_major, wmma::row_major>;
    constexpr int tiles_n = N / 16, tiles = (M / 16) * tiles_n;
    for (int t = threadIdx.x / 32; t < tiles; t += kWarps) {
      const int ti = (t / tiles_n) * 16, tj = (t % tiles_n) * 16;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      if (ACCUMULATE) {
        wmma::load_matrix_sync(acc, c + ti * ldc + tj, ldc, wmma::mem_row_major);
      } else {
        wmma::fill_fragment(acc, 0.0f);
      }
#pragma unroll 2
      for (int kk = 0; kk < K; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, ALayout> a_frag;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> b_frag;
        wmma::load_matrix_sync(a_frag, a + at<A_COL>(ti, kk, lda), lda);
        wmma::load_matrix_sync(b_frag, b + at<B_COL>(kk, tj, ldb), ldb);
        wmma::mma_sync(acc, a_frag, b_frag, acc);
      }
      wmma::store_matrix_sync(c + ti * ldc + tj, acc, ldc, wmma::mem_row_major);
    }
  } else {
    // CUDA cores, exact fp32: each thread owns output elements, in turn.
    for (int e = threadIdx.x; e < M * N; e += kThreads) {
      const int i = e / N, j = e % N;
      float sum = 0.0f;
#pragma unroll 4
      for (int kk = 0; kk < K; ++kk)
        sum = fmaf(Element<T>::load(a[at<A_COL>(i, kk, lda)]),
                   Element<T>::load(b[at<B_COL>(kk, j, ldb)]), sum);
      c[i * ldc + j] = ACCUMULATE ? c[i * ldc + j] + sum : sum;
    }
  }
}

// Whether query i sees key j through the band.
__device__ __forceinline__ bool in_band(const AttentionParams& p, int i, int j) {
  const int distance = j - (i + p.diagonal);
  return !p.banded || (distance >= -p.window_left && distance <= p.window_right);
}

// The mask program's state of the tile holding query i and key j of head h (csrc/block_mask.h), or
// kTileFull without a program: nothing to test per score.
__device__ __forceinline__ int32_t program_state(const AttentionParams& p, int b, int h, int i, int j) {
  return p.program.present() ? p.program.tile(b, h, i, j) : fused_attn::kTileFull;
}

// The scaled score s of (query i, key j) as the softmax takes it (fused_attn/scores.py): capped,
// plus an additive mask and ALiBi, or -inf when the key is hidden (the band, the mask program's tile
// `state` (program_state), masks, padding, or beyond the problem). With `cap_grad`, also the cap's
// derivative 1 - tanh² there.
template <typename T>
__device__ __forceinline__ float final_score(const AttentionParams& p, float s, int b, int h, int i, int j,
                                             int32_t state, float* cap_grad = nullptr) {
  if (i >= p.len_q || j >= p.len_k || !in_band(p, i, j)) return -INFINITY;
  // A partial tile's bit, read only there (an EMPTY tile's rows reach here in the decode kernel alone).
  if (state != fused_attn::kTileFull && !p.program.sees(state, i, j)) return -INFINITY;
  if (p.key_padding != nullptr &&
      p.key_padding[b * p.key_padding_stride[0] + j * p.key_padding_stride[1]])
    return -INFINITY;
  if (p.softcap > 0.0f) {
    const float t = tanhf(s / p.softcap);
    s = p.softcap * t;
    if (cap_grad != nullptr) *cap_grad = 1.0f - t * t;
  }
  if (p.mask_kind != kNoMask) {
    const int64_t offset = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] +
                           j * p.mask_stride[3];
    if (p.mask_kind == kBoolMask && !static_cast<const uint8_t*>(p.mask)[offset]) return -INFINITY;
    if (p.mask_kind == kAdditiveMask) s += Element<T>::load(static_cast<const T*>(p.mask)[offset]);
  }
  if (p.alibi != nullptr) {
    const float slope = p.alibi[b * p.alibi_stride[0] + h * p.alibi_stride[1]];
    s -= slope * fabsf(static_cast<float>(i + p.diagonal - j));
  }
  return s;
}

// The key blocks (of BN keys) queries first_row .. last_row see through the band: [begin, end).
// Within the span of keys of batch row b that its padding leaves; begin stays a multiple of BN.
template <int BN>
__device__ __forceinline__ void key_blocks_of(const AttentionParams& p, int b, int first_row, int last_row,
                                              int& begin, int& end) {
  begin = 0;
  end = p.len_k;
  if (p.banded) {
    begin = max_int(0, first_row + p.diagonal - p.window_left) / BN * BN;
    end = max_int(0, min_int(p.len_k, last_row + p.diagonal + p.window_right + 1));
  }
  if (p.key_spans != nullptr) {
    begin = max_int(begin, p.key_spans[2 * b] / BN * BN);
    end = min_int(end, p.key_spans[2 * b + 1]);
  }
}

// The keys of batch row b whose K and V may be loaded, [first, end): its span of unpadded keys with
// key padding, so that no padded key is read, not even in the key blocks holding the span's first and
// last keys (key_blocks_of rounds the first down to a block), else every key. Padded keys may hold
// anything (NaN, inf: an unwritten cache region), which 0 · NaN would carry into the outputs.
struct KeyRows {
  int first, end;
};

__device__ __forceinline__ KeyRows key_rows_of(const AttentionParams& p, int b) {
  if (p.key_spans == nullptr) return {0, p.len_k};
  return {p.key_spans[2 * b], p.key_spans[2 * b + 1]};
}

// Where a packed batch's sequence starts in the packed tensors.
struct SequenceStart {
  int64_t q, k;  // first query token, first key token
};

// In a packed batch (cu_seqlens_q set), makes `p` the problem of sequence b: q, k and v start at its
// tokens, its own lengths replace the longest (clamped to them and to the packed tensors, so that
// bounds that break the contract, which is checked on the device before the kernels run, never lead
// outside the tensors) and the bottom-right diagonal becomes its own. Returns its first tokens, where
// the caller's outputs start; {0, 0} for an ordinary batch, whose `p` is left as it is.
template <typename T>
__device__ __forceinline__ SequenceStart enter_sequence(AttentionParams& p, int b) {
  if (p.cu_seqlens_q == nullptr) return {0, 0};
  const int q0 = min_int(max_int(p.cu_seqlens_q[b], 0), p.total_q);
  const int k0 = min_int(max_int(p.cu_seqlens_k[b], 0), p.total_k);
  p.len_q = max_int(0, min_int(min_int(p.cu_seqlens_q[b + 1], p.total_q) - q0, p.len_q));
  p.len_k = max_int(0, min_int(min_int(p.cu_seqlens_k[b + 1], p.total_k) - k0, p.len_k));
  p.diagonal = (p.bottom_right ? p.len_k - p.len_q : 0) + p.diagonal_shift;
  p.q = static_cast<const T*>(p.q) + q0 * p.q_stride[2];
  p.k = static_cast<const T*>(p.k) + k0 * p.k_stride[2];
  p.v = static_cast<const T*>(p.v) + k0 * p.v_stride[2];
  return {q0, k0};
}

// Dropout's keep/drop decisions as a thread regenerates them (csrc/dropout.h): seed, offset and
// positions are read once per kernel.
struct DropoutStream {
  bool enabled;
  uint32_t key0, key1, offset, threshold;
  int first_head;  // b * H_q: the counter's head index of head 0
  int64_t query_start, key_start;  // the stream's positions of query 0 and key 0

  static __device__ __forceinline__ DropoutStream none() { return {false, 0, 0, 0, 0, 0, 0, 0}; }

  // The stream of batch row b. Sequence b of a packed batch drops what a one-sequence call (batch
  // row 0) with offset + b drops (fused_attn/varlen.py).
  static __device__ __forceinline__ DropoutStream of(const AttentionParams& p, int b) {
    if (p.dropout_rng == nullptr) return none();
    const bool packed = p.cu_seqlens_q != nullptr;
    const uint64_t seed = static_cast<uint64_t>(p.dropout_rng[0]);
    const uint64_t offset = static_cast<uint64_t>(p.dropout_rng[1]) + (packed ? b : 0);
    return {true, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(offset),
            p.drop_threshold, packed ? 0 : b * p.heads_q, p.dropout_rng[2], p.dropout_rng[3]};
  }

  // Bit c is set when key j4 + c of query i in query head h is kept (j4 a multiple of 4). The four keys
  // are the four outputs of one Philox block when key_start is a multiple of 4 too, else they straddle
  // two blocks.
  __device__ __forceinline__ unsigned kept4(int h, int i, int j4) const {
    if (!enabled) return 0xFu;
    const int64_t first = key_start + j4;
    const uint32_t row = static_cast<uint32_t>(query_start + i);
    const unsigned low = kept_block(h, row, first / 4);
    const int lane = static_cast<int>(first % 4);
    if (lane == 0) return low;
    return ((low >> lane) | (kept_block(h, row, first / 4 + 1) << (4 - lane))) & 0xFu;
  }

  // Bit c is set when key 4 * block + c of the stream's row `row` is kept.
  __device__ __forceinline__ unsigned kept_block(int h, uint32_t row, int64_t block) const {
    uint32_t c0[1] = {static_cast<uint32_t>(block)}, c1[1] = {row};
    uint32_t c2[1] = {static_cast<uint32_t>(first_head + h)}, c3[1] = {offset};
    fused_attn::philox4x32_10_blocks<1>(c0, c1, c2, c3, key0, key1);
    return static_cast<unsigned>(c0[0] >= threshold) | static_cast<unsigned>(c1[0] >= threshold) << 1 |
           static_cast<unsigned>(c2[0] >= threshold) << 2 | static_cast<unsigned>(c3[0] >= threshold) << 3;
  }
};

// ---- forward ----------------------------------------------------------------------------------

// Folds a sink (AttentionParams::sinks) into a row's finished online softmax: the logit joins the
// row's running max and sum (the sum relative to the max) as one more score whose column carries no
// value, m' = max(m, sink), l' = l·exp(m − m') + exp(sink − m'). Returns exp(m − m'), the factor of the
// row's accumulated output. A sink of -inf changes nothing; a row that saw no key gets max sink, sum 1
// and factor 0 (output 0, log-sum-exp sink).
__device__ __forceinline__ float fold_sink(float sink, float& row_max, float& row_sum) {
  const float new_max = fmaxf(row_max, sink);
  if (new_max == -INFINITY) return 1.0f;  // no key and a sink of -inf: nothing to fold (no NaN)
  const float rescale = expf(row_max - new_max);
  row_sum = fmaf(row_sum, rescale, expf(sink - new_max));
  row_max = new_max;
  return rescale;
}

// The shared memory of a forward tile of BM query rows against blocks of BN keys, carved in the
// order of forward_shared_bytes: the long-query forward and the decode kernel use the same.
template <typename T, int HEAD, int BM, int BN>
struct ForwardTiles {
  static constexpr int LD = pitch(HEAD), LDS = pitch_f32(BN), LDP = pitch(BN), LDO = pitch_f32(HEAD);
  static constexpr int LANES = kThreads / BM;  // consecutive threads of one warp sharing a row
  T* q;
  T* k;
  T* v;
  float* s;
  T* p;
  float* o;         // the output accumulator
  float* inv_sum;   // per row: what the accumulator is multiplied by when stored

  __device__ __forceinline__ explicit ForwardTiles(unsigned char* memory) {
    SharedCarver shared{memory};
    q = shared.take<T>(BM, LD);
    k = shared.take<T>(BN, LD);
    v = shared.take<T>(BN, LD);
    s = shared.take<float>(BM, LDS);
    p = shared.take<T>(BM, LDP);
    o = shared.take<float>(BM, LDO);
    inv_sum = shared.take<float>(BM, 1);
  }
};

// The rows of a forward block as the mask program sees them: queries of the program's tile row
// m0 / kTile of the query heads [h_first, h_first + heads): one head in the long-query forward, the GQA
// group in the decode kernel.
struct BlockRows {
  int h_first, heads, m0;
};

// Whether a forward block visits the key block starting at n0: not when the program's tiles of all its
// rows' heads are EMPTY there. A function of the block's rows alone, so every thread takes the same branch.
__device__ __forceinline__ bool visits(const AttentionParams& p, int b, const BlockRows& rows, int n0) {
  if (!p.program.present()) return true;
  for (int h = rows.h_first; h < rows.h_first + rows.heads; ++h)
    if (p.program.tile(b, h, rows.m0, n0) != fused_attn::kTileEmpty) return true;
  return false;
}

// The online softmax of the BM query rows staged in tiles.q over the key blocks [n_begin, n_end) of
// key/value head (k, v) that the block visits (`rows`): O (tiles.o, zeroed by the caller) accumulates
// the unnormalised output. The calling thread's row of the tile is query i of query head h (i >= len_q:
// no query, every score -inf); its running max and sum come back in row_max and row_sum, the sum of the
// undropped weights.
template <typename T, int HEAD, int BM, int BN>
__device__ __forceinline__ void attend_key_blocks(const AttentionParams& p, const ForwardTiles<T, HEAD, BM, BN>& tiles,
                                                  const T* k, const T* v, int b, const BlockRows& rows, int h, int i,
                                                  int n_begin, int n_end, const DropoutStream& dropout,
                                                  float& row_max, float& row_sum) {
  using Tiles = ForwardTiles<T, HEAD, BM, BN>;
  constexpr int LD = Tiles::LD, LDS = Tiles::LDS, LDP = Tiles::LDP, LDO = Tiles::LDO, LANES = Tiles::LANES;
  const int row = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  const KeyRows keys = key_rows_of(p, b);
  row_max = -INFINITY;
  row_sum = 0.0f;
  for (int n0 = n_begin; n0 < n_end; n0 += BN) {
    if (!visits(p, b, rows, n0)) continue;  // before any load or barrier, on every thread alike
    const int32_t state = program_state(p, b, h, i, n0);
    load_tile<T, BN, HEAD>(tiles.k, LD, k, p.k_stride[2], p.k_stride[3], n0, keys.first, keys.end, p.dim_qk);
    load_tile<T, BN, HEAD>(tiles.v, LD, v, p.v_stride[2], p.v_stride[3], n0, keys.first, keys.end, p.dim_v);
    __syncthreads();
    block_gemm<T, BM, BN, HEAD, false, true, false>(tiles.q, LD, tiles.k, LD, tiles.s, LDS);  // S = Q Kᵀ
    __syncthreads();

    float* s_row = tiles.s + row * LDS;
    float tile_max = -INFINITY;
    for (int j = lane; j < BN; j += LANES) {
      const float s = final_score<T>(p, s_row[j] * p.scale, b, h, i, n0 + j, state);
      s_row[j] = s;
      tile_max = fmaxf(tile_max, s);
    }
    const float new_max = fmaxf(row_max, group_max<LANES>(tile_max));
    // A row that has seen no key yet keeps max -inf: exponentiate against 0 so that exp gives 0,
    // not NaN.
    const float reference = new_max == -INFINITY ? 0.0f : new_max;
    const float rescale = expf(row_max - reference);
    // Four consecutive keys per thread: one Philox block gives their dropout decisions. The sum is
    // of the undropped weights; the kept ones are scaled once, at the end.
    float tile_sum = 0.0f;
    for (int j4 = lane * 4; j4 < BN; j4 += LANES * 4) {
      const unsigned kept = dropout.kept4(h, i, n0 + j4);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float probability = expf(s_row[j4 + c] - reference);
        tile_sum += probability;
        tiles.p[row * LDP + j4 + c] = Element<T>::store(kept >> c & 1u ? probability : 0.0f);
      }
    }
    row_sum = row_sum * rescale + group_sum<LANES>(tile_sum);
    row_max = new_max;
    for (int d = lane; d < HEAD; d += LANES) tiles.o[row * LDO + d] *= rescale;
    __syncthreads();
    block_gemm<T, BM, HEAD, BN, false, false, true>(tiles.p, LDP, tiles.v, LD, tiles.o, LDO);  // O += P V
    __syncthreads();
  }
}

template <typename T, int HEAD>
__global__ void __launch_bounds__(kThreads, 1) flash_forward_kernel(const ForwardParams params) {
  using Cfg = Config<kForwardKernel, T, HEAD>;
  constexpr int BM = Cfg::block_m, BN = Cfg::block_n;
  using Tiles = ForwardTiles<T, HEAD, BM, BN>;
  const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
  AttentionParams p = params.attn;
  const SequenceStart start = enter_sequence<T>(p, b);
  if (m0 >= p.len_q) return;  // past its sequence's end: a packed batch's grid is made for the longest
  const int h_kv = h / p.group;

  const Tiles tiles(dynamic_shared_memory());
  const T* q = head_of<const T>(p.q, p.q_stride, b, h);
  load_tile<T, BM, HEAD>(tiles.q, Tiles::LD, q, p.q_stride[2], p.q_stride[3], m0, 0, p.len_q, p.dim_qk);
  fill_f32(tiles.o, BM * Tiles::LDO, 0.0f);

  const int row = threadIdx.x / Tiles::LANES, lane = threadIdx.x % Tiles::LANES, i = m0 + row;
  // Key blocks wholly outside the band of these rows are skipped.
  int n_begin, n_end;
  key_blocks_of<BN>(p, b, m0, m0 + BM - 1, n_begin, n_end);
  float row_max, row_sum;
  attend_key_blocks<T, HEAD, BM, BN>(p, tiles, head_of<const T>(p.k, p.k_stride, b, h_kv),
                                     head_of<const T>(p.v, p.v_stride, b, h_kv), b, BlockRows{h, 1, m0}, h, i,
                                     n_begin, n_end, DropoutStream::of(p, b), row_max, row_sum);

  // The sink joins the row here; a row that saw no key (nor a sink): output 0, log-sum-exp -inf. A NaN score makes the
  // sum NaN (fmaxf passes over it, its exp does not): the row's output and log-sum-exp are NaN, as SDPA's.
  if (lane == 0) {
    const float rescale = p.sinks != nullptr ? fold_sink(p.sinks[h], row_max, row_sum) : 1.0f;
    tiles.inv_sum[row] = row_sum != 0.0f ? p.keep_scale * rescale / row_sum : 0.0f;
    if (i < p.len_q)
      params.lse[b * params.lse_stride[0] + h * params.lse_stride[1] + (start.q + i) * params.lse_stride[2]] =
          row_sum != 0.0f ? row_max + logf(row_sum) : -INFINITY;
  }
  __syncthreads();
  T* out = head_of<T>(params.out, params.out_stride, b, h) + start.q * params.out_stride[2];
  for (int e = threadIdx.x; e < BM * HEAD; e += kThreads) {
    const int r = e / HEAD, d = e % HEAD;
    if (m0 + r < p.len_q && d < p.dim_v)
      out[(m0 + r) * params.out_stride[2] + d * params.out_stride[3]] =
          Element<T>::store(tiles.o[r * Tiles::LDO + d] * tiles.inv_sum[r]);
  }
}

// ---- split-KV decode ---------------------------------------------------------------------------

// One split of the keys for the query group of key/value head h_kv: all G · L_q rows in one tile, so
// each K/V block is read once for the group. Writes the split's normalised output and log-sum-exp.
template <typename T, int HEAD, int BM>
__global__ void __launch_bounds__(kThreads, 1) flash_decode_kernel(const DecodeParams params) {
  constexpr int BN = DecodeConfig<T, HEAD, BM>::block_n;
  using Tiles = ForwardTiles<T, HEAD, BM, BN>;
  const AttentionParams& p = params.attn;
  const int split = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z, rows = p.group * p.len_q;

  const Tiles tiles(dynamic_shared_memory());
  // Row r of the tile is query r % L_q of query head h_kv * G + r / L_q; rows past the group's are 0.
  for (int e = threadIdx.x; e < BM * HEAD; e += kThreads) {
    const int r = e / HEAD, d = e % HEAD;
    T value = Element<T>::store(0.0f);
    if (r < rows && d < p.dim_qk)
      value = head_of<const T>(p.q, p.q_stride, b, h_kv * p.group + r / p.len_q)[(r % p.len_q) * p.q_stride[2] +
                                                                                 d * p.q_stride[3]];
    tiles.q[r * Tiles::LD + d] = value;
  }
  fill_f32(tiles.o, BM * Tiles::LDO, 0.0f);

  const int row = threadIdx.x / Tiles::LANES, lane = threadIdx.x % Tiles::LANES;
  const bool has_row = row < rows;
  const int h = h_kv * p.group + (has_row ? row / p.len_q : 0), i = has_row ? row % p.len_q : p.len_q;
  // The keys of this split that any of the L_q queries sees.
  int n_begin, n_end;
  key_blocks_of<BN>(p, b, 0, p.len_q - 1, n_begin, n_end);
  n_begin = max_int(n_begin, split * params.keys_per_split);
  n_end = min_int(n_end, (split + 1) * params.keys_per_split);
  float row_max, row_sum;
  // Every query lies in the program's first tile row (L_q <= kDecodeMaxQueries < kTile).
  attend_key_blocks<T, HEAD, BM, BN>(p, tiles, head_of<const T>(p.k, p.k_stride, b, h_kv),
                                     head_of<const T>(p.v, p.v_stride, b, h_kv), b,
                                     BlockRows{h_kv * p.group, p.group, 0}, h, i, n_begin, n_end,
                                     DropoutStream::none(), row_max, row_sum);

  const int64_t part = (static_cast<int64_t>(b) * p.heads_kv + h_kv) * params.splits + split;
  if (lane == 0) {
    tiles.inv_sum[row] = row_sum != 0.0f ? 1.0f / row_sum : 0.0f;
    if (has_row) params.part_lse[part * rows + row] = row_sum != 0.0f ? row_max + logf(row_sum) : -INFINITY;
  }
  __syncthreads();
  float* part_out = params.part_out + part * rows * p.dim_v;
  for (int e = threadIdx.x; e < BM * HEAD; e += kThreads) {
    const int r = e / HEAD, d = e % HEAD;
    if (r < rows && d < p.dim_v) part_out[r * p.dim_v + d] = tiles.o[r * Tiles::LDO + d] * tiles.inv_sum[r];
  }
}

// One warp per query row (b, h, i): the splits' outputs weighted by exp(lse_s - max) / sum (0 for a
// split that saw no key); the row's log-sum-exp max + log(sum), -inf when no split saw a key. The
// row's sink, if any, joins the sum here (fold_sink), as one more split with output 0.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_decode_combine_kernel(const CombineParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.batch) * p.heads_q * p.len_q) return;  // the whole warp leaves together
  const int i = static_cast<int>(row % p.len_q);
  const int h = static_cast<int>(row / p.len_q % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.len_q) * p.heads_q));
  const int rows = p.group * p.len_q;
  // Split s of this row: part_lse[first + s * rows], part_out[(first + s * rows) * D_v + d].
  const int64_t first = (static_cast<int64_t>(b) * p.heads_kv + h / p.group) * p.splits * rows +
                        (h % p.group) * p.len_q + i;
  float largest = -INFINITY;
  for (int s = lane; s < p.splits; s += 32)
    largest = fmaxf(largest, p.part_lse[first + static_cast<int64_t>(s) * rows]);
  largest = group_max<32>(largest);
  const float reference = largest == -INFINITY ? 0.0f : largest;
  float total = 0.0f;
  for (int s = lane; s < p.splits; s += 32)
    total += expf(p.part_lse[first + static_cast<int64_t>(s) * rows] - reference);
  total = group_sum<32>(total);
  const float rescale = p.sinks != nullptr ? fold_sink(p.sinks[h], largest, total) : 1.0f;
  const float inv_total = total != 0.0f ? rescale / total : 0.0f;
  T* out = head_of<T>(p.out, p.out_stride, b, h) + i * p.out_stride[2];
  for (int d = lane; d < p.dim_v; d += 32) {
    float sum = 0.0f;
    for (int s = 0; s < p.splits; ++s) {
      const int64_t part = first + static_cast<int64_t>(s) * rows;
      sum = fmaf(expf(p.part_lse[part] - reference), p.part_out[part * p.dim_v + d], sum);
    }
    out[d * p.out_stride[3]] = Element<T>::store(sum * inv_total);
  }
  if (lane == 0) p.lse[row] = total != 0.0f ? largest + logf(total) : -INFINITY;
}

// ---- backward ---------------------------------------------------------------------------------

// delta = rowsum(dO * O) - grad_lse, one warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) flash_backward_delta_kernel(const DeltaParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.len_q;
  if (row >= rows) return;  // the whole warp leaves together
  const int i = static_cast<int>(row % p.len_q);
  const int h = static_cast<int>(row / p.len_q % p.heads);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.len_q) * p.heads));
  const T* out = head_of<const T>(p.out, p.out_stride, b, h) + i * p.out_stride[2];
  const T* grad_out =
      head_of<const T>(p.grad_out, p.grad_out_stride, b, h) + i * p.grad_out_stride[2];
  float sum = 0.0f;
  for (int d = lane; d < p.dim_v; d += 32)
    sum = fmaf(Element<T>::load(out[d * p.out_stride[3]]),
               Element<T>::load(grad_out[d * p.grad_out_stride[3]]), sum);
  sum = group_sum<32>(sum);
  if (lane == 0) {
    if (p.grad_lse != nullptr)
      sum -= p.grad_lse[b * p.grad_lse_stride[0] + h * p.grad_lse_stride[1] +
                        i * p.grad_lse_stride[2]];
    p.delta[row] = sum;
  }
}

// Loads the log-sum-exp and delta of rows [m0, m0 + BM) of head h of problem `p` (a sequence's,
// whose rows start at token q_start); rows past the end get lse -inf, so that their probabilities,
// and so their gradients, are 0.
template <int BM>
__device__ __forceinline__ void load_row_stats(const BackwardParams& params, const AttentionParams& p, int b,
                                               int h, int m0, int64_t q_start, float* lse_s, float* delta_s) {
  for (int r = threadIdx.x; r < BM; r += kThreads) {
    const int i = m0 + r;
    const bool valid = i < p.len_q;
    const int64_t row = q_start + i;
    lse_s[r] = valid ? params.lse[b * params.lse_stride[0] + h * params.lse_stride[1] + row * params.lse_stride[2]]
                     : -INFINITY;
    delta_s[r] = valid ? params.delta[b * params.delta_stride[0] + h * params.delta_stride[1] +
                                      row * params.delta_stride[2]]
                       : 0.0f;
  }
}

// From S = Q Kᵀ and dP = dO Vᵀ of a (BM x BN) tile: P = exp(scale * S + bias - lse) and
// dS = P * (dP - delta), stored in the element type for the next tile products (P only if p_s).
// With dropout, O = (Z ∘ P / (1 - p)) V for the keep mask Z: the stored P is Z ∘ P (dV scales by
// 1 / (1 - p) at the end) and the gradient of the undropped weights is Z ∘ dP / (1 - p). With a
// `grad_mask` (the dK/dV kernel's tiles), dS is also written there: the gradient of the mask. `state`:
// the mask program's state of the tile (program_state; never EMPTY, those tiles are skipped).
template <typename T, int BM, int BN>
__device__ __forceinline__ void probabilities_and_grads(const BackwardParams& params, const AttentionParams& p,
                                                        int b, int h, int m0, int n0, int32_t state, const float* s_s,
                                                        const float* dp_s, int lds,
                                                        const float* lse_s, const float* delta_s,
                                                        T* p_s, T* ds_s, int ldp, T* grad_mask) {
  const DropoutStream dropout = DropoutStream::of(p, b);
  for (int e = threadIdx.x; e < BM * BN / 4; e += kThreads) {
    const int r = e / (BN / 4), j4 = e % (BN / 4) * 4, i = m0 + r;
    const unsigned kept = dropout.kept4(h, i, n0 + j4);
    const float lse = lse_s[r];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = j4 + c;
      float cap_grad = 1.0f;
      const float s = final_score<T>(p, s_s[r * lds + j] * p.scale, b, h, i, n0 + j, state, &cap_grad);
      // lse -inf: the row sees no key, its gradients are 0 (never exp(-inf - -inf) = NaN).
      const float probability = (lse == -INFINITY || s == -INFINITY) ? 0.0f : expf(s - lse);
      const bool keep = kept >> c & 1u;
      const float grad_p = keep ? dp_s[r * lds + j] * p.keep_scale : 0.0f;
      // The gradient of the final score (the mask's), then of the scaled score through the cap.
      const float grad_s = probability * (grad_p - delta_s[r]);
      if (p_s != nullptr) p_s[r * ldp + j] = Element<T>::store(keep ? probability : 0.0f);
      ds_s[r * ldp + j] = Element<T>::store(grad_s * cap_grad);
      if (grad_mask != nullptr && i < p.len_q && n0 + j < p.len_k)
        grad_mask[i * params.grad_mask_stride[2] + (n0 + j) * params.grad_mask_stride[3]] =
            Element<T>::store(grad_s);
    }
  }
}

// dK and dV of one key block: loops over the query blocks of each query head of the GQA group, in
// a fixed order, so the sums are the same on every run.
template <typename T, int HEAD>
__global__ void __launch_bounds__(kThreads, 1)
    flash_backward_dkdv_kernel(const BackwardParams params) {
  using Cfg = Config<kBackwardKVKernel, T, HEAD>;
  constexpr int BM = Cfg::block_m, BN = Cfg::block_n;
  constexpr int LD = pitch(HEAD), LDA = pitch_f32(HEAD), LDS = pitch_f32(BN), LDP = pitch(BN);
  const int n0 = blockIdx.x * BN, h_kv = blockIdx.y, b = blockIdx.z;
  AttentionParams p = params.attn;
  const SequenceStart start = enter_sequence<T>(p, b);
  if (n0 >= p.len_k) return;  // past its sequence's end: a packed batch's grid is made for the longest

  SharedCarver shared{dynamic_shared_memory()};
  T* k_s = shared.take<T>(BN, LD);
  T* v_s = shared.take<T>(BN, LD);
  float* dk_s = shared.take<float>(BN, LDA);
  float* dv_s = shared.take<float>(BN, LDA);
  T* q_s = shared.take<T>(BM, LD);
  T* do_s = shared.take<T>(BM, LD);
  float* s_s = shared.take<float>(BM, LDS);
  float* dp_s = shared.take<float>(BM, LDS);
  T* p_s = shared.take<T>(BM, LDP);
  T* ds_s = shared.take<T>(BM, LDP);
  float* lse_s = shared.take<float>(BM, 1);
  float* delta_s = shared.take<float>(BM, 1);

  const T* k = head_of<const T>(p.k, p.k_stride, b, h_kv);
  const T* v = head_of<const T>(p.v, p.v_stride, b, h_kv);
  const KeyRows keys = key_rows_of(p, b);
  load_tile<T, BN, HEAD>(k_s, LD, k, p.k_stride[2], p.k_stride[3], n0, keys.first, keys.end, p.dim_qk);
  load_tile<T, BN, HEAD>(v_s, LD, v, p.v_stride[2], p.v_stride[3], n0, keys.first, keys.end, p.dim_v);
  fill_f32(dk_s, BN * LDA, 0.0f);
  fill_f32(dv_s, BN * LDA, 0.0f);

  // Query blocks wholly outside the band of these keys are skipped: query i sees key j iff
  // j - diagonal - window_right <= i <= j - diagonal + window_left.
  int m_begin = 0, m_end = p.len_q;
  if (p.banded) {
    m_begin = max_int(0, n0 - p.diagonal - p.window_right) / BM * BM;
    m_end = max_int(0, min_int(p.len_q, n0 + BN - 1 - p.diagonal + p.window_left + 1));
  }
  // A block of padding only meets no query: its dK and dV are 0.
  if (keys.end <= n0 || keys.first >= n0 + BN) m_end = m_begin;
  for (int g = 0; g < p.group; ++g) {
    const int h = h_kv * p.group + g;
    const T* q = head_of<const T>(p.q, p.q_stride, b, h);
    const T* grad_out =
        head_of<const T>(params.grad_out, params.grad_out_stride, b, h) + start.q * params.grad_out_stride[2];
    T* grad_mask = params.grad_mask == nullptr
                       ? nullptr
                       : head_of<T>(params.grad_mask, params.grad_mask_stride, b, h);
    for (int m0 = m_begin; m0 < m_end; m0 += BM) {
      const int32_t state = program_state(p, b, h, m0, n0);
      // The same state for every thread: the skip is taken before any load or barrier by all of them.
      if (state == fused_attn::kTileEmpty) continue;
      load_tile<T, BM, HEAD>(q_s, LD, q, p.q_stride[2], p.q_stride[3], m0, 0, p.len_q, p.dim_qk);
      load_tile<T, BM, HEAD>(do_s, LD, grad_out, params.grad_out_stride[2],
                             params.grad_out_stride[3], m0, 0, p.len_q, p.dim_v);
      load_row_stats<BM>(params, p, b, h, m0, start.q, lse_s, delta_s);
      __syncthreads();
      block_gemm<T, BM, BN, HEAD, false, true, false>(q_s, LD, k_s, LD, s_s, LDS);    // Q Kᵀ
      block_gemm<T, BM, BN, HEAD, false, true, false>(do_s, LD, v_s, LD, dp_s, LDS);  // dO Vᵀ
      __syncthreads();
      probabilities_and_grads<T, BM, BN>(params, p, b, h, m0, n0, state, s_s, dp_s, LDS, lse_s, delta_s, p_s,
                                         ds_s, LDP, grad_mask);
      __syncthreads();
      block_gemm<T, BN, HEAD, BM, true, false, true>(p_s, LDP, do_s, LD, dv_s, LDA);  // += Pᵀ dO
      block_gemm<T, BN, HEAD, BM, true, false, true>(ds_s, LDP, q_s, LD, dk_s, LDA);  // += dSᵀ Q
      __syncthreads();
    }
  }
  __syncthreads();  // the accumulators are complete even when no query block was visited

  T* grad_k = head_of<T>(params.grad_k, params.grad_k_stride, b, h_kv) + start.k * params.grad_k_stride[2];
  T* grad_v = head_of<T>(params.grad_v, params.grad_v_stride, b, h_kv) + start.k * params.grad_v_stride[2];
  for (int e = threadIdx.x; e < BN * HEAD; e += kThreads) {
    const int r = e / HEAD, d = e % HEAD, n = n0 + r;
    if (n >= p.len_k) continue;
    if (d < p.dim_qk)
      grad_k[n * params.grad_k_stride[2] + d * params.grad_k_stride[3]] =
          Element<T>::store(dk_s[r * LDA + d] * p.scale);
    if (d < p.dim_v)
      grad_v[n * params.grad_v_stride[2] + d * params.grad_v_stride[3]] =
          Element<T>::store(dv_s[r * LDA + d] * p.keep_scale);
  }
}

// dQ of one query block: loops over the key blocks it sees.
template <typename T, int HEAD>
__global__ void __launch_bounds__(kThreads, 1) flash_backward_dq_kernel(const BackwardParams params) {
  using Cfg = Config<kBackwardQKernel, T, HEAD>;
  constexpr int BM = Cfg::block_m, BN = Cfg::block_n;
  constexpr int LD = pitch(HEAD), LDA = pitch_f32(HEAD), LDS = pitch_f32(BN), LDP = pitch(BN);
  const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
  AttentionParams p = params.attn;
  const SequenceStart start = enter_sequence<T>(p, b);
  if (m0 >= p.len_q) return;  // past its sequence's end: a packed batch's grid is made for the longest
  const int h_kv = h / p.group;

  SharedCarver shared{dynamic_shared_memory()};
  T* q_s = shared.take<T>(BM, LD);
  T* do_s = shared.take<T>(BM, LD);
  float* dq_s = shared.take<float>(BM, LDA);
  T* k_s = shared.take<T>(BN, LD);
  T* v_s = shared.take<T>(BN, LD);
  float* s_s = shared.take<float>(BM, LDS);
  float* dp_s = shared.take<float>(BM, LDS);
  T* ds_s = shared.take<T>(BM, LDP);
  float* lse_s = shared.take<float>(BM, 1);
  float* delta_s = shared.take<float>(BM, 1);

  const T* q = head_of<const T>(p.q, p.q_stride, b, h);
  const T* grad_out =
      head_of<const T>(params.grad_out, params.grad_out_stride, b, h) + start.q * params.grad_out_stride[2];
  const T* k = head_of<const T>(p.k, p.k_stride, b, h_kv);
  const T* v = head_of<const T>(p.v, p.v_stride, b, h_kv);
  load_tile<T, BM, HEAD>(q_s, LD, q, p.q_stride[2], p.q_stride[3], m0, 0, p.len_q, p.dim_qk);
  load_tile<T, BM, HEAD>(do_s, LD, grad_out, params.grad_out_stride[2], params.grad_out_stride[3],
                         m0, 0, p.len_q, p.dim_v);
  load_row_stats<BM>(params, p, b, h, m0, start.q, lse_s, delta_s);
  fill_f32(dq_s, BM * LDA, 0.0f);

  int n_begin, n_end;
  key_blocks_of<BN>(p, b, m0, m0 + BM - 1, n_begin, n_end);
  const KeyRows keys = key_rows_of(p, b);
  for (int n0 = n_begin; n0 < n_end; n0 += BN) {
    const int32_t state = program_state(p, b, h, m0, n0);
    if (state == fused_attn::kTileEmpty) continue;  // uniform over the block, before any load or barrier
    load_tile<T, BN, HEAD>(k_s, LD, k, p.k_stride[2], p.k_stride[3], n0, keys.first, keys.end, p.dim_qk);
    load_tile<T, BN, HEAD>(v_s, LD, v, p.v_stride[2], p.v_stride[3], n0, keys.first, keys.end, p.dim_v);
    __syncthreads();
    block_gemm<T, BM, BN, HEAD, false, true, false>(q_s, LD, k_s, LD, s_s, LDS);    // Q Kᵀ
    block_gemm<T, BM, BN, HEAD, false, true, false>(do_s, LD, v_s, LD, dp_s, LDS);  // dO Vᵀ
    __syncthreads();
    probabilities_and_grads<T, BM, BN>(params, p, b, h, m0, n0, state, s_s, dp_s, LDS, lse_s, delta_s,
                                       static_cast<T*>(nullptr), ds_s, LDP, static_cast<T*>(nullptr));
    __syncthreads();
    block_gemm<T, BM, HEAD, BN, false, false, true>(ds_s, LDP, k_s, LD, dq_s, LDA);  // += dS K
    __syncthreads();
  }
  __syncthreads();

  T* grad_q = head_of<T>(params.grad_q, params.grad_q_stride, b, h) + start.q * params.grad_q_stride[2];
  for (int e = threadIdx.x; e < BM * HEAD; e += kThreads) {
    const int r = e / HEAD, d = e % HEAD;
    if (m0 + r < p.len_q && d < p.dim_qk)
      grad_q[(m0 + r) * params.grad_q_stride[2] + d * params.grad_q_stride[3]] =
          Element<T>::store(dq_s[r * LDA + d] * p.scale);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch shapes: every kernel runs kThreads per block on a grid of (query or key blocks, heads,
// batch), the decode kernel on (splits, key/value heads, batch), the delta and combine kernels one
// warp per query row. The torch glue and the sanitizer run both take them from here.

struct LaunchShape {
  unsigned grid[3];
  unsigned block;
  std::size_t shared_bytes;
};

inline unsigned ceil_div(int64_t n, int64_t d) { return static_cast<unsigned>((n + d - 1) / d); }

template <int KIND, typename T, int HEAD>
LaunchShape blocks_over(int64_t length, int64_t block, int heads, int batch) {
  return {{ceil_div(length, block), static_cast<unsigned>(heads), static_cast<unsigned>(batch)},
          kThreads, static_cast<std::size_t>(Config<KIND, T, HEAD>::shared_bytes)};
}

template <typename T, int HEAD>
LaunchShape forward_shape(const AttentionParams& p) {
  return blocks_over<kForwardKernel, T, HEAD>(p.len_q, Config<kForwardKernel, T, HEAD>::block_m, p.heads_q, p.batch);
}

template <typename T, int HEAD>
LaunchShape backward_dq_shape(const AttentionParams& p) {
  return blocks_over<kBackwardQKernel, T, HEAD>(p.len_q, Config<kBackwardQKernel, T, HEAD>::block_m, p.heads_q,
                                                p.batch);
}

template <typename T, int HEAD>
LaunchShape backward_dkdv_shape(const AttentionParams& p) {
  return blocks_over<kBackwardKVKernel, T, HEAD>(p.len_k, Config<kBackwardKVKernel, T, HEAD>::block_n, p.heads_kv,
                                                 p.batch);
}

template <typename T, int HEAD, int BM>
LaunchShape decode_shape(const AttentionParams& p, int splits) {
  return {{static_cast<unsigned>(splits), static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch)},
          kThreads, static_cast<std::size_t>(DecodeConfig<T, HEAD, BM>::shared_bytes)};
}

// The keys of one decode split: whole blocks of BN keys, so that a split's blocks start where the
// previous split's end.
inline int decode_keys_per_split(int len_k, int splits, int block_n) {
  return static_cast<int>(ceil_div(ceil_div(len_k, splits), block_n)) * block_n;
}

// The delta and combine kernels: one warp per query row.
inline LaunchShape one_warp_per_row(int64_t rows) { return {{ceil_div(rows, kWarps), 1, 1}, kThreads, 0}; }

}  // namespace fused_attn_cuda
