// FlashAttention on the CPU: the forward and backward kernels, written once and compiled once per
// instruction set. The including file defines CPU_CAPABILITY (DEFAULT, AVX2, AVX512 or AVX512_BF16)
// and the matching CPU_CAPABILITY_* macro first, as ATen does for its own kernels, so that
// at::vec::Vectorized is the vector type of that instruction set; everything here lives in
// fused_attn_cpu::CPU_CAPABILITY, so the copies never share a symbol.
//
// Forward: work items are (batch, query head, group of up to 8 query blocks), handed to ATen's threads
// one at a time (parallel_items). Each key block is packed once per item and met by the item's query blocks in
// turn: S = Q Kᵀ, online softmax (running max m, running sum l, the output accumulator rescaled by
// exp(m_old - m_new)), O += P V. Scores exist one block at a time, so memory grows with the block
// sizes, never with L_q × L_k. Causal attention stops at the last key block an item can see and
// skips the query blocks that see none of a key block.
//
// Backward: work items are (batch, key/value head), which own their dK and dV and the dQ of every
// query head of their group, so no two threads write the same gradient element and the order of
// every sum is fixed by the loops alone: the gradients are bit-identical across runs and thread
// counts. Per key block (outer) and query block (inner) it recomputes S and P = exp(S - lse), forms
// dP = dO Vᵀ and dS = P (dP - delta), and accumulates dVᵀ += dOᵀ P, dKᵀ += Qᵀ dS (transposed once per key
// block) and dQ += dS K.
//
// Every tensor is read through its strides: each block is copied ("packed") into a small per-thread
// buffer in the layout the matrix product wants, which is also where bf16/fp16 operands either stay
// in their type (oneDNN brgemm: AMX, or AVX512-BF16 for bf16; see typed_products) or become float,
// and where an 8-bit key/value cache (forward only) is dequantized into float.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash_params.h"

namespace fused_attn_cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

// bf16/fp16 operands go to brgemm in VNNI layout: the reduction dimension in interleaved pairs.
template <typename ct>
constexpr bool kVnni = std::is_same_v<ct, c10::BFloat16> || std::is_same_v<ct, c10::Half>;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename T>
constexpr T neg_inf() { return -std::numeric_limits<T>::infinity(); }

// Per-thread scratch, carved into 64-byte aligned pieces; freed even when a check throws. Poisoned,
// every byte is 0xFF: NaN as float, double, bf16 and fp16.
class Scratch {
 public:
  Scratch(size_t bytes, bool poison) : base_(static_cast<char*>(c10::alloc_cpu(bytes + 64))) {
    if (poison) std::memset(base_, 0xFF, bytes + 64);
  }
  ~Scratch() { c10::free_cpu(base_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* take(int64_t count) {
    T* piece = reinterpret_cast<T*>(base_ + used_);
    used_ += static_cast<size_t>(round_up(count * static_cast<int64_t>(sizeof(T)), 64));
    return piece;
  }
  template <typename T>
  static size_t bytes(int64_t count) {
    return static_cast<size_t>(round_up(count * static_cast<int64_t>(sizeof(T)), 64));
  }

 private:
  char* base_;
  size_t used_ = 0;
};

// Work items of unequal cost (padded batch rows, causal and windowed query blocks) handed to ATen's
// threads one at a time, each thread taking the next as it finishes the last, instead of in equal
// contiguous shares, where a thread with the cheap share waits idle for one with the dear share.
// `worker(next_item)` runs once per thread; next_item() gives an item index, or -1 when none is left.
// Items write disjoint outputs, so which thread runs one changes no result.
template <typename Worker>
void parallel_items(int64_t count, const Worker& worker) {
  std::atomic<int64_t> next{0};
  const auto next_item = [&] {
    const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
    return item < count ? item : int64_t(-1);
  };
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1,
                   [&](int64_t, int64_t) { worker(next_item); });
}

// ---------------------------------------------------------------------------------------------
// Matrix products: C[M×N] (= or +=) A[M×K] · B[K×N], row-major with leading dimensions.

// A register-blocked micro-kernel: MR rows of A against two vectors of B's columns, the
// 2·MR accumulators staying in registers along K. Used for float64 and wherever brgemm is not.
template <typename T, int MR, bool kFull>
inline void micro_tile(int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                       int64_t ldc, bool add, int64_t n0, int64_t n1) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  V c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) {
    if (add) {
      c0[r] = kFull ? V::loadu(C + r * ldc) : V::loadu(C + r * ldc, n0);
      c1[r] = kFull ? V::loadu(C + r * ldc + W) : (n1 > 0 ? V::loadu(C + r * ldc + W, n1) : V(T(0)));
    } else {
      c0[r] = V(T(0));
      c1[r] = V(T(0));
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
    const V b0 = kFull ? V::loadu(b) : V::loadu(b, n0);
    const V b1 = kFull ? V::loadu(b + W) : (n1 > 0 ? V::loadu(b + W, n1) : V(T(0)));
    for (int r = 0; r < MR; ++r) {
      const V a(A[r * lda + k]);
      c0[r] = at::vec::fmadd(a, b0, c0[r]);
      c1[r] = at::vec::fmadd(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (kFull) {
      c0[r].store(C + r * ldc);
      c1[r].store(C + r * ldc + W);
    } else {
      c0[r].store(C + r * ldc, n0);
      if (n1 > 0) c1[r].store(C + r * ldc + W, n1);
    }
  }
}

template <typename T>
void micro_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                T* C, int64_t ldc, bool add) {
  constexpr int64_t W = Vectorized<T>::size();
  constexpr int MR = 4;
  for (int64_t j = 0; j < N; j += 2 * W) {
    const int64_t n0 = std::min<int64_t>(W, N - j);
    const int64_t n1 = std::max<int64_t>(0, std::min<int64_t>(W, N - j - W));
    const bool full = n0 == W && n1 == W;
    int64_t i = 0;
    for (; i + MR <= M; i += MR) {
      if (full) {
        micro_tile<T, MR, true>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, add, n0, n1);
      } else {
        micro_tile<T, MR, false>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, add, n0, n1);
      }
    }
    for (; i < M; ++i) {
      if (full) {
        micro_tile<T, 1, true>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, add, n0, n1);
      } else {
        micro_tile<T, 1, false>(K, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, add, n0, n1);
      }
    }
  }
}

// The product of each block. `ct` is the operand type: float and double use plain row-major B;
// bf16/fp16 use brgemm with B in VNNI pairs (K even). C accumulates in float (double for double).
template <typename ct, typename acc_t>
void gemm(int64_t M, int64_t N, int64_t K, const ct* A, int64_t lda, const ct* B, int64_t ldb,
          acc_t* C, int64_t ldc, bool add, bool use_brgemm) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!add) {
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, acc_t(0));
    }
    return;
  }
  if constexpr (kVnni<ct>) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/true);
  } else if constexpr (std::is_same_v<ct, float>) {
    if (use_brgemm) {
      at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/false);
    } else {
      micro_gemm<float>(M, N, K, A, lda, B, ldb, C, ldc, add);
    }
  } else {
    micro_gemm<ct>(M, N, K, A, lda, B, ldb, C, ldc, add);
  }
}

// ---------------------------------------------------------------------------------------------
// Packing: strided blocks of the inputs into the per-thread operand buffers.

template <typename dst_t, typename src_t>
inline void copy_row(dst_t* dst, const src_t* src, int64_t stride, int64_t n) {
  if (stride == 1) {
    at::vec::convert(src, dst, n);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<dst_t>(static_cast<float>(src[i * stride]));
  }
}

template <>
inline void copy_row<double, double>(double* dst, const double* src, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i * stride];
}

// A operand: dst[m][k] (leading dimension ldk >= K, columns K..ldk zero) = src[m*sm + k*sk].
template <typename ct, typename st>
void pack_a(ct* dst, int64_t ldk, const st* src, int64_t sm, int64_t sk, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m) {
    copy_row(dst + m * ldk, src + m * sm, sk, K);
    std::fill(dst + m * ldk + K, dst + (m + 1) * ldk, ct(0));
  }
}

// dst[c][r] (leading dimension ld_dst) = src[r*ld_src + c] for r < rows, c < cols, on 32-bit
// elements (float, or pairs of bf16/fp16 moved as one unit): 16×16 register transposes of
// at::vec::transpose_mxn where the instruction set has them, element by element at the edges.
inline void transpose_32bit(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
                            int64_t cols) {
  constexpr int64_t T = 16;
  const int64_t full_rows = rows / T * T, full_cols = cols / T * T;
  for (int64_t r = 0; r < full_rows; r += T) {
    for (int64_t c = 0; c < full_cols; c += T) {
      at::vec::transpose_mxn<float, T, T>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c_begin = r < full_rows ? full_cols : 0;
    for (int64_t c = c_begin; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

// B operand, logically B[k][n] = src[k*sk + n*sn] for k < K (rows K..Kpad are zero), n < N.
// Plain: dst[k*N + n]. VNNI: dst[((k/2)*N + n)*2 + k%2].
template <typename ct, typename st>
void pack_b(ct* dst, const st* src, int64_t sk, int64_t sn, int64_t K, int64_t Kpad, int64_t N) {
  if constexpr (kVnni<ct>) {
    static_assert(std::is_same_v<ct, st>, "VNNI operands keep the input type");
    if (sk == 1 && K % 2 == 0 && sn % 2 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0) {
      // K pairs are adjacent in memory: the VNNI layout is a transpose of 32-bit pairs.
      transpose_32bit(reinterpret_cast<float*>(dst), N, reinterpret_cast<const float*>(src), sn / 2, N, K / 2);
    } else {
      for (int64_t k = 0; k < K; k += 2) {  // rows k and k+1 interleaved, read along n
        const st* row0 = src + k * sk;
        const st* row1 = row0 + sk;
        ct* out = dst + (k >> 1) * N * 2;
        if (k + 1 < K && sn == 1) {
          // Interleaving two contiguous rows: on the raw 16-bit patterns, which the compiler
          // vectorises (it does not see through the c10 wrapper types).
          const auto* a = reinterpret_cast<const uint16_t*>(row0);
          const auto* c = reinterpret_cast<const uint16_t*>(row1);
          auto* o = reinterpret_cast<uint16_t*>(out);
          for (int64_t n = 0; n < N; ++n) {
            o[2 * n] = a[n];
            o[2 * n + 1] = c[n];
          }
        } else if (k + 1 < K) {
          for (int64_t n = 0; n < N; ++n) {
            out[2 * n] = row0[n * sn];
            out[2 * n + 1] = row1[n * sn];
          }
        } else {
          for (int64_t n = 0; n < N; ++n) {
            out[2 * n] = row0[n * sn];
            out[2 * n + 1] = ct(0);
          }
        }
      }
    }
    if (Kpad > round_up(K, 2)) std::fill(dst + round_up(K, 2) * N, dst + Kpad * N, ct(0));
  } else if (std::is_same_v<ct, float> && std::is_same_v<st, float> && sk == 1 && sn != 1) {
    // Kᵀ of contiguous key rows: a blocked transpose.
    transpose_32bit(reinterpret_cast<float*>(dst), N, reinterpret_cast<const float*>(src), sn, N, K);
    std::fill(dst + K * N, dst + Kpad * N, ct(0));
  } else if (std::is_same_v<ct, float> && sk == 1 && sn != 1) {
    // Kᵀ of contiguous 16-bit key rows, multiplied in float: tiles of 16 rows widened by vector conversions, then
    // the blocked transpose. Element by element, every conversion and every strided store would be scalar.
    constexpr int64_t kTileRows = 16, kTileCols = 256;
    float tile[kTileRows * kTileCols];
    for (int64_t n0 = 0; n0 < N; n0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += kTileCols) {
        const int64_t cols = std::min(kTileCols, K - k0);
        for (int64_t i = 0; i < rows; ++i) copy_row(tile + i * cols, src + (n0 + i) * sn + k0, 1, cols);
        transpose_32bit(reinterpret_cast<float*>(dst) + k0 * N + n0, N, tile, cols, rows, cols);
      }
    }
    std::fill(dst + K * N, dst + Kpad * N, ct(0));
  } else if (std::abs(sn) <= std::abs(sk)) {  // rows of B are contiguous enough: copy by rows
    for (int64_t k = 0; k < K; ++k) copy_row(dst + k * N, src + k * sk, sn, N);
    std::fill(dst + K * N, dst + Kpad * N, ct(0));
  } else {  // a transpose: walk the source along its short stride
    for (int64_t n = 0; n < N; ++n) {
      const st* column = src + n * sn;
      for (int64_t k = 0; k < K; ++k) dst[k * N + n] = static_cast<ct>(column[k * sk]);
    }
    std::fill(dst + K * N, dst + Kpad * N, ct(0));
  }
}

// ---------------------------------------------------------------------------------------------
// Row operations of the softmax, vectorised.

template <typename T>
inline Vectorized<T> vexp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    // float64 is the dtype of exact checks: full-precision exp, one lane at a time.
    __at_align__ T lanes[Vectorized<T>::size()];
    x.store(lanes);
    for (auto& lane : lanes) lane = std::exp(lane);
    return Vectorized<T>::loadu(lanes);
  }
}

// The running maximum of a row's scores, NaN once any of them is NaN (the row's shift, and so its output and lse,
// then become NaN, softmax_step). On AVX512, vmaxps alone in the maximum's chain and a compare into a
// mask register beside it, where at::vec::maximum puts four vector instructions into the chain (bench/NOTES.md
// section 67); elsewhere at::vec::maximum.
template <typename T>
class RunningMax {
 public:
  void add(const Vectorized<T>& x) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, float>) {
      max_ = _mm512_max_ps(max_, x);
      nan_ |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      return;
    }
#endif
    max_ = at::vec::maximum(max_, x);
  }

  T value() const {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, float>) {
      return nan_ != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(max_);
    }
#endif
    return at::vec::vec_reduce_all<T>([](Vectorized<T>& a, Vectorized<T>& b) { return at::vec::maximum(a, b); },
                                      max_);
  }

 private:
  Vectorized<T> max_{neg_inf<T>()};
  uint32_t nan_ = 0;  // lanes that met a NaN
};

// Largest of s[0..n).
template <typename acc_t>
acc_t row_max_of(const acc_t* s, int64_t n) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  V m0(neg_inf<acc_t>()), m1(neg_inf<acc_t>()), m2(neg_inf<acc_t>()), m3(neg_inf<acc_t>());
  int64_t j = 0;
  for (; j + 4 * W <= n; j += 4 * W) {  // four independent chains hide the latency of max
    m0 = at::vec::maximum(m0, V::loadu(s + j));
    m1 = at::vec::maximum(m1, V::loadu(s + j + W));
    m2 = at::vec::maximum(m2, V::loadu(s + j + 2 * W));
    m3 = at::vec::maximum(m3, V::loadu(s + j + 3 * W));
  }
  for (; j + W <= n; j += W) m0 = at::vec::maximum(m0, V::loadu(s + j));
  // The ragged end as one masked vector: a row's visible keys end anywhere, and a chain of scalar maxima
  // cost 4 cycles a key (30 % of this function for a narrow window's rows, bench/NOTES.md section 43).
  if (j < n) m1 = at::vec::maximum(m1, V::set(V(neg_inf<acc_t>()), V::loadu(s + j, n - j), n - j));
  V vmax = at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3));
  return at::vec::vec_reduce_all<acc_t>([](V& x, V& y) { return at::vec::maximum(x, y); }, vmax);
}

// Whether the scores need nothing but the scale, which the exp can then apply (a positive scale
// keeps the row max of the unscaled scores). A window, and padding that key_spans describes, need
// nothing per score: they only narrow the keys a row visits (visible_keys).
inline bool scores_are_plain(const Params& p) {
  return p.mask_kind == MaskKind::None && p.key_padding.data == nullptr && p.scale > 0 && p.softcap == 0.0 &&
         p.alibi.data == nullptr;
}

// The keys query qi sees, [first, end), from the window, the diagonal and `span`, the range of keys
// its batch row's padding leaves (key_span); the masks may hide more of them. Both bounds grow with
// qi, so rows [q0, q1] see keys within [visible_keys(q0).first, visible_keys(q1).end).
struct KeyRange {
  int64_t first, end;
};

inline KeyRange key_span(const Params& p, int64_t b) {
  if (p.key_spans == nullptr) return {0, p.len_k};
  return {p.key_spans[2 * b], p.key_spans[2 * b + 1]};
}

// Key j of key/value head hk of batch row b in `view` (p.key or p.value, whose data is `base`); keys
// j .. j + keys_in_block(p, j, n) - 1 follow it at stride view.s[2]. Dense: one block per batch row.
template <typename T>
inline const T* key_row(const Params& p, const View& view, const T* base, int64_t b, int64_t hk, int64_t j) {
  if (p.pages == nullptr) return base + b * view.s[0] + hk * view.s[1] + j * view.s[2];
  const int64_t block = p.pages[b * p.pages_stride + j / p.page_size];
  return base + block * view.s[0] + hk * view.s[1] + (j % p.page_size) * view.s[2];
}

// How many of the n keys from j on lie in j's cache block (all n when the cache is dense).
inline int64_t keys_in_block(const Params& p, int64_t j, int64_t n) {
  return p.pages == nullptr ? n : std::min(n, p.page_size - j % p.page_size);
}

// ---------------------------------------------------------------------------------------------
// 8-bit caches (Params::cache, fused_attn/quantization.py): key j of a cache block stands for its float8_e4m3fn or
// int8 values times its float32 scale, and the products run in float. The long-query kernels dequantize each
// block of keys and values into the float buffers they pack it into anyway; the decode kernels convert the stored
// bytes inside their products (row_dots, add_stored_values) where an item has few rows and the cache
// is contiguous along D, and into float rows otherwise. Nothing dequantized outlives its block.

// One stored byte as float: the int8 value; or the float8_e4m3fn bits s eeee mmm read as the fp16 s 0eeee mmm0000000,
// which is 2^-8 times the stored value (fp16's exponent bias, 15, exceeds e4m3's by 8), subnormals included. The
// vector loops below build that fp16 by sign extension, a shift by 7 and bit 14 cleared, and convert it with F16C,
// exactly whatever the denormal mode. e4m3fn's NaN (s 1111 111) reads as ±480: fused_attn.quantization saturates at
// ±448, so a cache it wrote holds no NaN. The decode kernels read a plain bf16 cache's rows the same way (as
// CacheType::Plain: the bf16 bits shifted into a float's upper half, no scale), where few query rows share them, and
// a paged float cache's rows as they are. PlainT: the type of a plain cache's elements.
template <CacheType kType, typename PlainT = c10::BFloat16>
using StoredElem = std::conditional_t<kType == CacheType::Plain, PlainT, int8_t>;

template <CacheType kType, typename Elem>
inline float stored_value(Elem byte) {
  if constexpr (kType != CacheType::Float8E4M3) {  // float, bf16, or an int8 value
    return static_cast<float>(byte);
  } else {
    const auto bits = static_cast<uint8_t>(byte);
    return static_cast<float>(c10::Half(static_cast<uint16_t>((bits & 0x80) << 8 | (bits & 0x7f) << 7),
                                        c10::Half::from_bits()));
  }
}

// What multiplies stored_value to give a value under `scale`: the scale, times 2^8 for e4m3fn's fp16 reading.
template <CacheType kType>
inline float value_factor(float scale) {
  return kType == CacheType::Int8 ? scale : scale * 256.f;
}

