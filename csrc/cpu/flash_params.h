// The plain description of one forward or backward call that the CPU kernels receive.
//
// The kernels are compiled once per instruction set (kernel_default.cpp, kernel_isa_avx2.cpp,
// kernel_isa_avx512.cpp, kernel_isa_avx512_bf16.cpp) and chosen at run time, as ATen chooses its own CPU kernels. They see no
// at::Tensor: attention_cpu.cpp checks every tensor and fills this struct with raw pointers and
// element strides, so the per-instruction-set files stay small and free of Tensor code.
#pragma once

#include <cstdint>

#include "../block_mask.h"
#include "../dropout.h"

namespace fused_attn_cpu {

enum class Dtype { Float32, Float64, BFloat16, Float16 };
// The elements of a paged key/value cache: the query's dtype, or 8-bit values with float32 scales
// (fused_attn/quantization.py).
enum class CacheType { Plain, Float8E4M3, Int8 };
enum class MaskKind { None, Bool, Additive };

// A strided view: element (i0, i1, i2, i3) lives at data + i0*s[0] + i1*s[1] + i2*s[2] + i3*s[3].
struct View {
  void* data = nullptr;
  int64_t s[4] = {0, 0, 0, 0};
};

// Calls of at most this many queries take the decode kernels (flash_kernel.h's decode_impl, takes_decode_path).
constexpr int64_t kDecodeMaxQueries = 16;

struct Params {
  Dtype dtype = Dtype::Float32;
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_k = 0, dim_qk = 0, dim_v = 0;
  View query, key, value;  // (B, H_q, L_q, D_qk), (B, H_kv, L_k, D_qk), (B, H_kv, L_k, D_v)
  // A paged key/value cache (forward only): key j of batch row b lies in cache block
  // pages[b * pages_stride + j / page_size], at row j % page_size of it; key.s[0] and value.s[0] then step
  // between blocks, s[2] between a block's rows. Null: key and value are dense (B, H_kv, L_k, D).
  const int32_t* pages = nullptr;
  int64_t pages_stride = 0, page_size = 0;
  // An 8-bit paged cache (forward only): key and value hold float8_e4m3fn or int8 values, and key j stands for
  // its values times its scale, a float32 of k_scale (v_scale for its value). Per token (token_scales), the
  // scales are laid out like the keys without D: s[0] steps between blocks, s[1] between heads, s[2] between a
  // block's rows, read through the same block table. Per sequence, s[0] steps between batch rows, s[1] between
  // heads, and s[2] is 0. The kernels dequantize K and V into float rows where they load them.
  CacheType cache = CacheType::Plain;
  View k_scale, v_scale;
  bool token_scales = false;
  MaskKind mask_kind = MaskKind::None;
  View mask;               // (B, H_q, L_q, L_k), stride 0 where it broadcasts
  View key_padding;        // bool (B, L_k) in s[0], s[1]; data null when absent or said by key_spans
  // Padding as ranges: the keys of batch row b that are not padding lie within [key_spans[2 b],
  // key_spans[2 b + 1]); null: every key may be visible. When the ranges say everything (padding only
  // at the ends of each row, as left and right padding are), key_padding.data is null: no score
  // reads the padding, and keys outside the range are never visited.
  const int64_t* key_spans = nullptr;
  // The score variant (fused_attn/scores.py). Query i sees keys i + diagonal - window_left through
  // i + diagonal + window_right (-1: unbounded on that side; is_causal is window_right 0).
  int64_t window_left = -1, window_right = -1;
  int64_t diagonal = 0;    // 0 top-left, L_k - L_q bottom-right, plus the call's diagonal_shift
  double softcap = 0.0;    // > 0: scaled scores become softcap * tanh(s / softcap)
  // A mask program (csrc/block_mask.h), absent when program.tiles is null: its empty tiles are never
  // visited, its partial ones hide the keys their bits clear.
  fused_attn::BlockProgram program;
  View alibi;              // float32 slopes (B, H_q) in s[0], s[1], data null when absent
  // Forward only: (H_q,) of the lse's dtype, one logit per query head in every row's softmax with no
  // value (null: none). Folded in where each row's log-sum-exp is finalised (finish_row in flash_kernel.h).
  const void* sinks = nullptr;
  double scale = 1.0;
  fused_attn::DropoutParams dropout;  // enabled: drop the elements of csrc/dropout.h's stream
  View out;                // (B, H_q, L_q, D_v)
  View lse;                // (B, H_q, L_q) in s[0..2]; float32, or float64 for float64 inputs
  // Backward only.
  View grad_out;           // (B, H_q, L_q, D_v)
  View delta;              // (B, H_q, L_q) accumulation type: rowsum(dO * O) - grad_lse, filled by the kernel
  View grad_lse;           // (B, H_q, L_q) lse dtype, data null when absent
  View grad_query, grad_key, grad_value;
  View grad_mask;          // (B, H_q, L_q, L_k) of the query's dtype, data null when not asked for
  // Tiling and the product used for the two matrix products of each block.
  int64_t block_q = 64, block_k = 64;
  bool use_brgemm = true;  // oneDNN micro-kernels through at::native::cpublas::brgemm, where usable
  // oneDNN's bf16 brgemm runs on this CPU without AMX (its avx512_core_bf16 kernels): the copy built
  // for AVX512-BF16 then keeps bf16 operands in their type, as where AMX runs them.
  bool bf16_brgemm = false;
  bool use_decode = true;  // the decode kernels for few query rows (flash_kernel.h, takes_decode_path)
  // Per-thread scratch filled with NaN bytes before use (FUSED_ATTN_CPU_POISON_SCRATCH=1, set by the
  // tests): a value read before the kernels wrote it then reaches the output.
  bool poison_scratch = false;
};

// (A program's tiles are read by the long-query kernel: its blocks are the tiles' rows and columns.)
inline bool takes_decode_path(const Params& p) {
  return p.use_decode && p.len_q > 0 && p.len_q <= kDecodeMaxQueries && !p.program.present();
}

// One entry point per instruction set; run() in attention_cpu.cpp picks one. products() names
// what computes the matrix products of a call of p.dtype, for benchmarks to record.
namespace DEFAULT {
void forward(const Params& p);
void backward(const Params& p);
const char* products(const Params& p);
}  // namespace DEFAULT
namespace AVX2 {
void forward(const Params& p);
void backward(const Params& p);
const char* products(const Params& p);
}  // namespace AVX2
namespace AVX512 {
void forward(const Params& p);
void backward(const Params& p);
const char* products(const Params& p);
}  // namespace AVX512
namespace AVX512_BF16 {
void forward(const Params& p);
void backward(const Params& p);
const char* products(const Params& p);
}  // namespace AVX512_BF16

}  // namespace fused_attn_cpu