// value_factor of the scale of stored row i, scale[i] (1 for a plain cache, which has no scales).
template <CacheType kType>
inline float row_factor(const float* scale, int64_t i) {
  if constexpr (kType == CacheType::Plain) {
    return 1.f;
  } else {
    return value_factor<kType>(scale[i]);
  }
}

// stored_value of Vectorized<float>::size() elements from src on, one per lane.
template <CacheType kType, typename Elem>
inline Vectorized<float> load_stored(const Elem* src) {
  static_assert(kType != CacheType::Plain || std::is_same_v<Elem, float> || std::is_same_v<Elem, c10::BFloat16>,
                "a plain cache's rows are read as float or bf16");
  if constexpr (std::is_same_v<Elem, float>) return Vectorized<float>::loadu(src);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kType == CacheType::Plain) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if constexpr (kType == CacheType::Int8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else {
    const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(shifted, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (kType == CacheType::Plain) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
  }
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  if constexpr (kType == CacheType::Int8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  } else {
    const __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7);
    return _mm256_cvtph_ps(_mm_and_si128(shifted, _mm_set1_epi16(static_cast<int16_t>(0xBFFF))));
  }
#else
  __at_align__ float lanes[Vectorized<float>::size()];
  for (int64_t i = 0; i < Vectorized<float>::size(); ++i) lanes[i] = stored_value<kType>(src[i]);
  return Vectorized<float>::loadu(lanes);
#endif
}

#if defined(FUSED_ATTN_AVX512_BF16)
// This copy takes the scores of bf16 queries against 8-bit keys in bf16 pairs (row_dots).
constexpr bool kPairDots = true;

// load_stored of 32 elements from src on as bf16, exactly: int8's values and e4m3's fp16 readings have at most 8
// significant bits, and the readings are normal floats (2^-17 at the least), which vdpbf16ps does not flush; a bf16
// row's elements are taken as they lie.
template <CacheType kType, typename Elem>
C10_ALWAYS_INLINE __m512bh load_stored_pairs(const Elem* src) {
  if constexpr (kType == CacheType::Plain) {
    static_assert(std::is_same_v<Elem, c10::BFloat16>, "a plain row in pairs is bf16");
    return std::bit_cast<__m512bh>(_mm512_loadu_si512(src));
  } else {
    return _mm512_cvtne2ps_pbh(load_stored<kType>(src + 16), load_stored<kType>(src));  // the low half second
  }
}

// The 16 values of two stored rows a and b from their element d on, interleaved as bf16 pairs (a's value low): the
// upper halves of their float readings, which are bf16 exactly (load_stored_pairs).
template <CacheType kType, typename Elem>
C10_ALWAYS_INLINE __m512bh interleaved_pairs(const Elem* a, const Elem* b) {
  __m512i low;
  if constexpr (std::is_same_v<Elem, c10::BFloat16>) {  // a plain bf16 row's values, zero-extended, are the low halves
    low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  } else {
    low = _mm512_srli_epi32(_mm512_castps_si512(load_stored<kType>(a)), 16);
  }
  return std::bit_cast<__m512bh>(_mm512_mask_blend_epi16(0xAAAAAAAA, low, _mm512_castps_si512(load_stored<kType>(b))));
}
#else
constexpr bool kPairDots = false;
#endif

// dst[i] = the value of byte src[i * stride] times `scale`, i < n; vectorised along unit strides.
template <CacheType kType>
inline void dequantize_row(float* dst, const int8_t* src, int64_t stride, int64_t n, float scale) {
  using V = Vectorized<float>;
  const float factor = value_factor<kType>(scale);
  int64_t i = 0;
  if (stride == 1) {
    for (; i + V::size() <= n; i += V::size()) (load_stored<kType>(src + i) * V(factor)).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = stored_value<kType>(src[i * stride]) * factor;
}

// The scale of key j of key/value head hk of batch row b in `scales` (p.k_scale or p.v_scale); the next keys of j's
// cache block follow at stride scales.s[2] (0: one scale per sequence and head).
inline const float* scale_row(const Params& p, const View& scales, int64_t b, int64_t hk, int64_t j) {
  const auto* base = static_cast<const float*>(scales.data);
  return p.token_scales ? key_row(p, scales, base, b, hk, j) : base + b * scales.s[0] + hk * scales.s[1];
}

// Keys j .. j + n of key/value head hk of batch row b in the 8-bit `view` (p.key or p.value, scaled by `scales`),
// across a paged cache's blocks, as float rows dst[i * ld + d], d < dim. The kernels run with float operands on such a
// cache (dispatch), so dst is float wherever this is reached.
template <typename dst_t>
void dequantize_keys(const Params& p, const View& view, const View& scales, int64_t b, int64_t hk, int64_t j,
                     int64_t n, int64_t dim, dst_t* dst, int64_t ld) {
  if constexpr (std::is_same_v<dst_t, float>) {
    for (int64_t i = 0, count; i < n; i += count) {
      count = keys_in_block(p, j + i, n - i);
      const int8_t* rows = key_row(p, view, static_cast<const int8_t*>(view.data), b, hk, j + i);
      const float* scale = scale_row(p, scales, b, hk, j + i);
      for (int64_t r = 0; r < count; ++r) {
        float* out = dst + (i + r) * ld;
        if (p.cache == CacheType::Float8E4M3) {
          dequantize_row<CacheType::Float8E4M3>(out, rows + r * view.s[2], view.s[3], dim, scale[r * scales.s[2]]);
        } else {
          dequantize_row<CacheType::Int8>(out, rows + r * view.s[2], view.s[3], dim, scale[r * scales.s[2]]);
        }
      }
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "an 8-bit cache is dequantized into float rows only");
  }
}

// Keys j .. j + n of key/value head hk of batch row b in the plain `view` (p.key or p.value), across a paged cache's
// blocks, as contiguous rows dst[i * ld + d], d < dim, of dst_t: a long-query key block spanning cache blocks is then
// packed as a dense cache's rows are.
template <typename dst_t, typename src_t>
void gather_rows(const Params& p, const View& view, const src_t* base, int64_t b, int64_t hk, int64_t j, int64_t n,
                 int64_t dim, dst_t* dst, int64_t ld) {
  for (int64_t i = 0, count; i < n; i += count) {
    count = keys_in_block(p, j + i, n - i);
    const src_t* first = key_row(p, view, base, b, hk, j + i);
    for (int64_t r = 0; r < count; ++r) copy_row(dst + (i + r) * ld, first + r * view.s[2], view.s[3], dim);
  }
}

inline KeyRange visible_keys(const Params& p, int64_t qi, KeyRange span) {
  const int64_t diagonal = qi + p.diagonal;
  int64_t first = span.first, end = span.end;
  if (p.window_left >= 0) first = std::max(first, diagonal - p.window_left);
  if (p.window_right >= 0) end = std::min(end, diagonal + p.window_right + 1);
  first = std::clamp<int64_t>(first, 0, p.len_k);
  return {first, std::clamp<int64_t>(end, first, p.len_k)};
}

// The queries that see some key of [k_first, k_end) through the window: [first, end).
inline KeyRange queries_seeing(const Params& p, int64_t k_first, int64_t k_end) {
  // Query i sees key j iff i >= j - diagonal - right and i <= j - diagonal + left.
  const int64_t first =
      p.window_right < 0 ? 0 : std::clamp<int64_t>(k_first - p.diagonal - p.window_right, 0, p.len_q);
  const int64_t end =
      p.window_left < 0 ? p.len_q : std::clamp<int64_t>(k_end - p.diagonal + p.window_left, 0, p.len_q);
  return {first, std::max(first, end)};
}

// 1 / d for d in [1, 2^64]: the hardware estimate (14 bits on AVX512, 12 on AVX2) and one Newton step,
// within an ulp or two of the quotient at a fraction of vdivps's cost; other types divide.
template <typename acc_t>
inline Vectorized<acc_t> reciprocal_of(Vectorized<acc_t> d) {
  using V = Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    const V r(_mm512_rcp14_ps(d));
    return r * at::vec::fnmadd(d, r, V(2.f));
#elif defined(CPU_CAPABILITY_AVX2)
    const V r(_mm256_rcp_ps(d));
    return r * at::vec::fnmadd(d, r, V(2.f));
#endif
  }
  return V(acc_t(1)) / d;
}

// 1 / d to the hardware estimate's 14 bits on AVX512 (relative error under 2^-14), where that is exact enough (a
// bf16 call's softcap, capped_tanh); elsewhere reciprocal_of, with its Newton step (AVX2's estimate has 12 bits).
template <typename acc_t>
inline Vectorized<acc_t> rough_reciprocal_of(Vectorized<acc_t> d) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) return _mm512_rcp14_ps(d);
#endif
  return reciprocal_of<acc_t>(d);
}

// The polynomial in f of 2^f on [0, 1] (fitted for the least largest relative error): degree 5 is within 3 ulp
// (7.5e-8); degree 4 within 2.7e-6, far below the resolution of a 16-bit result (2^-9 in bf16, 2^-11 in fp16).
template <int kDegree, typename V>
inline V exp2_fraction(const V& f) {
  static_assert(kDegree == 4 || kDegree == 5);
  if constexpr (kDegree == 5) {
    V p = at::vec::fmadd(f, V(0.0018775766f), V(0.0089893406f));
    p = at::vec::fmadd(f, p, V(0.055826318f));
    p = at::vec::fmadd(f, p, V(0.24015361f));
    p = at::vec::fmadd(f, p, V(0.69315308f));
    return at::vec::fmadd(f, p, V(0.99999994f));
  } else {
    V p = at::vec::fmadd(f, V(0.013541007f), V(0.051998407f));
    p = at::vec::fmadd(f, p, V(0.24145016f));
    p = at::vec::fmadd(f, p, V(0.69300270f));
    return at::vec::fmadd(f, p, V(1.0000026f));
  }
}

// 2^t for -64 <= t <= 64, the fraction's power times 2^floor(t): on AVX512 vreduceps gives the fraction and
// vscalefps applies the integer part; on AVX2 vroundps gives the integer part, added into the exponent field
// (2^-64 <= 2^t <= 2^65 stays normal). Half the instructions of ATen's exp_u20, which also handles what t never
// is here (large, -inf, NaN); other copies take exp_u20.
template <int kDegree>
inline Vectorized<float> exp2_bounded(Vectorized<float> t) {
  using V = Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(exp2_fraction<kDegree>(V(_mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF))), t);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 whole = _mm256_floor_ps(t);
  const V power = exp2_fraction<kDegree>(V(_mm256_sub_ps(t, whole)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(whole), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(power), exponent));
#else
  return (t * V(0.6931471805599453f)).exp_u20();
#endif
}

// What capped_tanh's argument is x times: the factor of the exp inside it, e = 2^(x · -2 log2 e) = exp(-2x),
// which the caller folds into its own scale.
template <typename acc_t>
constexpr acc_t tanh_argument_scale() {
  return std::is_same_v<acc_t, float> ? acc_t(-2.8853900817779268) : acc_t(1);
}

// cap · tanh(x), given u = x · tanh_argument_scale(): cap · (1 - e) / (1 + e) with e = exp(-2x), the cap
// inside the numerator's FMA, several times cheaper than Sleef's tanh. e from exp2_bounded with u clamped to
// ±64, which leaves tanh at ±1 in float past |x| = 22, keeps the sign without a test and keeps vscalefps from
// underflowing (a microcode assist). `kCoarse`: the exp polynomial of degree 4, for the scores of a call whose
// inputs and output are 16-bit. `kBf16`: a bf16 call's, whose reciprocal is the hardware estimate alone on AVX512:
// cap · tanh is then off by under cap · 2^-14, below the 2^-8 by which its bf16 weights are rounded
// (bench/NOTES.md section 79). float64 keeps Sleef's tanh. With `slope`, also tanh's derivative 1 - tanh² there,
// as 4e / (1 + e)²: positive and within the reciprocal's error everywhere, where 1 - t² of a t rounded near ±1
// cancels (and of the estimate's t, which may pass 1, changes sign).
template <bool kCoarse, bool kBf16, typename acc_t>
inline Vectorized<acc_t> capped_tanh(Vectorized<acc_t> u, Vectorized<acc_t> cap,
                                     Vectorized<acc_t>* slope = nullptr) {
  using V = Vectorized<acc_t>;
  if constexpr (std::is_same_v<acc_t, float>) {
    const V e = exp2_bounded<kCoarse ? 4 : 5>(at::vec::clamp(u, V(-64.f), V(64.f)));
    const V d = V(1.f) + e;
    const V r = kBf16 ? rough_reciprocal_of<acc_t>(d) : reciprocal_of<acc_t>(d);
    if (slope != nullptr) *slope = V(4.f) * (e * r) * r;  // e · r <= 1: no overflow at e = 2^64
    return at::vec::fnmadd(cap, e, cap) * r;
  } else {
    const V t = u.tanh();
    if (slope != nullptr) *slope = at::vec::fnmadd(t, t, V(acc_t(1)));
    return cap * t;
  }
}

// The score variant of one row in one pass: s[i] = cap(s[i] * scale) - slope * |distance0 - i|,
// where distance0 is the first key's distance from the query's diagonal; with `cap_grad`, also the
// cap's derivative 1 - tanh² for the backward. Compiled per combination, so the loop holds only what
// the call has. Returns the row maximum.
template <bool kCapped, bool kAlibi, bool kCoarse, bool kBf16, typename acc_t>
acc_t variant_pass(acc_t* s, int64_t n, acc_t scale, acc_t softcap, acc_t slope, acc_t distance0, acc_t* cap_grad) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  // Capped, the scale, the division by the cap and capped_tanh's factor are one multiply.
  const V vscale(kCapped ? scale / softcap * tanh_argument_scale<acc_t>() : scale), cap(softcap), vslope(slope);
  // The distances of the vector's lanes, moved W keys along per vector.
  V distance = V(distance0) - V::arange(acc_t(0), acc_t(1));
  RunningMax<acc_t> row_max;
  for (int64_t i = 0; i < n; i += W) {
    const int64_t count = std::min<int64_t>(W, n - i);
    V x = V::loadu(s + i, count) * vscale;
    if constexpr (kCapped) {
      if (cap_grad == nullptr) {
        x = capped_tanh<kCoarse, kBf16>(x, cap);
      } else {
        V slope;
        const V t = capped_tanh<kCoarse, kBf16>(x, V(acc_t(1)), &slope);
        slope.store(cap_grad + i, count);
        x = cap * t;
      }
    }
    if constexpr (kAlibi) {
      x = at::vec::fnmadd(vslope, distance.abs(), x);
      distance = distance - V(acc_t(W));
    }
    x.store(s + i, count);
    // Lanes past n must not reach the maximum.
    row_max.add(count == W ? x : V::set(V(neg_inf<acc_t>()), x, count));
  }
  return row_max.value();
}

// Scores of one row, keys k0 .. k0 + n, as the softmax takes them (fused_attn/scores.py):
// s[j] = cap(s[j] * scale) - slope * |qi + diagonal - key| + additive mask, or -inf where hidden.
// With `cap_grad`, also the derivative of the cap there, 1 - tanh², for the backward. Returns the
// row maximum.
template <typename acc_t, typename scalar_t>
acc_t prepare_scores(acc_t* s, int64_t n, acc_t scale, const Params& p, int64_t b, int64_t h,
                     int64_t qi, int64_t k0, acc_t* cap_grad = nullptr) {
  const bool capped = p.softcap > 0.0, alibi = p.alibi.data != nullptr;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const acc_t slope = alibi ? static_cast<const float*>(p.alibi.data)[b * p.alibi.s[0] + h * p.alibi.s[1]] : 0.f;
  const acc_t distance0 = static_cast<acc_t>(qi + p.diagonal - k0);
  constexpr bool kCoarse = sizeof(scalar_t) == 2;  // a bf16 or fp16 call
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  acc_t row_max;
  if (capped && alibi) {
    row_max = variant_pass<true, true, kCoarse, kBf16>(s, n, scale, softcap, slope, distance0, cap_grad);
  } else if (capped) {
    row_max = variant_pass<true, false, kCoarse, kBf16>(s, n, scale, softcap, slope, distance0, cap_grad);
  } else if (alibi) {
    row_max = variant_pass<false, true, kCoarse, kBf16>(s, n, scale, softcap, slope, distance0, cap_grad);
  } else {
    row_max = variant_pass<false, false, kCoarse, kBf16>(s, n, scale, softcap, slope, distance0, cap_grad);
  }
  if (p.mask_kind == MaskKind::None && p.key_padding.data == nullptr) return row_max;
  if (p.mask_kind != MaskKind::None) {
    const int64_t step = p.mask.s[3];
    const int64_t offset = b * p.mask.s[0] + h * p.mask.s[1] + qi * p.mask.s[2] + k0 * step;
    if (p.mask_kind == MaskKind::Bool) {
      const bool* row = static_cast<const bool*>(p.mask.data) + offset;
      for (int64_t i = 0; i < n; ++i) {
        if (!row[i * step]) s[i] = neg_inf<acc_t>();
      }
    } else {
      const scalar_t* row = static_cast<const scalar_t*>(p.mask.data) + offset;
      for (int64_t i = 0; i < n; ++i) s[i] += static_cast<acc_t>(row[i * step]);
    }
  }
  if (p.key_padding.data != nullptr) {
    const int64_t step = p.key_padding.s[1];
    const bool* row = static_cast<const bool*>(p.key_padding.data) + b * p.key_padding.s[0] + k0 * step;
    for (int64_t i = 0; i < n; ++i) {
      if (row[i * step]) s[i] = neg_inf<acc_t>();
    }
  }
  return row_max_of(s, n);
}

// The program's partial tile hides the keys k0 .. k0 + n of query qi whose bits are clear: their scores
// become -inf. `row` is the query's bits in the tile (BlockProgram::row); the n keys lie in that one tile.
template <typename acc_t>
inline void hide_unseen(acc_t* s, int64_t n, int64_t k0, const uint32_t* row) {
  const int64_t first = k0 % fused_attn::kTile;
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {  // 16 bits of the row are the mask of 16 scores
    const __m512 hidden = _mm512_set1_ps(neg_inf<float>());
    for (; i + 16 <= n; i += 16) {
      const int64_t key = first + i, word = key / 32;
      uint64_t bits = row[word];
      if (word + 1 < fused_attn::kWords) bits |= static_cast<uint64_t>(row[word + 1]) << 32;
      const __mmask16 seen = static_cast<__mmask16>(bits >> (key % 32));
      _mm512_storeu_ps(s + i, _mm512_mask_mov_ps(hidden, seen, _mm512_loadu_ps(s + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const int64_t key = first + i;
    if (((row[key / 32] >> (key % 32)) & 1u) == 0) s[i] = neg_inf<acc_t>();
  }
}

// Scores s[0, n) of query qi, keys k0 + first on, hidden where the program says: `states` are the states of
// the tiles from key k0 (a multiple of kTile) on; an empty tile hides all its keys, a partial one those whose
// bits are clear.
template <typename acc_t>
inline void hide_by_program(const Params& p, acc_t* s, int64_t n, int64_t k0, int64_t first, int64_t qi,
                            const int32_t* states) {
  for (int64_t j = 0; j < n;) {
    const int64_t offset = first + j, tile = offset / fused_attn::kTile;
    const int64_t segment = std::min(n - j, (tile + 1) * fused_attn::kTile - offset);
    if (states[tile] == fused_attn::kTileEmpty) {
      std::fill(s + j, s + j + segment, neg_inf<acc_t>());
    } else if (states[tile] >= 0) {
      hide_unseen(s + j, segment, k0 + offset, p.program.row(states[tile], qi));
    }
    j += segment;
  }
}

// Where a block's products may start inside a key block: a multiple of 16 keys keeps the VNNI pairs of packed
// K and V and the vectors of each row aligned.
constexpr int64_t kKeyAlign = 16;

inline int64_t round_down(int64_t x, int64_t m) { return x / m * m; }

// The keys k0 + first .. k0 + end of a key block that a query block (rows from q0, inside one tile row) computes:
// those up to `width`, the last key its last row sees (relative to k0); from `first_key`, the first key its first
// row sees (a window's start, rounded down to kKeyAlign); with a program, from the first to the last tile it sees
// (k0 a multiple of kTile), whose states go to `states`. end 0: it computes none. `hides`: a tile between hides
// keys (empty, or partial); a run of full tiles needs nothing per score.
struct BlockKeys {
  int64_t first = 0, end = 0;
  bool hides = false;
};

inline BlockKeys block_keys(const Params& p, int64_t b, int64_t h, int64_t q0, int64_t k0, int64_t width,
                            int64_t first_key, int32_t* states) {
  constexpr int64_t T = fused_attn::kTile;
  BlockKeys keys;
  if (width <= 0) return keys;
  if (!p.program.present()) {
    keys.first = std::max<int64_t>(0, round_down(first_key - k0, kKeyAlign));
    if (keys.first < width) keys.end = width;
    return keys;
  }
  for (int64_t t = 0; t * T < width; ++t) {
    states[t] = p.program.tile(b, h, q0, k0 + t * T);
    if (states[t] == fused_attn::kTileEmpty) continue;
    if (keys.end == 0) keys.first = t * T;
    keys.end = std::min(width, (t + 1) * T);
  }
  for (int64_t t = keys.first / T; t * T < keys.end; ++t) keys.hides |= states[t] != fused_attn::kTileFull;
  return keys;
}

// 2^t for t < 128 (up to rounding) and -inf, for probabilities rounded to bf16/fp16 next: ATen's
// fexp_u20's polynomial in t's fraction f (~1e-4 relative error) without its range checks, which t never needs
// (a weight is at most e^kShiftSlack, 2^11.6). On AVX-512 vscalefps multiplies it by 2^floor(t), masked to
// t >= -126 because it takes a microcode assist wherever its result underflows (bench/NOTES.md section 52):
// below 2^-126, -inf included, +0; NaN stays NaN. Elsewhere fexp_u20's construction of the exponent field, which
// a clamp on the bits stops at +0 below 2^-127.
inline Vectorized<float> exp2_of_weight(Vectorized<float> t) {
  using V = Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF);  // t - floor(t) in one instruction
  // 1 + f - correction(f), the cubic of the branch below.
  __m512 power = _mm512_fmadd_ps(f, _mm512_set1_ps(0.079204240219773236f), _mm512_set1_ps(0.22433836478672356f));
  power = _mm512_fmadd_ps(f, power, _mm512_set1_ps(1.f - 0.30354260500649682f));
  power = _mm512_fmadd_ps(f, power, _mm512_set1_ps(1.f - 0.00010703434948458272f));
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(normal, power, t);
#else
  t = at::vec::clamp_min(t, V(-127.f));  // floor(-inf) would make the fraction NaN
  const V fraction = t - t.floor();
  V correction = at::vec::fmadd(fraction, V(-0.079204240219773236f), V(-0.22433836478672356f));
  correction = at::vec::fmadd(fraction, correction, V(0.30354260500649682f));
  correction = at::vec::fmadd(fraction, correction, V(0.00010703434948458272f));
  // (t - correction + 127) · 2^23 read as float bits is 2^t; below 2^-127 the bits would go
  // negative, so they stop at 0, which reads as +0.
  const V bits = at::vec::clamp_min(at::vec::fmadd(t - correction, V(8388608.f), V(1065353216.f)), V(0.f));
  return at::vec::cast<float>(at::vec::convert_to_int_of_same_size(bits));
#endif
}

// e where arg >= threshold, else 0.
inline Vectorized<float> zero_below(Vectorized<float> e, Vectorized<float> arg, Vectorized<float> threshold) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(arg, threshold, _CMP_GE_OQ), e);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_and_ps(_mm256_cmp_ps(arg, threshold, _CMP_GE_OQ), e);
#else
  return Vectorized<float>::blendv(Vectorized<float>(0.f), e, arg >= threshold);
#endif
}

// 2W floats a, b as 2W values of dst_t at dst. On the AVX512-BF16 copy bf16 takes one instruction (round to
// nearest even, as ATen's conversion; denormal inputs become 0) where ATen's conversion, written for AVX512
// without BF16, takes about ten: 10 % of a bf16 backward of chunks (bench/NOTES.md section 43).
template <typename dst_t>
inline void store_pair(dst_t* dst, const Vectorized<float>& a, const Vectorized<float>& b) {
#if defined(FUSED_ATTN_AVX512_BF16)
  if constexpr (std::is_same_v<dst_t, c10::BFloat16>) {
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    return;
  }
#endif
  at::vec::convert_from_float<dst_t>(a, b).store(dst);
}

// The first `count` (< 2W) values of e0, e1 into out as its type, from registers: the ragged end of a row. A
// masked store read back for a conversion stalls on the store (bench/NOTES.md section 43).
template <typename acc_t, typename ct>
inline void store_weights(const Vectorized<acc_t>& e0, const Vectorized<acc_t>& e1, ct* out, int64_t count) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  if constexpr (std::is_same_v<ct, acc_t>) {
    e0.store(out, std::min(W, count));
    if (count > W) e1.store(out + W, count - W);
  } else {
#if defined(FUSED_ATTN_AVX512_BF16)
    if constexpr (std::is_same_v<ct, c10::BFloat16>) {
      _mm512_mask_storeu_epi16(out, static_cast<__mmask32>((uint32_t(1) << count) - 1),
                               (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      return;
    }
#endif
    at::vec::convert_from_float<ct>(e0, e1).store(out, count);
  }
}

// dst[0..n) = src[0..n) (floats) as dst_t, factor times src where given.
template <typename dst_t>
inline void convert_floats(const float* src, dst_t* dst, int64_t n, float factor = 1.f) {
  using V = Vectorized<float>;
  constexpr int64_t W = V::size();
  const V scale(factor);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const V a = V::loadu(src + j) * scale, b = V::loadu(src + j + W) * scale;
    if constexpr (std::is_same_v<dst_t, float>) {
      a.store(dst + j);
      b.store(dst + j + W);
    } else {
      store_pair(dst + j, a, b);
    }
  }
  if (j < n) {
    const int64_t count = n - j, low = std::min<int64_t>(W, count);
    store_weights(V::loadu(src + j, low) * scale, count > W ? V::loadu(src + j + W, count - W) * scale : V(0.f),
                  dst + j, count);
  }
}

template <typename T>
inline void scale_row(T* x, int64_t n, T factor) {
  at::vec::map([factor](Vectorized<T> v) { return v * Vectorized<T>(factor); }, x, x, n);
}

// Whether some lane of a or b lies above the same lane of limit or is NaN (a NaN score then makes the row's shift
// NaN, softmax_step). Two compares into mask registers: ATen's maximum of a and b, which carries NaN through, takes
// four instructions, in the exp pass's loop.
template <typename T>
inline bool any_above(const Vectorized<T>& a, const Vectorized<T>& b, const Vectorized<T>& limit) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return (_mm512_cmp_ps_mask(a, limit, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(b, limit, _CMP_NLE_UQ)) != 0;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 above = _mm256_or_ps(_mm256_cmp_ps(a, limit, _CMP_NLE_UQ), _mm256_cmp_ps(b, limit, _CMP_NLE_UQ));
    return _mm256_movemask_ps(above) != 0;
  }
#endif
  __at_align__ T lanes[2 * Vectorized<T>::size()], limits[Vectorized<T>::size()];
  a.store(lanes);
  b.store(lanes + Vectorized<T>::size());
  limit.store(limits);
  for (int64_t i = 0; i < 2 * Vectorized<T>::size(); ++i) {
    if (!(lanes[i] <= limits[i % Vectorized<T>::size()])) return true;
  }
  return false;
}

// The online softmax's shift: the exp of a row's scores is taken against a shift of its own, which need not be
// their maximum (O / l and lse = shift + log l come out the same) as long as no weight overflows and the largest
// are not lost below the smallest normal numbers. A row's shift is the largest of some of its (scaled) scores, and
// it moves up to a new largest only where that lies more than kShiftSlack above it: weights stay within 1 and e^8
// (2981, within fp16's range), and the accumulator is rescaled only when a row's scores jump.
constexpr double kShiftSlack = 8.0;

// out[j] = exp(s[j] * scale - shift) for j < n, as ct; returns their sum. s may hold -inf (hidden keys),
// which gives 0 in every exp below. P meant for bf16/fp16 products (operand_t) is rounded to 8 or 11 bits
// anyway, so it takes the cheaper exp2_of_weight, and with kFoldLog2e, log2(e) rides in the scale and shift (one
// multiply-add for x·scale − shift and the change of base); float and double P take ATen's exp_u20 and std::exp.
// kRising: the shift (-inf: none yet) rises where a pair of vectors holds a score more than kShiftSlack above it,
// at most once past the first weights (the weights before it rescaled: recomputed from s where P has its own
// buffer, multiplied where P overwrites the scores); on return it holds the shift of the weights, -inf where every
// score is -inf.
// Plain scores are then read once, their maximum found on the way.
template <bool kFoldLog2e, typename operand_t, bool kRising, typename acc_t, typename ct>
acc_t exp_row_pass(acc_t* s, int64_t n, acc_t scale, acc_t& shift, ct* out) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  constexpr acc_t log2e = acc_t(1.4426950408889634);
  const V vscale(kFoldLog2e ? scale * log2e : scale);
  V vshift, limit;  // limit: in units of s, the scores above which the shift rises
  const auto set_shift = [&](acc_t to) {
    shift = to;
    const acc_t finite = to == neg_inf<acc_t>() ? acc_t(0) : to;  // -inf scores, the only ones then, give 0
    vshift = V(kFoldLog2e ? -finite * log2e : -finite);
    if constexpr (kRising) limit = V(to == neg_inf<acc_t>() ? to : (to + acc_t(kShiftSlack)) / scale);
  };
  set_shift(shift);
  // Float and fp16 weights under 2^-64 of the shift (within e^8 of the row's largest) become 0: next to the largest
  // they change no sum, and their products with V would be denormal numbers, each costing the FMA
  // units a microcode assist (ALiBi's distant keys made a fifth of the call's time of them). bf16
  // weights skip it: AMX's and AVX512-BF16's products take denormal inputs as zero anyway, and there
  // the compare and masked move are a measurable part of the forward (bench/NOTES.md, section 28).
  constexpr bool kFlush = std::is_same_v<acc_t, float> && !std::is_same_v<ct, c10::BFloat16>;
  const V flush_below(kFoldLog2e ? acc_t(-64) : acc_t(-44.361419555836500));
  const auto flushed = [&](const V& e, const V& arg) {
    if constexpr (kFlush) return zero_below(e, arg, flush_below);
    return e;
  };
  auto exp_of = [&](const V& x) {
    const V arg = at::vec::fmadd(x, vscale, vshift);
    if constexpr (kFoldLog2e) {
      return flushed(exp2_of_weight(arg), arg);
    } else if constexpr (kVnni<operand_t>) {
      return flushed(exp2_of_weight(arg * V(log2e)), arg);
    } else {
      return flushed(vexp(arg), arg);
    }
  };
  const auto store_two = [&](ct* dst, const V& e0, const V& e1) {
    if constexpr (std::is_same_v<ct, acc_t>) {
      e0.store(dst);
      e1.store(dst + W);
    } else {
      store_pair(dst, e0, e1);
    }
  };
  V sum0(acc_t(0)), sum1(acc_t(0));
  // The shift rises where some lane of x0, x1 (keys done .. done + 2W) lies above the limit: to their largest at a
  // row's first keys; past weights already written, to the largest of the rest of the row, so that they are
  // rescaled once in a pass (scores that climb steadily along the keys would rise at every pair).
  const auto rise_to = [&](const V& x0, const V& x1, int64_t done) {
    if (!any_above(x0, x1, limit) || std::isnan(shift)) return;  // a NaN shift stays: the row's result is NaN
    const V top = at::vec::maximum(x0, x1);
    const acc_t before = shift;
    acc_t largest = at::vec::vec_reduce_all<acc_t>([](V& x, V& y) { return at::vec::maximum(x, y); }, top);
    if (before != neg_inf<acc_t>() && done > 0 && done + 2 * W < n) {
      largest = std::max(largest, row_max_of(s + done + 2 * W, n - done - 2 * W));
    }
    set_shift(largest * scale);
    if (before == neg_inf<acc_t>() || done == 0) return;  // no weight yet
    const acc_t factor = std::exp(before - shift);
    sum0 = sum0 * V(factor);
    sum1 = sum1 * V(factor);
    if constexpr (std::is_same_v<ct, acc_t>) {
      scale_row(out, done, factor);
    } else {
      for (int64_t i = 0; i < done; i += 2 * W) {
        store_two(out + i, exp_of(V::loadu(s + i)), exp_of(V::loadu(s + i + W)));
      }
    }
  };
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const V x0 = V::loadu(s + j), x1 = V::loadu(s + j + W);
    if constexpr (kRising) rise_to(x0, x1, j);
    const V e0 = exp_of(x0), e1 = exp_of(x1);
    sum0 = sum0 + e0;
    sum1 = sum1 + e1;
    store_two(out + j, e0, e1);
  }
  if (j < n) {  // the lanes past n hold -inf, whose exp is 0
    const int64_t count = n - j;  // < 2W
    const int64_t low = std::min<int64_t>(W, count);
    const V x0 = V::set(V(neg_inf<acc_t>()), V::loadu(s + j, low), low);
    const V x1 = count > W ? V::set(V(neg_inf<acc_t>()), V::loadu(s + j + W, count - W), count - W)
                           : V(neg_inf<acc_t>());
    if constexpr (kRising) rise_to(x0, x1, j);
    const V e0 = exp_of(x0), e1 = exp_of(x1);
    sum0 = sum0 + e0;
    sum1 = sum1 + e1;
    store_weights(e0, e1, out + j, count);
  }
  return at::vec::vec_reduce_all<acc_t>([](V& x, V& y) { return x + y; }, sum0 + sum1);
}

// The rounding of shift·log2(e) moves P by under 4e-5 relative where the shift is at most 256 in magnitude.
template <typename acc_t>
inline bool folds_log2e(acc_t shift) {
  return std::abs(shift) <= acc_t(256) || shift == neg_inf<acc_t>();
}

// exp_row_pass for weights that feed products of operand_t (the backward keeps them in float for dS, whose
// products are bf16/fp16 too), with log2(e) folded into the multiply-add wherever that is exact enough: for
// bf16/fp16 products and a shift of at most 256 in magnitude (folds_log2e). Larger shifts, such as rows fully masked
// by an additive mask at the dtype's lowest value, form the difference first: folded, the rounding of
// shift·log2(e) would swamp it, or overflow.
// kRising: `shift` in, the row's shift so far (-inf: none), and out, the one the weights are relative to; a shift
// that rises past folds_log2e takes the pass again unfolded (P then has its own buffer: the scores are still there).
// It needs scale > 0 (scores_are_plain): the pass compares raw scores against the shift divided by the scale.
// Without kRising the shift stays as given.
template <typename operand_t, bool kRising = false, typename acc_t, typename ct>
acc_t exp_row(acc_t* s, int64_t n, acc_t scale, acc_t& shift, ct* out) {
  if constexpr (kVnni<operand_t>) {
    static_assert(!kRising || !std::is_same_v<ct, acc_t>, "bf16/fp16 products take weights of their own type");
    if (folds_log2e(shift)) {
      acc_t tried = shift;
      const acc_t sum = exp_row_pass<true, operand_t, kRising>(s, n, scale, tried, out);
      if (!kRising || folds_log2e(tried)) {
        shift = tried;
        return sum;
      }
    }
  }
  return exp_row_pass<false, operand_t, kRising>(s, n, scale, shift, out);
}

// Writes acc values, times `factor`, to a strided row of the output type. A unit-stride row is scaled and
// converted in one inline pass (every row of every output and gradient goes through here: with a program's
// short rows, two calls per row were 5 % of a bf16 forward).
template <typename st, typename acc_t>
inline void store_row(st* dst, int64_t stride, const acc_t* src, int64_t n, acc_t factor) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  if (stride == 1) {
    if constexpr (std::is_same_v<acc_t, float>) {
      convert_floats(src, dst, n, factor);
      return;
    } else {
      const V scale(factor);
      for (; j + W <= n; j += W) (V::loadu(src + j) * scale).store(dst + j);
    }
  }
  for (; j < n; ++j) dst[j * stride] = static_cast<st>(src[j] * factor);
}

// How a row ends, from its shift m (near its maximum) and the sum l of its visible weights (relative to m): the
// factor that turns its accumulator into the output (keep_scale / normaliser; 0 for a row with nothing
// to normalise) and its log-sum-exp. A sink (fused_attn/scores.py) adds exp(sink - m) to the
// normaliser and nothing to the accumulator; a row that saw no key then has lse = sink.
template <typename acc_t>
struct RowEnd {
  acc_t factor, lse;
};

template <typename acc_t>
inline RowEnd<acc_t> finish_row(const Params& p, int64_t h, acc_t m, acc_t l, acc_t keep_scale) {
  if (std::isnan(m) || std::isnan(l)) return {m + l, m + l};  // a NaN score was seen: output and lse NaN
  const acc_t sink = p.sinks == nullptr ? neg_inf<acc_t>() : static_cast<const acc_t*>(p.sinks)[h];
  if (sink == neg_inf<acc_t>()) {
    if (l > acc_t(0)) return {keep_scale / l, m + std::log(l)};
    return {acc_t(0), neg_inf<acc_t>()};
  }
  if (!(l > acc_t(0))) return {acc_t(0), sink};
  const acc_t top = std::max(m, sink), kept = std::exp(m - top);
  const acc_t total = l * kept + std::exp(sink - top);
  return {keep_scale * kept / total, top + std::log(total)};
}

// ---------------------------------------------------------------------------------------------
// Dropout (csrc/dropout.h): the random integers of a row's keys k0 .. k0 + n, then the row with the
// dropped entries zeroed and, where asked, the kept ones scaled.

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// A Philox block per 64-bit lane, its counter words in the lanes' low halves: vpmuludq multiplies the
// low halves into whole 64-bit products, so a product is the next low word as it stands and, its halves
// swapped (vpshufd, the shuffle port), the next high word; the high halves the rounds leave behind are
// never read. No permutation puts halves back into 32-bit lanes (bench/NOTES.md, section 64).
#if defined(CPU_CAPABILITY_AVX512)
using PhiloxLanes = __m512i;
inline __m512i splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline __m512i xor3(__m512i a, __m512i b, __m512i c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
inline __m512i products(__m512i a, __m512i multiplier) { return _mm512_mul_epu32(a, multiplier); }
inline __m512i swap_halves(__m512i x) { return _mm512_shuffle_epi32(x, _MM_PERM_CDAB); }
// Four registers of blocks in flight hide the products' latency (bench/NOTES.md, section 66).
constexpr int kPhiloxRegisters = 4, kBlocksPerRegister = 8;
// Blocks block0 + first, block0 + first + 2, ...: one register of even blocks, one of odd ones.
inline __m512i every_other_block(uint32_t block0, int first) {
  return _mm512_add_epi64(_mm512_set1_epi64(block0 + first), _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14));
}
// [a, b] in each 64-bit lane: a's low half, b's low half moved up.
inline __m512i pair_words(__m512i a, __m512i b) { return _mm512_mask_shuffle_epi32(a, 0xAAAA, b, _MM_PERM_CDAB); }
inline __m512i low_pairs(__m512i a, __m512i b) { return _mm512_unpacklo_epi64(a, b); }
inline __m512i high_pairs(__m512i a, __m512i b) { return _mm512_unpackhi_epi64(a, b); }
// Lanes x, y, z, w of block_lanes stored as sixteen blocks in order: a 4x4 transpose of 128-bit lanes.
inline void store_in_block_order(__m512i x, __m512i y, __m512i z, __m512i w, uint32_t* keys) {
  const __m512i v0 = _mm512_shuffle_i32x4(x, z, 0x44), v1 = _mm512_shuffle_i32x4(y, w, 0x44);
  const __m512i v2 = _mm512_shuffle_i32x4(x, z, 0xEE), v3 = _mm512_shuffle_i32x4(y, w, 0xEE);
  _mm512_storeu_si512(keys, _mm512_shuffle_i32x4(v0, v1, 0x88));
  _mm512_storeu_si512(keys + 16, _mm512_shuffle_i32x4(v0, v1, 0xDD));
  _mm512_storeu_si512(keys + 32, _mm512_shuffle_i32x4(v2, v3, 0x88));
  _mm512_storeu_si512(keys + 48, _mm512_shuffle_i32x4(v2, v3, 0xDD));
}
#else
using PhiloxLanes = __m256i;
// Two registers of blocks: four, at four words each, would take all sixteen of AVX2's registers.
constexpr int kPhiloxRegisters = 2, kBlocksPerRegister = 4;
inline __m256i splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline __m256i xor3(__m256i a, __m256i b, __m256i c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
inline __m256i products(__m256i a, __m256i multiplier) { return _mm256_mul_epu32(a, multiplier); }
inline __m256i swap_halves(__m256i x) { return _mm256_shuffle_epi32(x, 0xB1); }
inline __m256i every_other_block(uint32_t block0, int first) {
  return _mm256_add_epi64(_mm256_set1_epi64x(block0 + first), _mm256_setr_epi64x(0, 2, 4, 6));
}
inline __m256i pair_words(__m256i a, __m256i b) { return _mm256_blend_epi32(a, swap_halves(b), 0xAA); }
inline __m256i low_pairs(__m256i a, __m256i b) { return _mm256_unpacklo_epi64(a, b); }
inline __m256i high_pairs(__m256i a, __m256i b) { return _mm256_unpackhi_epi64(a, b); }
// Lanes x, y, z, w of block_lanes stored as eight blocks in order.
inline void store_in_block_order(__m256i x, __m256i y, __m256i z, __m256i w, uint32_t* keys) {
  auto* out = reinterpret_cast<__m256i*>(keys);
  _mm256_storeu_si256(out, _mm256_permute2x128_si256(x, z, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(y, w, 0x20));
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(x, z, 0x31));
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(y, w, 0x31));
}
#endif

// One round of csrc/dropout.h on counter words c[0] .. c[3], round key (k0, k1).
inline void philox_lanes_round(PhiloxLanes (&c)[4], PhiloxLanes k0, PhiloxLanes k1) {
  const PhiloxLanes product0 = products(c[0], splat(0xD2511F53u)), product1 = products(c[2], splat(0xCD9E8D57u));
  c[0] = xor3(swap_halves(product1), c[1], k0);
  c[2] = xor3(swap_halves(product0), c[3], k1);
  c[1] = product1;
  c[3] = product0;
}

// The ten rounds on kPhiloxRegisters registers of independent blocks.
inline void philox_rounds(PhiloxLanes (&c)[kPhiloxRegisters][4], uint32_t key0, uint32_t key1) {
  for (int round = 0; round < fused_attn::kPhiloxRounds; ++round) {
    const PhiloxLanes k0 = splat(key0), k1 = splat(key1);
    for (int r = 0; r < kPhiloxRegisters; ++r) philox_lanes_round(c[r], k0, k1);
    key0 += fused_attn::kPhiloxKeyBump0;
    key1 += fused_attn::kPhiloxKeyBump1;
  }
}

// The words of an even register's blocks and the next odd one's, after the rounds, as one 128-bit lane a block
// ([w0, w1, w2, w3]) in the order x: blocks 0, 4, ..; y: 2, 6, ..; z: 1, 5, ..; w: 3, 7, .. of the pair's.
inline void block_lanes(const PhiloxLanes (&even)[4], const PhiloxLanes (&odd)[4], PhiloxLanes& x, PhiloxLanes& y,
                        PhiloxLanes& z, PhiloxLanes& w) {
  // [w0, w1] and [w2, w3] of each block in one 64-bit lane, then a block's four words in one 128-bit lane.
  const PhiloxLanes even01 = pair_words(even[0], even[1]), even23 = pair_words(even[2], even[3]);
  const PhiloxLanes odd01 = pair_words(odd[0], odd[1]), odd23 = pair_words(odd[2], odd[3]);
  x = low_pairs(even01, even23);
  y = high_pairs(even01, even23);
  z = low_pairs(odd01, odd23);
  w = high_pairs(odd01, odd23);
}

constexpr int kPhiloxBlocks = kPhiloxRegisters * kBlocksPerRegister;

// Philox4x32-10 on kPhiloxBlocks blocks whose counters differ in the first word only (block0 + 0, 1, ..),
// written to `keys` in key order: output c of block i is key 4 i + c. Register pair j holds blocks
// block0 + 2 W j + 0 .. 2 W - 1 (W blocks a register), evens in the first.
inline void philox_blocks(uint32_t block0, uint32_t query, uint32_t batch_head, uint32_t offset, uint32_t key0,
                          uint32_t key1, uint32_t* keys) {
  constexpr int kPairBlocks = 2 * kBlocksPerRegister;
  PhiloxLanes c[kPhiloxRegisters][4];
  for (int r = 0; r < kPhiloxRegisters; ++r) {
    c[r][0] = every_other_block(block0 + kPairBlocks * (r / 2), r % 2);
    c[r][1] = splat(query);
    c[r][2] = splat(batch_head);
    c[r][3] = splat(offset);
  }
  philox_rounds(c, key0, key1);
  for (int pair = 0; pair < kPhiloxRegisters / 2; ++pair) {
    PhiloxLanes x, y, z, w;  // 128-bit lane j: the pair's blocks 4 j, 4 j + 2, 4 j + 1, 4 j + 3
    block_lanes(c[2 * pair], c[2 * pair + 1], x, y, z, w);
    store_in_block_order(x, y, z, w, keys + 4 * kPairBlocks * pair);
  }
}
#else
constexpr int kPhiloxBlocks = 16;

inline void philox_blocks(uint32_t block0, uint32_t query, uint32_t batch_head, uint32_t offset, uint32_t key0,
                          uint32_t key1, uint32_t* keys) {
  constexpr int kBlocks = kPhiloxBlocks;
  uint32_t c0[kBlocks], c1[kBlocks], c2[kBlocks], c3[kBlocks];
  for (int i = 0; i < kBlocks; ++i) {
    c0[i] = block0 + static_cast<uint32_t>(i);
    c1[i] = query;
    c2[i] = batch_head;
    c3[i] = offset;
  }
  fused_attn::philox4x32_10_blocks(c0, c1, c2, c3, key0, key1);
  for (int i = 0; i < kBlocks; ++i) {
    keys[4 * i] = c0[i];
    keys[4 * i + 1] = c1[i];
    keys[4 * i + 2] = c2[i];
    keys[4 * i + 3] = c3[i];
  }
}
#endif

// One Philox block per four keys, kPhiloxBlocks blocks at a time; k0 need not be a multiple of 4.
inline void dropout_row_bits(const fused_attn::DropoutParams& d, int64_t batch_head, int64_t query, int64_t k0,
                             int64_t n, uint32_t* bits) {
  constexpr int kBlocks = kPhiloxBlocks;
  query += d.query_start;  // the stream's positions (csrc/dropout.h)
  k0 += d.key_start;
  const int64_t first_block = k0 / 4, end_block = (k0 + n + 3) / 4;
  for (int64_t block0 = first_block; block0 < end_block; block0 += kBlocks) {
    const int64_t from = std::max<int64_t>(4 * block0, k0), to = std::min<int64_t>(4 * (block0 + kBlocks), k0 + n);
    // Whole blocks straight into the row's bits; a partial one at either end through a buffer.
    const bool whole = from == 4 * block0 && to == 4 * (block0 + kBlocks);
    alignas(64) uint32_t buffer[4 * kBlocks];
    uint32_t* keys = whole ? bits + (from - k0) : buffer;
    philox_blocks(static_cast<uint32_t>(block0), static_cast<uint32_t>(query), static_cast<uint32_t>(batch_head),
                  d.offset, static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32), keys);
    if (!whole) {
      std::memcpy(bits + (from - k0), buffer + (from - 4 * block0), static_cast<size_t>(to - from) * sizeof(uint32_t));
    }
  }
}

// A select, not a conditional store: the compiler makes it one compare and one blend per vector
// (the conditional store became a test of each vector followed by scalar stores).
template <typename T>
inline void drop_row(T* row, const uint32_t* bits, int64_t n, uint32_t threshold) {
  for (int64_t j = 0; j < n; ++j) row[j] = bits[j] < threshold ? T(0) : row[j];
}

// The select before the product: with the product in the select's arm, GCC 12 leaves the AVX2 copy's loop
// scalar behind a branch per key ("control flow in loop"; bench/NOTES.md, section 65). 0 · kept is 0.
template <typename T>
inline void drop_and_scale_row(T* row, const uint32_t* bits, int64_t n, uint32_t threshold, T kept) {
  for (int64_t j = 0; j < n; ++j) row[j] = (bits[j] < threshold ? T(0) : row[j]) * kept;
}

// ---------------------------------------------------------------------------------------------
// Forward.

// The per-thread buffers of the online softmax: scores and weights of `block_rows` rows against a key
// block of `block_k` keys, and the running state (output accumulator, shift, sum) of `rows` rows.
// bf16/fp16 weights have their own buffer; float ones overwrite the scores.
template <typename acc_t, typename ct>
struct SoftmaxBuffers {
  static constexpr bool separate_p = !std::is_same_v<ct, acc_t>;
  acc_t* scores;
  ct* probs;
  acc_t* out;
  acc_t* row_shift;
  acc_t* row_sum;
  uint32_t* bits;  // dropout's random integers of one row, or null

  static size_t bytes(const Params& p, int64_t block_rows, int64_t rows, int64_t block_k, int64_t block_k_pad) {
    return Scratch::bytes<acc_t>(block_rows * block_k) + (separate_p ? Scratch::bytes<ct>(block_rows * block_k_pad) : 0) +
           Scratch::bytes<acc_t>(rows * p.dim_v) + 2 * Scratch::bytes<acc_t>(rows) +
           (p.dropout.enabled ? Scratch::bytes<uint32_t>(block_k) : 0);
  }

  SoftmaxBuffers(Scratch& scratch, const Params& p, int64_t block_rows, int64_t rows, int64_t block_k,
                 int64_t block_k_pad)
      : scores(scratch.take<acc_t>(block_rows * block_k)),
        probs(separate_p ? scratch.take<ct>(block_rows * block_k_pad) : reinterpret_cast<ct*>(scores)),
        out(scratch.take<acc_t>(rows * p.dim_v)),
        row_shift(scratch.take<acc_t>(rows)),
        row_sum(scratch.take<acc_t>(rows)),
        bits(p.dropout.enabled ? scratch.take<uint32_t>(block_k) : nullptr) {}

  // Every row before its first key block: nothing seen. The output accumulator is not touched: the
  // first P·V product of each block of rows writes it (rows that see no key yet get 0 there).
  void start(int64_t rows) {
    std::fill(row_shift, row_shift + rows, neg_inf<acc_t>());
    std::fill(row_sum, row_sum + rows, acc_t(0));
  }
};

// One step of the online softmax for query row qi (head h of batch b) over the key block at k0: the
// scores srow[0, width), of which the keys `seen` are visible, become the weights prow[0, width_pad)
// (0 for the keys not seen) against the row's shift *m (kShiftSlack); its sum *l advances, and its output
// accumulator orow (D_v values) is rescaled where the shift rises; at the row's first visible keys it is left alone
// (0, or not yet written by the block's first product). With dropout, the sum is of the undropped weights, and the
// dropped ones are zeroed in prow (the kept ones are scaled at the end).
template <typename scalar_t, typename acc_t, typename ct>
void softmax_step(const Params& p, int64_t b, int64_t h, int64_t qi, KeyRange seen, int64_t k0, int64_t width,
                  int64_t width_pad, acc_t* srow, ct* prow, acc_t* m, acc_t* l, acc_t* orow, uint32_t* bits,
                  const int32_t* tile_states = nullptr) {
  const int64_t first = std::clamp<int64_t>(seen.first - k0, 0, width);
  const int64_t last = std::clamp<int64_t>(seen.end - k0, first, width);
  const int64_t n = last - first;
  const acc_t scale = static_cast<acc_t>(p.scale);
  acc_t shift = *m, sum = 0;
  if (n > 0 && scores_are_plain(p)) {
    // Scaled inside the exp (one fused multiply-add), read once.
    if (tile_states != nullptr) hide_by_program(p, srow + first, n, k0, first, qi, tile_states);
    sum = exp_row<ct, true>(srow + first, n, scale, shift, prow + first);
  } else if (n > 0) {
    acc_t block_max = prepare_scores<acc_t, scalar_t>(srow + first, n, scale, p, b, h, qi, k0 + first);
    if (tile_states != nullptr) {
      hide_by_program(p, srow + first, n, k0, first, qi, tile_states);
      block_max = row_max_of(srow + first, n);
    }
    // A NaN maximum (a NaN score) passes the test, and a NaN shift stays: it carries the NaN to the row's end.
    if (!std::isnan(shift) && !(block_max <= shift + acc_t(kShiftSlack))) shift = block_max;
    if (shift != neg_inf<acc_t>()) sum = exp_row<ct>(srow + first, n, acc_t(1), shift, prow + first);
  }
  if (shift == neg_inf<acc_t>()) {  // no visible key yet: P row 0, state unchanged
    std::fill(prow, prow + width_pad, ct(0));
    return;
  }
  // 1 when the row had no shift (the sum is 0, the accumulator holds nothing to rescale) or keeps it.
  const acc_t alpha = *m == shift || *m == neg_inf<acc_t>() ? acc_t(1) : std::exp(*m - shift);
  std::fill(prow, prow + first, ct(0));
  std::fill(prow + last, prow + width_pad, ct(0));
  if (p.dropout.enabled) {
    dropout_row_bits(p.dropout, b * p.heads_q + h, qi, k0 + first, n, bits);
    drop_row(prow + first, bits, n, p.dropout.threshold);
  }
  *l = *l * alpha + sum;
  *m = shift;
  if (alpha != acc_t(1)) scale_row(orow, p.dim_v, alpha);
}

// Query rows per work item: several query blocks share each packed key/value block (packing costs
// O(block_k · D) per item and key block), as long as there are enough items to keep threads busy; up to
// 1024 rows, and 8 to 32 blocks (forward_impl keeps a bit per block). A program's blocks of 64 rows would
// otherwise pack K and V twice as often per row as the plain 128 (chunks of 1024: 3 % of the forward).
inline int64_t blocks_per_item(int64_t q_blocks, int64_t block_q, int64_t heads, int64_t threads) {
  const int64_t most = std::clamp<int64_t>(1024 / block_q, 8, 32);
  int64_t per_item = 1;
  while (per_item < most && per_item < q_blocks &&
         heads * ((q_blocks + 2 * per_item - 1) / (2 * per_item)) >= 4 * threads) {
    per_item *= 2;
  }
  return per_item;
}

template <typename scalar_t, typename ct>
void forward_impl(const Params& p) {
  using acc_t = typename AccType<scalar_t>::type;
  using lse_t = acc_t;
  constexpr bool vnni = kVnni<ct>;
  constexpr bool separate_p = !std::is_same_v<ct, acc_t>;
  const int64_t BQ = p.block_q, BK = p.block_k;
  const int64_t Lq = p.len_q, D = p.dim_qk, Dv = p.dim_v;
  const int64_t groups = p.heads_q / p.heads_kv;
  const int64_t q_blocks = (Lq + BQ - 1) / BQ;
  const int64_t per_item = blocks_per_item(q_blocks, BQ, p.batch * p.heads_q, at::get_num_threads());
  const int64_t rows_per_item = per_item * BQ;
  const int64_t chunks = (Lq + rows_per_item - 1) / rows_per_item;
  const int64_t Dpad = vnni ? round_up(D, 2) : D;
  const int64_t BKpad = vnni ? round_up(BK, 2) : BK;
  const acc_t keep_scale = static_cast<acc_t>(p.dropout.keep_scale);  // 1 without dropout
  // Query rows that already are the A operand of S = Q Kᵀ (the operand type, contiguous along D,
  // no padding column) feed it in place, at their own row stride; others are packed per item.
  const bool q_in_place = std::is_same_v<scalar_t, ct> && p.query.s[3] == 1 && Dpad == D && p.query.s[2] >= D;
  // So do value rows as the B operand of O += P V where that is plain row-major (not VNNI pairs). An 8-bit
  // cache's keys are dequantized into float rows first (krows), then transposed into Kᵀ; its values straight
  // into the B operand.
  const bool quantized = p.cache != CacheType::Plain;
  const bool v_in_place =
      !vnni && !quantized && std::is_same_v<scalar_t, ct> && p.value.s[3] == 1 && p.value.s[2] >= Dv;
  // A paged cache's key blocks run across its cache blocks (a block of 16 keys per product made the prefill of 512
  // rows against 4096 keys 3x slower than from a dense cache, bench/NOTES.md section 53): their plain rows are
  // gathered first (staged), 8-bit ones dequantized as everywhere.
  const bool staged = p.pages != nullptr && !quantized;
  using Buffers = SoftmaxBuffers<acc_t, ct>;
  const size_t scratch_bytes = (q_in_place ? 0 : Scratch::bytes<ct>(rows_per_item * Dpad)) +
                               Scratch::bytes<ct>(Dpad * BK) + (v_in_place ? 0 : Scratch::bytes<ct>(BKpad * Dv)) +
                               (quantized ? Scratch::bytes<ct>(BK * D) : 0) +
                               (staged ? Scratch::bytes<scalar_t>(BK * D) + Scratch::bytes<scalar_t>(BK * Dv) : 0) +
                               Buffers::bytes(p, BQ, rows_per_item, BK, BKpad);
  const auto* Q = static_cast<const scalar_t*>(p.query.data);
  const auto* K = static_cast<const scalar_t*>(p.key.data);
  const auto* Vt = static_cast<const scalar_t*>(p.value.data);
  auto* O = static_cast<scalar_t*>(p.out.data);
  auto* LSE = static_cast<lse_t*>(p.lse.data);

  parallel_items(p.batch * p.heads_q * chunks, [&](const auto& next_item) {
    Scratch scratch(scratch_bytes, p.poison_scratch);
    ct* qbuf = q_in_place ? nullptr : scratch.take<ct>(rows_per_item * Dpad);
    ct* kbuf = scratch.take<ct>(Dpad * BK);
    ct* vbuf = v_in_place ? nullptr : scratch.take<ct>(BKpad * Dv);
    ct* krows = quantized ? scratch.take<ct>(BK * D) : nullptr;
    scalar_t* k_staged = staged ? scratch.take<scalar_t>(BK * D) : nullptr;
    scalar_t* v_staged = staged ? scratch.take<scalar_t>(BK * Dv) : nullptr;
    Buffers buffers(scratch, p, BQ, rows_per_item, BK, BKpad);
    acc_t *sbuf = buffers.scores, *obuf = buffers.out, *row_shift = buffers.row_shift, *row_sum = buffers.row_sum;
    ct* pbuf = buffers.probs;

    for (int64_t item; (item = next_item()) >= 0;) {
      const int64_t chunk = chunks - 1 - item % chunks;  // a head's last rows, the dearest when causal, first
      const int64_t h = (item / chunks) % p.heads_q;
      const int64_t b = item / (chunks * p.heads_q);
      const int64_t hk = h / groups;
      const int64_t c0 = chunk * rows_per_item;
      const int64_t rows = std::min(rows_per_item, Lq - c0);
      const scalar_t* q_ptr = Q + b * p.query.s[0] + h * p.query.s[1] + c0 * p.query.s[2];
      const ct* q_rows = qbuf;
      int64_t ldq = Dpad;
      if (q_in_place) {
        q_rows = reinterpret_cast<const ct*>(q_ptr);
        ldq = p.query.s[2];
      } else {
        pack_a(qbuf, Dpad, q_ptr, p.query.s[2], p.query.s[3], rows, D);
      }
      buffers.start(rows);
      // Bit i: query block i's accumulator rows hold its first P·V product (blocks_per_item <= 32).
      uint32_t written = 0;

      // The keys these rows see through the window (causal: up to the last row's diagonal); the
      // others are never visited. Query blocks may start at different key blocks.
      const KeyRange span = key_span(p, b);
      int64_t k_begin = visible_keys(p, c0, span).first;
      const int64_t k_end = visible_keys(p, c0 + rows - 1, span).end;
      // With a program, key blocks start on its tiles' columns (BK is a multiple of kTile) and hold only
      // tiles that some query block here sees: a tile no query block sees is not even packed.
      constexpr int64_t T = fused_attn::kTile;
      const bool program = p.program.present();
      if (program) k_begin -= k_begin % T;
      const auto tile_state = [&](int64_t r0, int64_t key) { return p.program.tile(b, h, c0 + r0, key); };
      const auto seen_here = [&](int64_t key) {
        for (int64_t r0 = 0; r0 < rows; r0 += BQ) {
          if (tile_state(r0, key) != fused_attn::kTileEmpty) return true;
        }
        return false;
      };
      int32_t states[4096 / T];  // of one query block's tiles in a key block (BK <= 4096)
      for (int64_t k0 = k_begin, bk; k0 < k_end; k0 += bk) {
        if (program) {
          bk = std::min(T, k_end - k0);
          if (!seen_here(k0)) continue;
          while (bk < BK && k0 + bk < k_end && seen_here(k0 + bk)) bk = std::min({bk + T, BK, k_end - k0});
        } else {
          bk = std::min(BK, k_end - k0);
        }
        const int64_t bkpad = vnni ? round_up(bk, 2) : bk;
        const int64_t ldp = separate_p ? bkpad : bk;
        // Kᵀ block as B (D × bk); V block as B (bk × Dv): packed once for all query blocks here.
        const ct* v_rows = vbuf;
        int64_t ldv = Dv;
        if (quantized) {
          dequantize_keys(p, p.key, p.k_scale, b, hk, k0, bk, D, krows, D);
          pack_b(kbuf, krows, 1, D, D, Dpad, bk);
          dequantize_keys(p, p.value, p.v_scale, b, hk, k0, bk, Dv, vbuf, Dv);
        } else if (staged) {
          gather_rows(p, p.key, K, b, hk, k0, bk, D, k_staged, D);
          pack_b(kbuf, k_staged, 1, D, D, Dpad, bk);
          gather_rows(p, p.value, Vt, b, hk, k0, bk, Dv, v_staged, Dv);
          if (v_in_place) {
            v_rows = reinterpret_cast<const ct*>(v_staged);
            ldv = Dv;
          } else {
            pack_b(vbuf, v_staged, Dv, 1, bk, bkpad, Dv);
          }
        } else {
          pack_b(kbuf, key_row(p, p.key, K, b, hk, k0), p.key.s[3], p.key.s[2], D, Dpad, bk);
          if (v_in_place) {
            v_rows = reinterpret_cast<const ct*>(key_row(p, p.value, Vt, b, hk, k0));
            ldv = p.value.s[2];
          } else {
            pack_b(vbuf, key_row(p, p.value, Vt, b, hk, k0), p.value.s[2], p.value.s[3], bk, bkpad, Dv);
          }
        }

        for (int64_t r0 = 0; r0 < rows; r0 += BQ) {
          const int64_t q0 = c0 + r0;
          const int64_t bq = std::min(BQ, rows - r0);
          const int64_t block_first = visible_keys(p, q0, span).first;
          const int64_t block_end = visible_keys(p, q0 + bq - 1, span).end;
          if (block_end <= k0 || block_first >= k0 + bk) continue;  // no row of this block sees these keys
          // The products stop at the last key the block's last query sees and, with a program, run from the first
          // to the last tile the block sees: the keys and values of the tiles before the first one stay unread
          // (their weights are 0, but a 0 times a NaN in memory nobody sees would be NaN).
          const BlockKeys keys = block_keys(p, b, h, q0, k0, std::min(bk, block_end - k0), block_first, states);
          if (keys.end == 0) continue;
          // From here on the block is keys kb .. kb + w: lead is a multiple of kKeyAlign (of kTile with a program),
          // so the VNNI pairs of the packed K and V start there too (a column of Kᵀ is a pair of values in VNNI
          // layout).
          const int64_t lead = keys.first, kb = k0 + lead, w = keys.end - lead;
          // Where the band's diagonal cuts the block, each half of its rows stops at its own last row's key: half
          // the products the cut leaves unused (1-2 % of a forward of chunks, every block of which ends on its
          // diagonal; about 1 % of a causal one). Where a window's start cuts it, each 32 rows run from their own
          // first row's first key to their last row's last: a narrow window's rows see few keys, which the spread
          // of a whole block's starts and ends would more than double (bench/NOTES.md section 36).
          const bool window_cut = !program && bq == BQ && bq >= 64 &&
                                  visible_keys(p, q0 + bq / 2, span).first >= kb + kKeyAlign;
          const bool cut = window_cut || (bq == BQ && bq >= 32 && visible_keys(p, q0 + bq / 2 - 1, span).end < kb + w);
          const int64_t rows_at_once = window_cut ? 32 : cut ? bq / 2 : bq;
          const uint32_t block_bit = uint32_t(1) << (r0 / BQ);
          for (int64_t s0 = r0; s0 < r0 + bq; s0 += rows_at_once) {
            const int64_t sq = std::min(rows_at_once, r0 + bq - s0);
            // These rows' keys: kb + sf .. kb + sw (sf a multiple of kKeyAlign, 0 with a program).
            const int64_t sw = std::clamp<int64_t>(visible_keys(p, c0 + s0 + sq - 1, span).end - kb, 0, w);
            const int64_t sf =
                program ? 0 : std::clamp<int64_t>(round_down(visible_keys(p, c0 + s0, span).first - kb, kKeyAlign), 0, sw);
            const int64_t n = sw - sf, npad = vnni ? round_up(n, 2) : n;
            if (n == 0) {  // these rows see none of the block's keys
              if ((written & block_bit) == 0) std::fill(obuf + s0 * Dv, obuf + (s0 + sq) * Dv, acc_t(0));
              continue;
            }
            gemm<ct, acc_t>(sq, n, Dpad, q_rows + s0 * ldq, ldq, kbuf + (vnni ? 2 * (lead + sf) : lead + sf), bk, sbuf,
                            bk, false, p.use_brgemm);
            for (int64_t r = 0; r < sq; ++r) {
              const int64_t qi = c0 + s0 + r;
              softmax_step<scalar_t>(p, b, h, qi, visible_keys(p, qi, span), kb + sf, n, npad, sbuf + r * bk,
                                     pbuf + r * ldp, row_shift + s0 + r, row_sum + s0 + r, obuf + (s0 + r) * Dv,
                                     buffers.bits, keys.hides ? states + lead / T : nullptr);
            }
            gemm<ct, acc_t>(sq, Dv, npad, pbuf, ldp, v_rows + (lead + sf) * ldv, ldv, obuf + s0 * Dv, Dv,
                            (written & block_bit) != 0, p.use_brgemm);
          }
          written |= block_bit;
        }
      }
      for (int64_t r0 = 0; r0 < rows; r0 += BQ) {  // blocks that met no key: output 0
        if ((written >> (r0 / BQ) & 1) == 0) std::fill(obuf + r0 * Dv, obuf + std::min(rows, r0 + BQ) * Dv, acc_t(0));
      }

      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = c0 + r;
        const RowEnd<acc_t> end = finish_row(p, h, row_shift[r], row_sum[r], keep_scale);
        scalar_t* o_row = O + b * p.out.s[0] + h * p.out.s[1] + qi * p.out.s[2];
        store_row(o_row, p.out.s[3], obuf + r * Dv, Dv, end.factor);
        LSE[b * p.lse.s[0] + h * p.lse.s[1] + qi * p.lse.s[2]] = static_cast<lse_t>(end.lse);
      }
    }
    if (vnni || (std::is_same_v<ct, float> && p.use_brgemm)) at::native::cpublas::brgemm_release(vnni);
  });
}

// ---------------------------------------------------------------------------------------------
// Decode: a few query rows (generation's new token, or a few of them) against many keys.
//
// The long-query forward packs each key/value block once per query head, for a product of one row
// when L_q is 1. Here a work item is one key/value head of one batch row together with all the query
// rows of its group (G heads × L_q rows, one product of G·L_q rows), so K and V are read once per
// group; V feeds the product where it lies when the layout allows. When batch × key/value heads leave
// threads idle, each head's keys are split between items, whose partial outputs merge through their
// log-sum-exps (flash-decoding).

// (kDecodeMaxQueries, flash_params.h: at most that many queries take this path.)
// Up to this many rows per item, float scores are dot products of each key row as it lies; more rows
// amortise a transpose of the K block for the block product.
constexpr int64_t kDotRows = 8;

// How many rows ahead, at least, the key readers (row_dots, prefetch_following_keys) ask for a key row: the hardware's prefetchers
// alone read a bf16 cache at 12.6 GB/s where 25 GB/s is there (Xeon with AMX, bench/NOTES.md 38), and cannot
// follow a paged cache's rows across its blocks.
constexpr int64_t kPrefetchRows = 8;

// Asks for `count` rows of `dim` elements from `first` on, at stride `ld` elements, to be brought into the cache.
template <typename T>
inline void prefetch_rows(const T* first, int64_t ld, int64_t count, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < count; ++i) {
    const char* row = reinterpret_cast<const char*>(first + i * ld);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
  }
}

// An 8-bit cache under up to kStoredRows rows per item, its rows contiguous along D: the scores and P V read the
// stored bytes themselves, each vector of them converted once per group of up to kDotRows rows, and no float copy
// of K or V is written (per key, the conversions and G·D/W multiply-adds of each product: the memory's time, where
// float rows written and read back doubled the arithmetic, and 16 rows' transposed K block cost more than a
// second conversion).
constexpr int64_t kStoredRows = 2 * kDotRows;


// f(std::integral_constant<int, rows>{}), 1 <= rows <= kDotRows: the row readers below take the row count as a
// template argument, so that the rows' accumulators live in registers.
template <typename F>
inline void with_rows(int64_t rows, const F& f) {
  static_assert(kDotRows == 8, "with_rows names each row count up to kDotRows");
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: TORCH_INTERNAL_ASSERT(false, "rows: expected 1 to ", kDotRows, ", got ", rows);
  }
}

// f(std::integral_constant<CacheType, p.cache>{}, std::integral_constant<int, rows>{}): with_rows, the cache's type
// a template argument too.
template <typename F>
inline void with_cache_and_rows(CacheType cache, int64_t rows, const F& f) {
  const auto with_type = [&](auto type) { with_rows(rows, [&](auto count) { f(type, count); }); };
  if (cache == CacheType::Float8E4M3) {
    with_type(std::integral_constant<CacheType, CacheType::Float8E4M3>{});
  } else if (cache == CacheType::Int8) {
    with_type(std::integral_constant<CacheType, CacheType::Int8>{});
  } else {
    with_type(std::integral_constant<CacheType, CacheType::Plain>{});
  }
}

// A row of find_stored_rows' list with its element type back (the list is typeless: one scratch buffer serves every
// cache type).
template <CacheType kType, typename PlainT>
inline const StoredElem<kType, PlainT>* stored_row(const void* row) {
  return static_cast<const StoredElem<kType, PlainT>*>(row);
}

// The stored rows of keys k0 .. k0 + n of head hk of batch row b in `view` (p.key or p.value, scaled by `scales`),
// wherever a paged cache's blocks put them (one look-up in the block table per cache block), and the factor of each
// (row_factor): the row readers below then walk a key block whole, across its cache blocks.
template <CacheType kType, typename PlainT>
void find_stored_rows(const Params& p, const View& view, const View& scales, int64_t b, int64_t hk, int64_t k0,
                      int64_t n, const void** rows, float* factors) {
  const auto* base = static_cast<const StoredElem<kType, PlainT>*>(view.data);
  for (int64_t j = 0, count; j < n; j += count) {
    count = keys_in_block(p, k0 + j, n - j);
    const StoredElem<kType, PlainT>* first = key_row(p, view, base, b, hk, k0 + j);
    const float* scale = kType == CacheType::Plain ? nullptr : scale_row(p, scales, b, hk, k0 + j);
    for (int64_t i = 0; i < count; ++i) {
      rows[j + i] = first + i * view.s[2];
      factors[j + i] = row_factor<kType>(scale, i * scales.s[2]);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
using FloatLanes = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using FloatLanes = __m256;
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Per 128-bit lane of a and b: [a0+a2, b0+b2, a1+a3, b1+b3].
C10_ALWAYS_INLINE FloatLanes sum_pairs(FloatLanes a, FloatLanes b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
#else
  return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
#endif
}

// Per 128-bit lane of a, b, c, d: [Σa, Σb, Σc, Σd] over that lane.
C10_ALWAYS_INLINE FloatLanes sum_quads(FloatLanes a, FloatLanes b, FloatLanes c, FloatLanes d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512d ab = _mm512_castps_pd(sum_pairs(a, b)), cd = _mm512_castps_pd(sum_pairs(c, d));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
#else
  const __m256d ab = _mm256_castps_pd(sum_pairs(a, b)), cd = _mm256_castps_pd(sum_pairs(c, d));
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab, cd)), _mm256_castpd_ps(_mm256_unpackhi_pd(ab, cd)));
#endif
}

// The even 128-bit lanes of x then y, plus the odd ones: each pair of adjacent 128-bit lanes added, in order.
C10_ALWAYS_INLINE FloatLanes sum_adjacent_lanes(FloatLanes x, FloatLanes y) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
#else
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
#endif
}
#endif

// Lane i of the result: the sum of the lanes of acc[i], for i < N <= W (the vector's lanes; from N on, 0). One tree
// of unpacks and 128-bit shuffles transposes and adds them all at once (45 instructions for 16 on AVX-512, 21 for 8
// on AVX2), where a horizontal sum of each costs about ten.
template <int N>
C10_ALWAYS_INLINE Vectorized<float> lane_sums(const Vectorized<float>* acc) {
  using V = Vectorized<float>;
  static_assert(N >= 1 && N <= V::size(), "lane_sums: one vector per lane");
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  FloatLanes v[V::size()];
  for (int i = 0; i < V::size(); ++i) v[i] = i < N ? FloatLanes(acc[i]) : FloatLanes(V(0.f));
  const auto quad = [&](int i) { return sum_quads(v[i], v[i + 1], v[i + 2], v[i + 3]); };
#if defined(CPU_CAPABILITY_AVX512)
  return sum_adjacent_lanes(sum_adjacent_lanes(quad(0), quad(4)), sum_adjacent_lanes(quad(8), quad(12)));
#else
  return sum_adjacent_lanes(quad(0), quad(4));
#endif
#else
  __at_align__ float sums[V::size()] = {};
  for (int i = 0; i < N; ++i) sums[i] = at::vec::vec_reduce_all<float>([](V& x, V& y) { return x + y; }, acc[i]);
  return V::loadu(sums);
#endif
}

// The lanes of v from `first` on, in lanes 0, 1, ... (the lanes past v's last: any values).
inline Vectorized<float> lanes_from(const Vectorized<float>& v, int first) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(_mm512_add_epi32(order, _mm512_set1_epi32(first)), v);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_permutevar8x32_ps(v, _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first)));
#else
  __at_align__ float lanes[2 * Vectorized<float>::size()] = {};
  v.store(lanes);
  return Vectorized<float>::loadu(lanes + first);
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// Lanes below `count` set: AVX2's masked loads and stores (ATen's partial ones copy through memcpy).
inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// The first `count` lanes of v stored to dst, and loaded from src (the rest 0). On AVX2, 1, 2, 4 or 8 lanes go by one
// plain store: the masked store to memory is a microcoded sequence on AMD's cores.
inline void store_first(const Vectorized<float>& v, float* dst, int64_t count) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m128 low = _mm256_castps256_ps128(v);
  switch (count) {
    case 8: return _mm256_storeu_ps(dst, v);
    case 4: return _mm_storeu_ps(dst, low);
    case 2: return _mm_storel_pi(reinterpret_cast<__m64*>(dst), low);
    case 1: return _mm_store_ss(dst, low);
    default: return _mm256_maskstore_ps(dst, first_lanes(count), v);
  }
#else
  v.store(dst, count);
#endif
}

inline Vectorized<float> load_first(const float* src, int64_t count) {
#if defined(CPU_CAPABILITY_AVX2)
  return _mm256_maskload_ps(src, first_lanes(count));
#else
  return Vectorized<float>::loadu(src, count);
#endif
}

// s[r · lds + j] = (q_r · k_j) · factor_j for r < R, j < n: q rows packed (R × D); key row j at key_at(j), its
// elements read as T (load_stored<kType> where they are not T); factor_j = factors[j], or 1 without factors. In
// float the keys go a group at a time, as many as leave one accumulator per (row, key) in a vector's lanes: W
// independent chains of multiply-adds, each query vector loaded once per group, and the group's dots summed by one
// lane_sums and stored a row's keys at a time. (In double, or for more rows than lanes, key by key, each dot summed
// on its own.) q_pairs: the same q rows as bf16 (R × D), given where they are exactly the queries' values; in the
// AVX512_BF16 copy an 8-bit key's values then go 32 at a time as bf16 into vdpbf16ps, for two rows or more, and a
// bf16 key's for any number.
template <CacheType kType, typename T, typename Elem, int R, typename KeyAt>
void row_dots(const T* q, int64_t D, const KeyAt& key_at, const float* factors, int64_t n, T* s, int64_t lds,
              const c10::BFloat16* q_pairs = nullptr) {
  using V = Vectorized<T>;
  constexpr int W = V::size();
  constexpr bool grouped = std::is_same_v<T, float> && R <= W;  // (NEON's 4 lanes take up to 4 rows grouped)
  constexpr int kKeys = grouped ? W / R : 1;
  const auto load = [](const Elem* x) {
    if constexpr (std::is_same_v<Elem, T>) {
      return V::loadu(x);
    } else {
      return load_stored<kType>(x);
    }
  };
  const auto value = [](Elem x) -> T {
    if constexpr (std::is_same_v<Elem, T>) {
      return x;
    } else {
      return stored_value<kType>(x);
    }
  };
  const int64_t full = D / W * W;
  // The rows this far ahead of a group's are asked for while it runs (each row once, as the groups advance).
  constexpr int64_t ahead = std::max<int64_t>(kKeys, kPrefetchRows);
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t keys = std::min<int64_t>(kKeys, n - j0);
    const Elem* key[kKeys];
    for (int i = 0; i < kKeys; ++i) key[i] = key_at(j0 + std::min<int64_t>(i, keys - 1));  // past n: a repeat, unused
    for (int64_t j = j0 + ahead; j < std::min(n, j0 + ahead + kKeys); ++j) prefetch_rows(key_at(j), 0, 1, D);
    V acc[R * kKeys];
    for (auto& a : acc) a = V(T(0));
    int64_t paired = 0;  // the values taken in pairs
#if defined(FUSED_ATTN_AVX512_BF16)
    // 32 products an instruction at an FMA's rate, where the FMAs were the scores' cost (bench/NOTES.md section 74).
    // A single row's cost is the conversions, to which the pairs add one. vdpbf16ps flushes subnormal operands and
    // results whatever the denormal mode: only a query value, product or partial sum below 2^-126 differs.
    // A bf16 key row needs no conversion at all, so pairs serve it for any number of rows.
    if constexpr (grouped && (kType == CacheType::Plain ? std::is_same_v<Elem, c10::BFloat16> : R >= 2)) {
      if (q_pairs != nullptr) {
        for (; paired + 2 * W <= D; paired += 2 * W) {
          __m512bh k[kKeys];
          for (int i = 0; i < kKeys; ++i) k[i] = load_stored_pairs<kType>(key[i] + paired);
          for (int r = 0; r < R; ++r) {
            const auto query = std::bit_cast<__m512bh>(_mm512_loadu_si512(q_pairs + r * D + paired));
            for (int i = 0; i < kKeys; ++i) acc[r * kKeys + i] = _mm512_dpbf16_ps(acc[r * kKeys + i], query, k[i]);
          }
        }
      }
    }
#endif
    for (int64_t d = paired; d < full; d += W) {
      V k[kKeys];
      for (int i = 0; i < kKeys; ++i) k[i] = load(key[i] + d);
      for (int r = 0; r < R; ++r) {
        const V query = V::loadu(q + r * D + d);
        for (int i = 0; i < kKeys; ++i) acc[r * kKeys + i] = at::vec::fmadd(query, k[i], acc[r * kKeys + i]);
      }
    }
    // The dot of row r and key i of the group, D's last elements (past `full`) included.
    const auto tail = [&](int r, int64_t i, T dot) {
      for (int64_t d = full; d < D; ++d) dot += q[r * D + d] * value(key[i][d]);
      return dot;
    };
    if constexpr (grouped) {
      V sums = lane_sums<R * kKeys>(acc);
      if (full < D) {
        __at_align__ float dots[W];
        sums.store(dots);
        for (int r = 0; r < R; ++r) {
          for (int64_t i = 0; i < keys; ++i) dots[r * kKeys + i] = tail(r, i, dots[r * kKeys + i]);
        }
        sums = V::loadu(dots);
      }
      const V factor = factors == nullptr ? V(1.f) : load_first(factors + j0, keys);
      for (int r = 0; r < R; ++r) store_first(lanes_from(sums, r * kKeys) * factor, s + r * lds + j0, keys);
    } else {
      const T factor = factors == nullptr ? T(1) : static_cast<T>(factors[j0]);
      for (int r = 0; r < R; ++r) {
        s[r * lds + j0] = tail(r, 0, at::vec::vec_reduce_all<T>([](V& x, V& y) { return x + y; }, acc[r])) * factor;
      }
    }
  }
}

// The keys of a run of add_stored_values: as many as make kValueRunBytes of value rows, at least 8 and at most
// kValueRun. The run's rows stay in L1 while every vector of D passes over them, and the next run's are asked for
// into it on the way: runs of 64 float rows of 128 values (32 KiB, the whole L1 on Zen 3) made a paged fp32 step
// 1.27x the time of runs of 12 (bench/NOTES.md section 86); 8-bit rows keep 48 to 64.
constexpr int64_t kValueRun = 64;
constexpr int64_t kValueRunBytes = 6144;

// o[r · ldo + d] (= or +=) Σ_j p[r · ldp + j] · factor_j · v_j[d] for r < R, d < Dv, j < n: the stored value rows at
// values[j]. Per run of keys, the weights p · factor first, then C vectors of D at a time against every key of the
// run (C · R accumulators, at least 4 chains of multiply-adds). bf16_weights: the weights may be rounded to bf16
// (bf16 queries), and in the AVX512_BF16 copy two keys then go into one vdpbf16ps per row, where two FMAs were the
// cost (bench/NOTES.md section 82).
template <CacheType kType, typename PlainT, int R>
void add_stored_values(const float* p, int64_t ldp, const void* const* values, const float* factors,
                       int64_t n, int64_t Dv, float* o, int64_t ldo, bool add, bool bf16_weights) {
  using V = Vectorized<float>;
  constexpr int64_t W = V::size();
  constexpr int C = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  if (!add) {
    for (int r = 0; r < R; ++r) std::fill(o + r * ldo, o + r * ldo + Dv, 0.f);
  }
  float weights[R * kValueRun];
#if defined(FUSED_ATTN_AVX512_BF16)
  // Row r's weights of keys 2i and 2i + 1 as one pair of bf16, the first low.
  __at_align__ c10::BFloat16 paired_weights[R * kValueRun];
  const bool pairs = bf16_weights && R >= 2;
#else
  static_cast<void>(bf16_weights);
#endif
  // `chunks` vectors from d on, over the keys begin .. m of `run`, `step` keys a product: 1, multiply-adds in float,
  // or 2 (m - begin even, AVX512_BF16 copy only), one vdpbf16ps a row over the two keys' interleaved values and
  // paired_weights. The rows of the next run's first `ahead` keys are asked for one per key on the way (all at once,
  // they stall the pass on the cache's fill buffers).
  const auto pass = [&](auto chunks, auto step, int64_t d, const void* const* run, int64_t begin, int64_t m,
                        const void* const* next, int64_t ahead) {
    constexpr int kChunks = decltype(chunks)::value, kStep = decltype(step)::value;
    V acc[kChunks][R];
    for (int c = 0; c < kChunks; ++c) {
      for (int r = 0; r < R; ++r) acc[c][r] = V::loadu(o + r * ldo + d + c * W);
    }
    for (int64_t j = begin; j < m; j += kStep) {
      for (int64_t i = j; i < std::min<int64_t>(j + kStep, ahead); ++i) {
        prefetch_rows(stored_row<kType, PlainT>(next[i]), 0, 1, Dv);
      }
      if constexpr (kStep == 1) {
        for (int c = 0; c < kChunks; ++c) {
          const V stored = load_stored<kType>(stored_row<kType, PlainT>(run[j]) + d + c * W);
          for (int r = 0; r < R; ++r) acc[c][r] = at::vec::fmadd(V(weights[r * kValueRun + j]), stored, acc[c][r]);
        }
      } else {
#if defined(FUSED_ATTN_AVX512_BF16)
        const auto* first = stored_row<kType, PlainT>(run[j]) + d;
        const auto* second = stored_row<kType, PlainT>(run[j + 1]) + d;
        for (int c = 0; c < kChunks; ++c) {
          const __m512bh stored = interleaved_pairs<kType>(first + c * W, second + c * W);
          for (int r = 0; r < R; ++r) {
            uint32_t weight_pair;
            std::memcpy(&weight_pair, paired_weights + r * kValueRun + j, sizeof weight_pair);
            const auto weight = std::bit_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(weight_pair)));
            acc[c][r] = _mm512_dpbf16_ps(acc[c][r], stored, weight);
          }
        }
#endif
      }
    }
    for (int64_t i = m; i < ahead; ++i) prefetch_rows(stored_row<kType, PlainT>(next[i]), 0, 1, Dv);
    for (int c = 0; c < kChunks; ++c) {
      for (int r = 0; r < R; ++r) acc[c][r].store(o + r * ldo + d + c * W);
    }
  };
  constexpr std::integral_constant<int, 1> one_key{};
  const int64_t full = Dv / W * W;
  const int64_t row_bytes = std::max<int64_t>(Dv, 1) * int64_t{sizeof(StoredElem<kType, PlainT>)};
  const int64_t run_keys = std::clamp<int64_t>(kValueRunBytes / row_bytes, 8, kValueRun);
  for (int64_t j0 = 0; j0 < n; j0 += run_keys) {
    const int64_t m = std::min(run_keys, n - j0);
    const void* const* run = values + j0;
    int64_t ahead = std::min(m, n - (j0 + m));  // the next run's rows, asked for during the first pass
    for (int64_t j = 0; j < m; ++j) {
      for (int r = 0; r < R; ++r) weights[r * kValueRun + j] = p[r * ldp + j0 + j] * factors[j0 + j];
    }
    int64_t d = 0;
#if defined(FUSED_ATTN_AVX512_BF16)
    if (pairs) {
      for (int r = 0; r < R; ++r) {
        for (int64_t j = 0; j < m; ++j) paired_weights[r * kValueRun + j] = weights[r * kValueRun + j];
      }
      const int64_t even = m / 2 * 2;  // an odd last key goes in float below
      for (; d + C * W <= full; d += C * W, ahead = 0) {
        pass(std::integral_constant<int, C>{}, std::integral_constant<int, 2>{}, d, run, 0, even, run + m, ahead);
        if (even < m) pass(std::integral_constant<int, C>{}, one_key, d, run, even, m, run + m, 0);
      }
    }
#endif
    for (; d + C * W <= full; d += C * W, ahead = 0) {
      pass(std::integral_constant<int, C>{}, one_key, d, run, 0, m, run + m, ahead);
    }
    for (; d < full; d += W, ahead = 0) pass(std::integral_constant<int, 1>{}, one_key, d, run, 0, m, run + m, ahead);
    for (; d < Dv; ++d) {
      for (int64_t j = 0; j < m; ++j) {
        const float stored = stored_value<kType>(stored_row<kType, PlainT>(run[j])[d]);
        for (int r = 0; r < R; ++r) o[r * ldo + d] += weights[r * kValueRun + j] * stored;
      }
    }
  }
}

// The first rows of the `following` keys from j on (head hk of batch row b in `view`, of elements T), as far as
// kPrefetchRows and j's cache block reach.
template <typename T>
inline void prefetch_following_keys(const Params& p, const View& view, int64_t b, int64_t hk, int64_t j,
                                    int64_t following, int64_t dim) {
  if (following <= 0) return;
  const T* first = key_row(p, view, static_cast<const T*>(view.data), b, hk, j);
  prefetch_rows(first, view.s[2], keys_in_block(p, j, std::min(kPrefetchRows, following)), dim);
}

// The scores s (rows × n, row stride lds) of query rows q (packed, rows × D) against the keys k0 .. k0 + n of
// head hk of batch row b, read in place (an 8-bit cache, bf16, or a paged float cache: decode_impl's `stored`)
// across the cache's blocks: row_dots, kDotRows rows at a time, over the rows find_stored_rows lists in
// `found` and `factors` (room for n each). The operands are float wherever this is reached. `following`: how many
// keys after these the item reads next, whose first rows are asked for ahead (they may lie in another cache block).
// q_pairs: q as bf16 where those are the queries' values (row_dots), or nullptr.
template <typename PlainT, typename Q, typename S>
void stored_scores(const Params& p, const Q* q, int64_t rows, int64_t b, int64_t hk, int64_t k0, int64_t n, S* s,
                   int64_t lds, int64_t following, const void** found, float* factors,
                   const c10::BFloat16* q_pairs) {
  if constexpr (std::is_same_v<Q, float> && std::is_same_v<S, float>) {
    for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
      with_cache_and_rows(p.cache, std::min(kDotRows, rows - r0), [&](auto type, auto count) {
        constexpr CacheType kType = decltype(type)::value;
        if (r0 == 0) {
          find_stored_rows<kType, PlainT>(p, p.key, p.k_scale, b, hk, k0, n, found, factors);
          prefetch_following_keys<StoredElem<kType, PlainT>>(p, p.key, b, hk, k0 + n, following, p.dim_qk);
        }
        const auto key_at = [found](int64_t j) { return stored_row<kType, PlainT>(found[j]); };
        row_dots<kType, float, StoredElem<kType, PlainT>, decltype(count)::value>(
            q + r0 * p.dim_qk, p.dim_qk, key_at, factors, n, s + r0 * lds, lds,
            q_pairs == nullptr ? nullptr : q_pairs + r0 * p.dim_qk);
      });
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "stored rows are read with float operands only");
  }
}

// o (rows × D_v, row stride ldo) = or += prob (rows × n, row stride ldp) times the values k0 .. k0 + n of head hk of
// batch row b, read in place across the cache's blocks: add_stored_values, kDotRows rows at a time (found, factors:
// as stored_scores'; bf16_weights: as add_stored_values').
template <typename PlainT, typename P, typename O>
void stored_values_product(const Params& p, const P* prob, int64_t ldp, int64_t rows, int64_t b, int64_t hk,
                           int64_t k0, int64_t n, O* o, int64_t ldo, bool add, int64_t following, const void** found,
                           float* factors, bool bf16_weights) {
  if constexpr (std::is_same_v<P, float> && std::is_same_v<O, float>) {
    for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
      with_cache_and_rows(p.cache, std::min(kDotRows, rows - r0), [&](auto type, auto count) {
        constexpr CacheType kType = decltype(type)::value;
        if (r0 == 0) {
          find_stored_rows<kType, PlainT>(p, p.value, p.v_scale, b, hk, k0, n, found, factors);
          prefetch_following_keys<StoredElem<kType, PlainT>>(p, p.value, b, hk, k0 + n, following, p.dim_v);
        }
        add_stored_values<kType, PlainT, decltype(count)::value>(prob + r0 * ldp, ldp, found, factors, n, p.dim_v,
                                                                 o + r0 * ldo, ldo, add, bf16_weights);
      });
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "stored rows are read with float operands only");
  }
}

// Keys of a split where the heads' rows of a token lie side by side (heads_within_tokens). (Spans of 2 MiB of K and
// V, 128 keys at H_kv = 32, gained less: bench/NOTES.md section 84.)
constexpr int64_t kTokenMajorSplitKeys = 512;
// Fewer keys than this keep the splits they had: at 1000 keys (B = 1, H_kv = 8, bf16) two splits took about 1.2× the
// time of one, measured across processes (bench/NOTES.md section 84).
constexpr int64_t kTokenMajorMinKeys = 2048;

// Whether K's and V's heads lie within each token's row of the cache ((B, L, H_kv, D), and paged blocks), not
// each head's keys one after another ((B, H_kv, L, D)).
inline bool heads_within_tokens(const Params& p) {
  return p.heads_kv > 1 && p.key.s[1] < p.key.s[2] && p.value.s[1] < p.value.s[2];
}

// The keys some query of batch row b sees: from the first query's first to the last query's end (a split's share
// is of those, not of the cache's capacity, which may be far longer than its sequences).
inline KeyRange seen_keys(const Params& p, int64_t b) {
  const KeyRange span = key_span(p, b);
  return {visible_keys(p, 0, span).first, visible_keys(p, p.len_q - 1, span).end};
}

// The most keys the queries of one batch row see between them.
inline int64_t most_seen_keys(const Params& p) {
  int64_t most = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const KeyRange seen = seen_keys(p, b);
    most = std::max(most, seen.end - seen.first);
  }
  return most;
}

// Key splits per (batch, key/value head): doubled while there are fewer than two items per thread
// and each split keeps at least 512 keys. Where the heads lie within the tokens and a batch row sees at least
// kTokenMajorMinKeys keys, at least one split per kTokenMajorSplitKeys of them too: the items then go head by head
// within a split (decode_impl), so the threads read every head's rows of one span of tokens before the next, not one
// head's rows 2 KiB apart (H_kv = 8, D = 128, bf16) across the whole cache, which took 1.07–1.18× the time
// (bench/NOTES.md section 84).
inline int64_t decode_splits(const Params& p, int64_t threads) {
  int64_t splits = 1;
  while (p.batch * p.heads_kv * splits < 2 * threads && p.len_k / (2 * splits) >= 512) splits *= 2;
  const int64_t seen = heads_within_tokens(p) ? most_seen_keys(p) : 0;
  if (seen >= kTokenMajorMinKeys) {
    splits = std::max(splits, (seen + kTokenMajorSplitKeys - 1) / kTokenMajorSplitKeys);
  }
  return splits;
}

template <typename scalar_t, typename ct>
void decode_impl(const Params& p) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr bool vnni = kVnni<ct>;
  constexpr bool separate_p = !std::is_same_v<ct, acc_t>;
  const int64_t BK = p.block_k, Lq = p.len_q, D = p.dim_qk, Dv = p.dim_v;
  const int64_t groups = p.heads_q / p.heads_kv;
  const int64_t rows = groups * Lq;  // row r: head hk · groups + r / L_q, query r % L_q
  const int64_t Dpad = vnni ? round_up(D, 2) : D;
  const int64_t BKpad = vnni ? round_up(BK, 2) : BK;
  const int64_t splits = decode_splits(p, at::get_num_threads());
  const int64_t items = p.batch * p.heads_kv * splits;
  const bool token_major = heads_within_tokens(p);  // items head by head within a split
  // K rows feed the scores, and V rows the B operand of P V, as they lie when they are float and
  // contiguous along D (a paged float cache's, under few rows, through the stored readers below); bf16/fp16 rows
  // computed in float are converted row by row (no transpose), and an 8-bit cache's rows dequantized so.
  const bool quantized = p.cache != CacheType::Plain;
  const bool k_in_place = !vnni && !quantized && std::is_same_v<scalar_t, ct> && p.key.s[3] == 1;
  const bool v_in_place = !vnni && !quantized && std::is_same_v<scalar_t, ct> && p.value.s[3] == 1;
  // An 8-bit cache's bytes feed both products themselves where they are few rows' and contiguous along D, and so do
  // bf16 rows under at most kDotRows float rows (no float copy of them written and read back). So are a paged float
  // cache's key rows (in place too, but walked a key block at a time, not one product per cache block), while its
  // values feed the block product where they lie, cache block by cache block: oneDNN's product took 0.87-0.94 of
  // add_stored_values' time there (bench/NOTES.md section 86).
  constexpr bool bf16_in_float = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<ct, float>;
  constexpr bool float_rows = std::is_same_v<scalar_t, float> && std::is_same_v<ct, float>;
  const bool few_rows = rows <= (quantized ? kStoredRows : kDotRows);
  const bool k_stored =
      few_rows && (quantized || bf16_in_float || (float_rows && p.pages != nullptr)) && p.key.s[3] == 1;
  const bool v_stored = few_rows && (quantized || bf16_in_float) && p.value.s[3] == 1;
  const bool stored = k_stored || v_stored;  // rows found in place (found_rows, row_factors)
  using PlainRows = std::conditional_t<float_rows, float, c10::BFloat16>;  // what a plain cache is read as
  const bool k_as_float_rows = !vnni && !k_in_place && !k_stored;
  // bf16 queries' rows as bf16 too, for the scores against an 8-bit cache's keys under two rows or more, or a bf16
  // cache's under any number (row_dots' pairs); and their weights of the stored values as bf16 (add_stored_values).
  constexpr bool bf16_pairs = kPairDots && std::is_same_v<scalar_t, c10::BFloat16>;
  const bool q_as_pairs = bf16_pairs && k_stored && (rows >= 2 || !quantized);
  // A paged cache's key blocks span its blocks (the stored readers list a block's rows across them; the other row
  // operations run cache block by cache block) except where a product packs K or V whole: VNNI pairs, or Kᵀ of
  // in-place rows for more than kDotRows rows.
  const bool spans_pages = !vnni && !(k_in_place && rows > kDotRows);
  const acc_t keep_scale = static_cast<acc_t>(p.dropout.keep_scale);
  using Buffers = SoftmaxBuffers<acc_t, ct>;
  const size_t scratch_bytes = Scratch::bytes<ct>(rows * Dpad) + Scratch::bytes<ct>(Dpad * BK) +
                               (q_as_pairs ? Scratch::bytes<c10::BFloat16>(rows * D) : 0) +
                               (k_as_float_rows ? Scratch::bytes<ct>(BK * D) : 0) +
                               (v_in_place || v_stored ? 0 : Scratch::bytes<ct>(BKpad * Dv)) +
                               (stored ? Scratch::bytes<const void*>(BK) + Scratch::bytes<float>(BK) : 0) +
                               Buffers::bytes(p, rows, rows, BK, BKpad);
  // With splits, each item's normalised output and log-sum-exp per row, merged afterwards.
  std::vector<acc_t> partial_out(splits > 1 ? items * rows * Dv : 0), partial_lse(splits > 1 ? items * rows : 0);
  const auto* Q = static_cast<const scalar_t*>(p.query.data);
  const auto* K = static_cast<const scalar_t*>(p.key.data);
  const auto* Vt = static_cast<const scalar_t*>(p.value.data);
  auto* O = static_cast<scalar_t*>(p.out.data);
  auto* LSE = static_cast<acc_t*>(p.lse.data);
  const auto store_row_result = [&](int64_t b, int64_t h, int64_t qi, acc_t* o, acc_t factor, acc_t lse) {
    store_row(O + b * p.out.s[0] + h * p.out.s[1] + qi * p.out.s[2], p.out.s[3], o, Dv, factor);
    LSE[b * p.lse.s[0] + h * p.lse.s[1] + qi * p.lse.s[2]] = lse;
  };

  parallel_items(items, [&](const auto& next_item) {
    Scratch scratch(scratch_bytes, p.poison_scratch);
    ct* qbuf = scratch.take<ct>(rows * Dpad);
    ct* kbuf = scratch.take<ct>(Dpad * BK);
    c10::BFloat16* q_pairs = q_as_pairs ? scratch.take<c10::BFloat16>(rows * D) : nullptr;
    ct* krows = k_as_float_rows ? scratch.take<ct>(BK * D) : nullptr;
    ct* vbuf = v_in_place || v_stored ? nullptr : scratch.take<ct>(BKpad * Dv);
    // A key block's rows read in place (K's, then V's) and their scales' factors: find_stored_rows.
    const void** found_rows = stored ? scratch.take<const void*>(BK) : nullptr;
    float* row_factors = stored ? scratch.take<float>(BK) : nullptr;
    Buffers buffers(scratch, p, rows, rows, BK, BKpad);
    acc_t *sbuf = buffers.scores, *obuf = buffers.out, *row_shift = buffers.row_shift, *row_sum = buffers.row_sum;
    ct* pbuf = buffers.probs;

    for (int64_t item; (item = next_item()) >= 0;) {
      // slot: the item's place among its (batch row, head)'s splits, which the merge reads in order.
      const int64_t b = item / (splits * p.heads_kv);
      const int64_t split = token_major ? (item / p.heads_kv) % splits : item % splits;
      const int64_t hk = token_major ? item % p.heads_kv : (item / splits) % p.heads_kv;
      const int64_t slot = (b * p.heads_kv + hk) * splits + split;
      for (int64_t g = 0; g < groups; ++g) {
        const scalar_t* q_head = Q + b * p.query.s[0] + (hk * groups + g) * p.query.s[1];
        pack_a(qbuf + g * Lq * Dpad, Dpad, q_head, p.query.s[2], p.query.s[3], Lq, D);
        if constexpr (bf16_pairs) {
          if (q_as_pairs) pack_a(q_pairs + g * Lq * D, D, q_head, p.query.s[2], p.query.s[3], Lq, D);
        }
      }
      buffers.start(rows);
      // The keys some row sees, then this split's share of them.
      const KeyRange span = key_span(p, b), batch_seen = seen_keys(p, b);
      const int64_t share = (std::max<int64_t>(batch_seen.end - batch_seen.first, 0) + splits - 1) / splits;
      const int64_t k_begin = std::min(batch_seen.end, batch_seen.first + split * share);
      const int64_t k_end = std::min(batch_seen.end, k_begin + share);
      for (int64_t k0 = k_begin, bk; k0 < k_end; k0 += bk) {
        bk = spans_pages ? std::min(BK, k_end - k0) : keys_in_block(p, k0, std::min(BK, k_end - k0));
        const int64_t bkpad = vnni ? round_up(bk, 2) : bk;
        const int64_t ldp = separate_p ? bkpad : bk;
        // The runs of the block's keys that lie in one cache block each: f(first, count), first from k0.
        const auto for_each_run = [&](const auto& f) {
          for (int64_t j0 = 0, n; j0 < bk; j0 += n) {
            n = keys_in_block(p, k0 + j0, bk - j0);
            f(j0, n);
          }
        };
        if constexpr (vnni) {
          pack_b(kbuf, key_row(p, p.key, K, b, hk, k0), p.key.s[3], p.key.s[2], D, Dpad, bk);
          gemm<ct, acc_t>(rows, bk, Dpad, qbuf, Dpad, kbuf, bk, sbuf, bk, false, p.use_brgemm);
        } else if (k_stored) {
          stored_scores<PlainRows>(p, qbuf, rows, b, hk, k0, bk, sbuf, bk, k_end - (k0 + bk), found_rows,
                                   row_factors, q_pairs);
        } else {
          const ct* k_float = krows;
          int64_t ldk = D;
          if (quantized) {
            dequantize_keys(p, p.key, p.k_scale, b, hk, k0, bk, D, krows, D);
          } else if (k_as_float_rows) {
            gather_rows(p, p.key, K, b, hk, k0, bk, D, krows, D);
          } else {
            k_float = reinterpret_cast<const ct*>(key_row(p, p.key, K, b, hk, k0));
            ldk = p.key.s[2];
          }
          // The scores of n K rows from `first` on, at stride ldk, into the block's columns from j0 on.
          const auto dots_with = [&](const ct* first, int64_t j0, int64_t n) {
            with_rows(rows, [&](auto count) {
              const auto key_at = [first, ldk](int64_t j) { return first + j * ldk; };
              row_dots<CacheType::Plain, ct, ct, decltype(count)::value>(qbuf, D, key_at, nullptr, n, sbuf + j0, bk);
            });
          };
          if (rows <= kDotRows && k_float != krows) {  // K rows in place, run by run
            for_each_run([&](int64_t j0, int64_t n) {
              dots_with(reinterpret_cast<const ct*>(key_row(p, p.key, K, b, hk, k0 + j0)), j0, n);
            });
          } else if (rows <= kDotRows) {
            dots_with(k_float, 0, bk);
          } else {
            pack_b(kbuf, k_float, 1, ldk, D, D, bk);  // Kᵀ by blocked transposes
            gemm<ct, acc_t>(rows, bk, D, qbuf, D, kbuf, bk, sbuf, bk, false, p.use_brgemm);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t h = hk * groups + r / Lq, qi = r % Lq;
          const KeyRange seen = visible_keys(p, qi, span);
          softmax_step<scalar_t>(p, b, h, qi, {std::max(seen.first, k_begin), std::min(seen.end, k_end)}, k0, bk,
                                 bkpad, sbuf + r * bk, pbuf + r * ldp, row_shift + r, row_sum + r, obuf + r * Dv,
                                 buffers.bits);
        }
        const bool accumulate = k0 != k_begin;  // the first product writes the accumulator
        if (v_stored) {
          stored_values_product<PlainRows>(p, pbuf, ldp, rows, b, hk, k0, bk, obuf, Dv, accumulate,
                                           k_end - (k0 + bk), found_rows, row_factors, bf16_pairs);
        } else if (v_in_place) {
          for_each_run([&](int64_t j0, int64_t n) {
            gemm<ct, acc_t>(rows, Dv, n, pbuf + j0, ldp,
                            reinterpret_cast<const ct*>(key_row(p, p.value, Vt, b, hk, k0 + j0)), p.value.s[2], obuf, Dv,
                            accumulate || j0 > 0, p.use_brgemm);
          });
        } else {
          if (quantized) {
            dequantize_keys(p, p.value, p.v_scale, b, hk, k0, bk, Dv, vbuf, Dv);
          } else if (vnni) {
            pack_b(vbuf, key_row(p, p.value, Vt, b, hk, k0), p.value.s[2], p.value.s[3], bk, bkpad, Dv);
          } else {
            for_each_run([&](int64_t j0, int64_t n) {
              pack_b(vbuf + j0 * Dv, key_row(p, p.value, Vt, b, hk, k0 + j0), p.value.s[2], p.value.s[3], n, n, Dv);
            });
          }
          gemm<ct, acc_t>(rows, Dv, bkpad, pbuf, ldp, vbuf, Dv, obuf, Dv, accumulate, p.use_brgemm);
        }
      }
      if (k_begin >= k_end) std::fill(obuf, obuf + rows * Dv, acc_t(0));  // no key here: output 0
      for (int64_t r = 0; r < rows; ++r) {
        const bool seen = row_sum[r] > acc_t(0);
        if (splits == 1) {
          const int64_t h = hk * groups + r / Lq;
          const RowEnd<acc_t> end = finish_row(p, h, row_shift[r], row_sum[r], keep_scale);
          store_row_result(b, h, r % Lq, obuf + r * Dv, end.factor, end.lse);
        } else {
          // The splits are merged below, where the sink joins once.
          const acc_t lse = seen || std::isnan(row_shift[r]) ? row_shift[r] + std::log(row_sum[r]) : neg_inf<acc_t>();
          acc_t* out = partial_out.data() + (slot * rows + r) * Dv;
          for (int64_t d = 0; d < Dv; ++d) out[d] = seen ? obuf[r * Dv + d] / row_sum[r] : acc_t(0);
          partial_lse[slot * rows + r] = lse;
        }
      }
    }
    if (vnni || (std::is_same_v<ct, float> && p.use_brgemm)) at::native::cpublas::brgemm_release(vnni);
  });
  if (splits == 1) return;
  // Merge the splits of each row: lse = log Σ exp(lse_s), out = Σ exp(lse_s - lse) out_s.
  at::parallel_for(0, p.batch * p.heads_kv * rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> merged(Dv);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t r = row % rows, head = row / rows;  // head = b · H_kv + hk
      const int64_t b = head / p.heads_kv, hk = head % p.heads_kv;
      acc_t top = neg_inf<acc_t>();
      for (int64_t s = 0; s < splits; ++s) {  // NaN (a NaN score in a split) carried, as finish_row takes it
        const acc_t lse = partial_lse[(head * splits + s) * rows + r];
        if (std::isnan(lse) || lse > top) top = lse;
        if (std::isnan(top)) break;
      }
      std::fill(merged.begin(), merged.end(), acc_t(0));
      acc_t total = 0;
      if (top != neg_inf<acc_t>()) {
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t part = (head * splits + s) * rows + r;
          const acc_t weight = std::exp(partial_lse[part] - top);  // 0 for a split that saw nothing
          total += weight;
          for (int64_t d = 0; d < Dv; ++d) merged[d] += weight * partial_out[part * Dv + d];
        }
      }
      const int64_t h = hk * groups + r / Lq;
      const RowEnd<acc_t> end = finish_row(p, h, top, total, keep_scale);
      store_row_result(b, h, r % Lq, merged.data(), end.factor, end.lse);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Backward.

// dS = P (dP - delta) in place of dP, for the first n entries of a row.
template <typename acc_t>
inline void grad_scores(const acc_t* prob, acc_t* dp, int64_t n, acc_t delta) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const V vdelta(delta);
  int64_t j = 0;
  for (; j + W <= n; j += W) (V::loadu(prob + j) * (V::loadu(dp + j) - vdelta)).store(dp + j);
  if (j < n) (V::loadu(prob + j, n - j) * (V::loadu(dp + j, n - j) - vdelta)).store(dp + j, n - j);
}

// The B operand of a product over `rows` (its K dimension) in VNNI pairs, from float rows src (rows × n, leading
// dimension ld_src): dst[((r / 2) · n + c) · 2 + r % 2] = src[r][c], a zero row after an odd last one. Each pair
// of rows is interleaved in registers and converted in the same pass.
template <typename ct>
void pack_row_pairs(ct* dst, const float* src, int64_t ld_src, int64_t rows, int64_t n) {
  using V = Vectorized<float>;
  constexpr int64_t W = V::size();
  for (int64_t r = 0; r < rows; r += 2) {
    const float* upper = src + r * ld_src;
    const float* lower = r + 1 < rows ? upper + ld_src : nullptr;
    ct* out = dst + r * n;
    int64_t c = 0;
    for (; c + W <= n; c += W) {
      const auto [first, second] = at::vec::interleave2(V::loadu(upper + c), lower ? V::loadu(lower + c) : V(0.f));
      store_pair(out + 2 * c, first, second);
    }
    if (c < n) {
      const int64_t count = n - c;
      const auto [first, second] =
          at::vec::interleave2(V::loadu(upper + c, count), lower ? V::loadu(lower + c, count) : V(0.f));
      store_weights(first, second, out + 2 * c, 2 * count);
    }
  }
}

// srcᵀ (cols × rows, leading dimension ld_dst, columns rows..ld_dst zero) of src (rows × cols, strides sm, sk) in the
// type ct: the backward's A operands Qᵀ and dOᵀ, and its dK and dV from the accumulated dKᵀ and dVᵀ. For 16-bit
// operands, 32 × 32 register transposes where the rows are contiguous.
template <typename ct, typename st>
void pack_transposed(ct* dst, int64_t ld_dst, const st* src, int64_t sm, int64_t sk, int64_t rows, int64_t cols) {
  if constexpr (kVnni<ct>) {
    static_assert(std::is_same_v<ct, st>, "16-bit operands keep the input type");
    if (sk == 1) {
      constexpr int64_t T = 32;
      for (int64_t r = 0; r < rows; r += T) {
        for (int64_t c = 0; c < cols; c += T) {
          at::vec::transpose_mxn<ct>(src + r * sm + c, sm, dst + c * ld_dst + r, ld_dst,
                                     static_cast<int>(std::min(T, rows - r)), static_cast<int>(std::min(T, cols - c)));
        }
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * sm + c * sk];
      }
    }
    if (ld_dst > rows) {
      for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld_dst + rows, dst + (c + 1) * ld_dst, ct(0));
    }
  } else {
    TORCH_INTERNAL_ASSERT(ld_dst == rows, "float operands need no padding column");
    pack_b(dst, src, sk, sm, cols, cols, rows);  // B[c][r] = src[r][c]: Kᵀ's packing
  }
}

// x · y over n values of unit stride, in the accumulation type: one partial sum per vector lane, added in a
// fixed order, so a row's sum does not depend on the thread that takes it.
template <typename acc_t, typename scalar_t>
acc_t dot_row(const scalar_t* x, const scalar_t* y, int64_t n) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const auto load = [](const scalar_t* values) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      return V::loadu(values);
    } else {
      V widened;
      at::vec::load_to_float(values, widened);
      return widened;
    }
  };
  V lanes(acc_t(0));
  int64_t i = 0;
  for (; i + W <= n; i += W) lanes = at::vec::fmadd(load(x + i), load(y + i), lanes);
  acc_t sum = at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return a + b; }, lanes);
  for (; i < n; ++i) sum += static_cast<acc_t>(x[i]) * static_cast<acc_t>(y[i]);
  return sum;
}

// delta = rowsum(dO * O) - grad_lse, one value per query row, in the accumulation type.
template <typename scalar_t>
void compute_delta(const Params& p) {
  using acc_t = typename AccType<scalar_t>::type;
  const auto* O = static_cast<const scalar_t*>(p.out.data);
  const auto* dO = static_cast<const scalar_t*>(p.grad_out.data);
  const auto* grad_lse = static_cast<const acc_t*>(p.grad_lse.data);
  auto* delta = static_cast<acc_t*>(p.delta.data);
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % p.len_q, h = (row / p.len_q) % p.heads_q, b = row / (p.len_q * p.heads_q);
      const scalar_t* o = O + b * p.out.s[0] + h * p.out.s[1] + i * p.out.s[2];
      const scalar_t* g = dO + b * p.grad_out.s[0] + h * p.grad_out.s[1] + i * p.grad_out.s[2];
      // A pass over O and dO of every row: with a short backward (a program's), a dependent chain of scalar
      // additions per row was a few percent of it.
      acc_t sum = 0;
      if (p.out.s[3] == 1 && p.grad_out.s[3] == 1) {
        sum = dot_row<acc_t>(o, g, p.dim_v);
      } else {
        for (int64_t d = 0; d < p.dim_v; ++d) {
          sum += static_cast<acc_t>(o[d * p.out.s[3]]) * static_cast<acc_t>(g[d * p.grad_out.s[3]]);
        }
      }
      if (grad_lse != nullptr) {
        sum -= grad_lse[b * p.grad_lse.s[0] + h * p.grad_lse.s[1] + i * p.grad_lse.s[2]];
      }
      delta[b * p.delta.s[0] + h * p.delta.s[1] + i * p.delta.s[2]] = sum;
    }
  });
}

template <typename scalar_t, typename ct>
void backward_impl(const Params& p) {
  using acc_t = typename AccType<scalar_t>::type;
  constexpr bool vnni = kVnni<ct>;
  compute_delta<scalar_t>(p);
  const int64_t BQ = p.block_q, BK = p.block_k;
  const int64_t Lq = p.len_q, Lk = p.len_k, D = p.dim_qk, Dv = p.dim_v;
  const int64_t groups = p.heads_q / p.heads_kv;
  const int64_t Dpad = vnni ? round_up(D, 2) : D;
  const int64_t Dvpad = vnni ? round_up(Dv, 2) : Dv;
  const int64_t BQpad = vnni ? round_up(BQ, 2) : BQ;
  const int64_t BKpad = vnni ? round_up(BK, 2) : BK;
  const acc_t scale = static_cast<acc_t>(p.scale);
  const size_t scratch_bytes =
      Scratch::bytes<ct>(Dpad * BK) + Scratch::bytes<ct>(Dvpad * BK) + Scratch::bytes<ct>(BKpad * D) +
      Scratch::bytes<ct>(BQ * Dpad) + Scratch::bytes<ct>(BQ * Dvpad) + Scratch::bytes<ct>(BQpad * D) +
      Scratch::bytes<ct>(BQpad * Dv) + 2 * Scratch::bytes<acc_t>(BQ * BK) +
      (vnni ? 2 * Scratch::bytes<ct>(BQpad * BK) : 0) + Scratch::bytes<ct>(BQ * BKpad) +
      Scratch::bytes<acc_t>(BK * D) + Scratch::bytes<acc_t>(BK * Dv) +
      Scratch::bytes<acc_t>(groups * Lq * D) + Scratch::bytes<acc_t>(D * BK) + Scratch::bytes<acc_t>(Dv * BK) +
      (p.dropout.enabled ? Scratch::bytes<uint32_t>(BK) : 0) + (p.softcap > 0.0 ? Scratch::bytes<acc_t>(BK) : 0);
  const acc_t keep_scale = static_cast<acc_t>(p.dropout.keep_scale);  // 1 without dropout
  const bool plain_scores = scores_are_plain(p);
  const auto* Q = static_cast<const scalar_t*>(p.query.data);
  const auto* K = static_cast<const scalar_t*>(p.key.data);
  const auto* Vt = static_cast<const scalar_t*>(p.value.data);
  const auto* dO = static_cast<const scalar_t*>(p.grad_out.data);
  const auto* LSE = static_cast<const acc_t*>(p.lse.data);
  const auto* delta = static_cast<const acc_t*>(p.delta.data);
  auto* dQ = static_cast<scalar_t*>(p.grad_query.data);
  auto* dK = static_cast<scalar_t*>(p.grad_key.data);
  auto* dV = static_cast<scalar_t*>(p.grad_value.data);
  auto* dMask = static_cast<scalar_t*>(p.grad_mask.data);

  parallel_items(p.batch * p.heads_kv, [&](const auto& next_item) {
    Scratch scratch(scratch_bytes, p.poison_scratch);
    ct* kt_b = scratch.take<ct>(Dpad * BK);     // Kᵀ block as B of S = Q Kᵀ
    ct* vt_b = scratch.take<ct>(Dvpad * BK);    // Vᵀ block as B of dP = dO Vᵀ
    ct* k_b = scratch.take<ct>(BKpad * D);      // K block as B of dQ += dS K
    ct* q_a = scratch.take<ct>(BQ * Dpad);      // Q block as A
    ct* do_a = scratch.take<ct>(BQ * Dvpad);    // dO block as A
    ct* qt_a = scratch.take<ct>(D * BQpad);     // Qᵀ block as A of dKᵀ += Qᵀ dS
    ct* dot_a = scratch.take<ct>(Dv * BQpad);   // dOᵀ block as A of dVᵀ += dOᵀ P
    acc_t* sbuf = scratch.take<acc_t>(BQ * BK);
    acc_t* dpbuf = scratch.take<acc_t>(BQ * BK);
    // P and dS as the B operands of dVᵀ and dKᵀ in VNNI pairs of rows (float ones are read where they lie).
    ct* p_pairs = vnni ? scratch.take<ct>(BQpad * BK) : nullptr;
    ct* ds_pairs = vnni ? scratch.take<ct>(BQpad * BK) : nullptr;
    ct* ds = scratch.take<ct>(BQ * BKpad);      // dS
    acc_t* dk_acc = scratch.take<acc_t>(BK * D);    // the key block's dK rows, from dkt_acc when they are stored
    acc_t* dv_acc = scratch.take<acc_t>(BK * Dv);   // its dV rows
    acc_t* dq_acc = scratch.take<acc_t>(groups * Lq * D);
    acc_t* dkt_acc = scratch.take<acc_t>(D * BK);   // dKᵀ of the key block (leading dimension BK)
    acc_t* dvt_acc = scratch.take<acc_t>(Dv * BK);  // dVᵀ
    uint32_t* bits = p.dropout.enabled ? scratch.take<uint32_t>(BK) : nullptr;
    acc_t* cap_grad = p.softcap > 0.0 ? scratch.take<acc_t>(BK) : nullptr;

    for (int64_t item; (item = next_item()) >= 0;) {
      const int64_t hk = item % p.heads_kv;
      const int64_t b = item / p.heads_kv;
      const scalar_t* k_head = K + b * p.key.s[0] + hk * p.key.s[1];
      const scalar_t* v_head = Vt + b * p.value.s[0] + hk * p.value.s[1];
      const KeyRange span = key_span(p, b);
      std::fill(dq_acc, dq_acc + groups * Lq * D, acc_t(0));

      const auto store_key_grads = [&](int64_t kj, acc_t* dk_row, acc_t* dv_row) {
        store_row(dK + b * p.grad_key.s[0] + hk * p.grad_key.s[1] + kj * p.grad_key.s[2], p.grad_key.s[3],
                  dk_row, D, scale);
        store_row(dV + b * p.grad_value.s[0] + hk * p.grad_value.s[1] + kj * p.grad_value.s[2],
                  p.grad_value.s[3], dv_row, Dv, keep_scale);
      };
      // Keys no query here sees (outside the span of unpadded keys, or in tiles the program leaves empty for
      // every query of the item) are never read: their gradients are 0.
      const auto store_zero_key_grads = [&](int64_t from, int64_t to) {
        std::fill(dk_acc, dk_acc + D, acc_t(0));
        std::fill(dv_acc, dv_acc + Dv, acc_t(0));
        for (int64_t kj = from; kj < to; ++kj) store_key_grads(kj, dk_acc, dv_acc);
      };
      store_zero_key_grads(0, span.first);
      store_zero_key_grads(span.end, Lk);

      // With a program, key blocks start on its tiles' columns and are runs of up to BK keys (a multiple of
      // kTile) of the tiles some query block of the item sees, as in the forward; query blocks lie inside
      // one tile row (BQ divides kTile).
      constexpr int64_t T = fused_attn::kTile;
      const bool program = p.program.present();
      const auto seen_here = [&](int64_t key) {
        const KeyRange queries = queries_seeing(p, key, std::min(key + T, span.end));
        for (int64_t h = hk * groups; h < (hk + 1) * groups; ++h) {
          for (int64_t q0 = queries.first - queries.first % T; q0 < queries.end; q0 += T) {
            if (p.program.tile(b, h, q0, key) != fused_attn::kTileEmpty) return true;
          }
        }
        return false;
      };
      int32_t states[4096 / T];  // of one query block's tiles in a key block (BK <= 4096)
      const int64_t k_start = program ? span.first - span.first % T : span.first;
      for (int64_t k0 = k_start, bk; k0 < span.end; k0 += bk) {
        if (program) {
          bk = std::min(T, span.end - k0);
          if (!seen_here(k0)) {
            store_zero_key_grads(k0, k0 + bk);
            continue;
          }
          while (bk < BK && k0 + bk < span.end && seen_here(k0 + bk)) bk = std::min({bk + T, BK, span.end - k0});
        } else {
          bk = std::min(BK, span.end - k0);
        }
        const int64_t bkpad = vnni ? round_up(bk, 2) : bk;
        const scalar_t* k_ptr = k_head + k0 * p.key.s[2];
        const scalar_t* v_ptr = v_head + k0 * p.value.s[2];
        pack_b(kt_b, k_ptr, p.key.s[3], p.key.s[2], D, Dpad, bk);
        pack_b(vt_b, v_ptr, p.value.s[3], p.value.s[2], Dv, Dvpad, bk);
        pack_b(k_b, k_ptr, p.key.s[2], p.key.s[3], bk, bkpad, D);
        std::fill(dkt_acc, dkt_acc + D * BK, acc_t(0));
        std::fill(dvt_acc, dvt_acc + Dv * BK, acc_t(0));

        // Only the queries whose window reaches these keys (causal: from row k0 on) are visited.
        const KeyRange queries = queries_seeing(p, k0, k0 + bk);
        const int64_t q_start = program ? queries.first - queries.first % BQ : queries.first;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t h = hk * groups + g;
          for (int64_t q0 = q_start; q0 < queries.end; q0 += BQ) {
            const int64_t bq = std::min(BQ, queries.end - q0);
            // Only the keys the query block computes (none: skipped); the other keys' P and dS are 0, and their K
            // and V stay unread. From here on the block is keys kb .. kb + w: lead is a multiple of kTile, so the
            // VNNI pairs of the packed operands start there too (a column of Kᵀ and Vᵀ is a pair of values).
            const BlockKeys keys = block_keys(p, b, h, q0, k0, std::min(bk, visible_keys(p, q0 + bq - 1, span).end - k0),
                                              visible_keys(p, q0, span).first, states);
            if (keys.end == 0) continue;
            const int64_t lead = keys.first, kb = k0 + lead, w = keys.end - lead;
            const int64_t wpad = vnni ? round_up(w, 2) : w;
            const int64_t column = vnni ? 2 * lead : lead;
            const int64_t bqpad = vnni ? round_up(bq, 2) : bq;
            const scalar_t* q_ptr = Q + b * p.query.s[0] + h * p.query.s[1] + q0 * p.query.s[2];
            const scalar_t* do_ptr =
                dO + b * p.grad_out.s[0] + h * p.grad_out.s[1] + q0 * p.grad_out.s[2];
            pack_a(q_a, Dpad, q_ptr, p.query.s[2], p.query.s[3], bq, D);
            pack_a(do_a, Dvpad, do_ptr, p.grad_out.s[2], p.grad_out.s[3], bq, Dv);
            pack_transposed(qt_a, bqpad, q_ptr, p.query.s[2], p.query.s[3], bq, D);
            pack_transposed(dot_a, bqpad, do_ptr, p.grad_out.s[2], p.grad_out.s[3], bq, Dv);
            gemm<ct, acc_t>(bq, w, Dpad, q_a, Dpad, kt_b + column, bk, sbuf, bk, false, p.use_brgemm);
            gemm<ct, acc_t>(bq, w, Dvpad, do_a, Dvpad, vt_b + column, bk, dpbuf, bk, false, p.use_brgemm);

            for (int64_t r = 0; r < bq; ++r) {
              const int64_t qi = q0 + r;
              acc_t* srow = sbuf + r * bk;
              acc_t* dprow = dpbuf + r * bk;
              // The row's keys in this block, [first, last); the rest of its P and dS are 0.
              const KeyRange seen = visible_keys(p, qi, span);
              const int64_t first = std::clamp<int64_t>(seen.first - kb, 0, w);
              const int64_t last = std::clamp<int64_t>(seen.end - kb, first, w);
              const int64_t n = last - first;
              acc_t* s_seen = srow + first;
              acc_t* dp_seen = dprow + first;
              acc_t lse = LSE[b * p.lse.s[0] + h * p.lse.s[1] + qi * p.lse.s[2]];
              // A row that saw no key has lse -inf; +inf makes every P of it 0.
              if (lse == neg_inf<acc_t>()) lse = std::numeric_limits<acc_t>::infinity();
              const acc_t d = delta[b * p.delta.s[0] + h * p.delta.s[1] + qi * p.delta.s[2]];
              // Scores are scaled inside the exp when nothing else applies; srow then holds P.
              if (!plain_scores) prepare_scores<acc_t, scalar_t>(s_seen, n, scale, p, b, h, qi, kb + first, cap_grad);
              if (keys.hides) hide_by_program(p, s_seen, n, kb, first, qi, states + lead / T);
              exp_row<ct>(s_seen, n, plain_scores ? scale : acc_t(1), lse, s_seen);
              // With dropout, O = (Z ∘ P / (1 - p)) V: the gradient of the undropped weights is
              // Z ∘ dP / (1 - p), and dV takes Z ∘ P (scaled by 1 / (1 - p) when stored).
              if (p.dropout.enabled) {
                dropout_row_bits(p.dropout, b * p.heads_q + h, qi, kb + first, n, bits);
                drop_and_scale_row(dp_seen, bits, n, p.dropout.threshold, keep_scale);
              }
              grad_scores(s_seen, dp_seen, n, d);  // dprow now holds dS
              if (dMask != nullptr) {  // an additive mask's gradient is dS; hidden keys keep their 0
                at::vec::convert(dp_seen, dMask + b * p.grad_mask.s[0] + h * p.grad_mask.s[1] +
                                              qi * p.grad_mask.s[2] + (kb + first) * p.grad_mask.s[3], n);
              }
              if (p.softcap > 0.0) {  // the capped score's gradient times the cap's derivative
                for (int64_t j = 0; j < n; ++j) dp_seen[j] *= cap_grad[j];
              }
              if (p.dropout.enabled) drop_row(s_seen, bits, n, p.dropout.threshold);
              std::fill(srow, s_seen, acc_t(0));
              std::fill(dprow, dp_seen, acc_t(0));
              std::fill(srow + last, srow + w, acc_t(0));
              std::fill(dprow + last, dprow + w, acc_t(0));
            }
            const ct* ds_a = reinterpret_cast<const ct*>(dpbuf);
            int64_t ld_ds = bk;
            if constexpr (!std::is_same_v<ct, acc_t>) {
              for (int64_t r = 0; r < bq; ++r) {
                convert_floats(dpbuf + r * bk, ds + r * wpad, w);
                if (wpad > w) ds[r * wpad + w] = ct(0);
              }
              ds_a = ds;
              ld_ds = wpad;
            }
            // dVᵀ += dOᵀ P and dKᵀ += Qᵀ dS, not dV += Pᵀ dO and dK += dSᵀ Q: P and dS are B operands as they lie
            // (float) or as VNNI pairs of rows (one pass over the floats, where transposing both took 16 % of a bf16
            // forward+backward on AMX, bench/NOTES.md section 71); dKᵀ and dVᵀ are transposed once per key block.
            const ct* p_b = reinterpret_cast<const ct*>(sbuf);
            const ct* ds_b = reinterpret_cast<const ct*>(dpbuf);
            int64_t ld_b = bk;
            if constexpr (vnni) {
              pack_row_pairs(p_pairs, sbuf, bk, bq, w);
              pack_row_pairs(ds_pairs, dpbuf, bk, bq, w);
              p_b = p_pairs;
              ds_b = ds_pairs;
              ld_b = w;
            }
            gemm<ct, acc_t>(Dv, w, bqpad, dot_a, bqpad, p_b, ld_b, dvt_acc + lead, BK, true, p.use_brgemm);
            gemm<ct, acc_t>(D, w, bqpad, qt_a, bqpad, ds_b, ld_b, dkt_acc + lead, BK, true, p.use_brgemm);
            gemm<ct, acc_t>(bq, D, wpad, ds_a, ld_ds, k_b + lead * D, D, dq_acc + (g * Lq + q0) * D, D, true,
                            p.use_brgemm);
          }
        }
        pack_transposed(dk_acc, D, dkt_acc, BK, 1, D, bk);
        pack_transposed(dv_acc, Dv, dvt_acc, BK, 1, Dv, bk);
        for (int64_t j = 0; j < bk; ++j) store_key_grads(k0 + j, dk_acc + j * D, dv_acc + j * Dv);
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t h = hk * groups + g;
        for (int64_t i = 0; i < Lq; ++i) {
          store_row(dQ + b * p.grad_query.s[0] + h * p.grad_query.s[1] + i * p.grad_query.s[2],
                    p.grad_query.s[3], dq_acc + (g * Lq + i) * D, D, scale);
        }
      }
    }
    if (vnni || (std::is_same_v<ct, float> && p.use_brgemm)) at::native::cpublas::brgemm_release(vnni);
  });
}

// Whether bf16/fp16 operands keep their type for oneDNN's brgemm: where ATen packs them for it (AMX),
// and bf16 in the AVX512-BF16 copy wherever oneDNN's bf16 brgemm runs (p.bf16_brgemm), its
// vdpbf16ps doing twice the multiply-adds of float FMAs. Elsewhere they become float. `dot_rows`: a
// decode call whose scores are dot products of K rows as they lie (decode_impl, in float), which
// stays cheaper than transposing every K block into VNNI pairs for a product of so few rows, with
// AMX too (4 × 32 heads of one query against 2048 keys on Zen 4: 8.5 ms in float, 10.9 ms through
// bf16 brgemm; bench/NOTES.md 38 for AMX), and lets a paged cache's key blocks span its blocks.
inline bool typed_products(const Params& p, at::ScalarType type, bool dot_rows) {
  if (!p.use_brgemm || p.cache != CacheType::Plain || dot_rows) return false;  // 8-bit caches: dequantized
  if (at::native::cpublas::could_pack(type)) return true;
#if defined(FUSED_ATTN_AVX512_BF16)
  return type == at::kBFloat16 && p.bf16_brgemm;
#else
  return false;
#endif
}

// float and float64 multiply in their own type; bf16/fp16 as typed_products says.
template <template <typename, typename> class Run>
void dispatch(const Params& p, bool dot_rows) {
  switch (p.dtype) {
    case Dtype::Float32:
      Run<float, float>::run(p);
      break;
    case Dtype::Float64:
      Run<double, double>::run(p);
      break;
    case Dtype::BFloat16:
      if (typed_products(p, at::kBFloat16, dot_rows)) {
        Run<c10::BFloat16, c10::BFloat16>::run(p);
      } else {
        Run<c10::BFloat16, float>::run(p);
      }
      break;
    case Dtype::Float16:
      if (typed_products(p, at::kHalf, dot_rows)) {
        Run<c10::Half, c10::Half>::run(p);
      } else {
        Run<c10::Half, float>::run(p);
      }
      break;
  }
}

template <typename scalar_t, typename ct>
struct RunForward {
  static void run(const Params& p) { takes_decode_path(p) ? decode_impl<scalar_t, ct>(p) : forward_impl<scalar_t, ct>(p); }
};
template <typename scalar_t, typename ct>
struct RunBackward {
  static void run(const Params& p) { backward_impl<scalar_t, ct>(p); }
};

}  // namespace

void forward(const Params& p) {
  dispatch<RunForward>(p, takes_decode_path(p) && p.heads_q / p.heads_kv * p.len_q <= kDotRows);
}
void backward(const Params& p) { dispatch<RunBackward>(p, false); }

const char* products(const Params& p) {
  const char* in_float = p.use_brgemm ? "oneDNN brgemm in float" : "register-blocked micro-kernel in float";
  switch (p.dtype) {
    case Dtype::Float32:
      return in_float;
    case Dtype::Float64:
      return "register-blocked micro-kernel in float64";
    case Dtype::BFloat16:
    case Dtype::Float16: {
      const at::ScalarType type = p.dtype == Dtype::BFloat16 ? at::kBFloat16 : at::kHalf;
      if (!typed_products(p, type, false)) {
        return p.use_brgemm ? "operands converted to float, oneDNN brgemm" : "operands converted to float, micro-kernel";
      }
      return at::native::cpublas::could_pack(type) ? "oneDNN brgemm on 16-bit operands (AMX)"
                                                   : "oneDNN brgemm on bf16 operands (AVX512-BF16, no AMX)";
    }
  }
  return "unknown";
}

}  // namespace CPU_CAPABILITY
}  // namespace fused_attn_cpu
