// Host side of the `cuda` backend, shared by the real build (flash_cuda.cu) and the CPU emulation of
// the tests (tests/emulation/flash_emulated.cpp): every TORCH_CHECK on the arguments, the kernel
// parameters taken from the tensors, the choice of template instance and the launch shapes. How a
// kernel is launched is the caller's `launch(kernel, LaunchShape, params)`; devices are checked by
// the caller too (CUDA tensors there, CPU tensors in the emulation), and so is
// `launch.multiprocessors()`, the SM count the decode kernels' split count follows (the device's, or
// a fixed count in the emulation).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../block_mask_args.h"
#include "../output_memory.h"
#include "flash_kernels.cuh"

namespace fused_attn_cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename T>
struct ScalarTypeOf;
template <>
struct ScalarTypeOf<__half> {
  static constexpr at::ScalarType value = at::kHalf;
};
template <>
struct ScalarTypeOf<__nv_bfloat16> {
  static constexpr at::ScalarType value = at::kBFloat16;
};
template <>
struct ScalarTypeOf<float> {
  static constexpr at::ScalarType value = at::kFloat;
};

// Calls fn(TypeTag<T>{}, std::integral_constant<int, HEAD>{}) with the shipped instance that
// serves `dtype` and a largest head dim of `head_dim`.
template <typename Fn>
void dispatch_instance(at::ScalarType dtype, int64_t head_dim, Fn&& fn) {
  const int head = head_dim <= kMaxHeadDim ? padded_head_dim(static_cast<int>(head_dim)) : 0;
#define FUSED_ATTN_CUDA_DISPATCH(T, D)                  \
  if (dtype == ScalarTypeOf<T>::value && head == D) {   \
    fn(TypeTag<T>{}, std::integral_constant<int, D>{}); \
    return;                                             \
  }
  FUSED_ATTN_CUDA_FOR_EACH_INSTANCE(FUSED_ATTN_CUDA_DISPATCH)
#undef FUSED_ATTN_CUDA_DISPATCH
  TORCH_CHECK(false, "fused_attn cuda: no kernel for dtype ", dtype, " and head dim ", head_dim);
}

// Calls fn(TypeTag<T>{}, std::integral_constant<int, HEAD>{}, std::integral_constant<int, BM>{}) with
// the decode instance that serves `dtype`, a largest head dim of `head_dim` and a GQA group of
// `rows` query rows (takes_decode has checked that one does).
template <typename Fn>
void dispatch_decode_instance(at::ScalarType dtype, int64_t head_dim, int64_t rows, Fn&& fn) {
  const int head = head_dim <= kDecodeMaxHeadDim ? padded_head_dim(static_cast<int>(head_dim)) : 0;
  const int block_m = decode_block_m(static_cast<int>(rows));
#define FUSED_ATTN_CUDA_DISPATCH(T, D, BM)                                                            \
  if (dtype == ScalarTypeOf<T>::value && head == D && block_m == BM) {                                \
    fn(TypeTag<T>{}, std::integral_constant<int, D>{}, std::integral_constant<int, BM>{});            \
    return;                                                                                           \
  }
  FUSED_ATTN_CUDA_FOR_EACH_DECODE_INSTANCE(FUSED_ATTN_CUDA_DISPATCH)
#undef FUSED_ATTN_CUDA_DISPATCH
  TORCH_CHECK(false, "fused_attn cuda: no decode kernel for dtype ", dtype, ", head dim ", head_dim, " and ",
              rows, " rows");
}

inline void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, "fused_attn cuda: ", name, " must have shape ", expected,
              ", got ", t.sizes());
}

template <size_t N>
void copy_strides(const at::Tensor& t, int64_t (&strides)[N]) {
  TORCH_CHECK(t.dim() == static_cast<int64_t>(N), "fused_attn cuda: internal rank mismatch");
  for (size_t i = 0; i < N; ++i) strides[i] = t.stride(static_cast<int64_t>(i));
}

// Checks query, key, value and the masks against the contract of fused_attn/problem.py and
// returns the parameters every kernel reads.
inline AttentionParams attention_params(const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask,
                                        const std::optional<at::Tensor>& key_padding_mask,
                                        bool is_causal, double scale) {
  const auto check_rank = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 4, "fused_attn cuda: ", name, " must be 4-D (B, H, L, D), got shape ",
                t.sizes());
  };
  check_rank(query, "query");
  check_rank(key, "key");
  check_rank(value, "value");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "fused_attn cuda: query must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype,
              "fused_attn cuda: key and value must have query's dtype ", dtype, ", got ",
              key.scalar_type(), " and ", value.scalar_type());
  const int64_t batch = query.size(0), heads_q = query.size(1), len_q = query.size(2);
  const int64_t dim_qk = query.size(3), heads_kv = key.size(1), len_k = key.size(2);
  const int64_t dim_v = value.size(3);
  check_shape(key, "key", {batch, heads_kv, len_k, dim_qk});
  check_shape(value, "value", {batch, heads_kv, len_k, dim_v});
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0, "fused_attn cuda: the ", heads_q,
              " query heads must be a multiple of the ", heads_kv, " key/value heads");
  TORCH_CHECK(std::max(dim_qk, dim_v) <= kMaxHeadDim, "fused_attn cuda: head dims up to ",
              kMaxHeadDim, " are supported, got ", dim_qk, " (query/key) and ", dim_v, " (value)");
  // Grid limits: y and z of a grid are at most 65535; lengths index with int.
  TORCH_CHECK(batch <= 65535 && heads_q <= 65535, "fused_attn cuda: batch and heads must be at "
              "most 65535, got ", batch, " and ", heads_q);
  TORCH_CHECK(len_q < INT_MAX / 2 && len_k < INT_MAX / 2, "fused_attn cuda: sequence too long");
  TORCH_CHECK(std::isfinite(scale), "fused_attn cuda: scale must be finite, got ", scale);

  AttentionParams p{};
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  copy_strides(query, p.q_stride);
  copy_strides(key, p.k_stride);
  copy_strides(value, p.v_stride);
  p.mask = nullptr;
  p.mask_kind = kNoMask;
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    TORCH_CHECK(mask.dim() == 4, "fused_attn cuda: attn_mask must be viewed as (B, H_q, L_q, L_k)"
                " with stride 0 where it broadcasts, got shape ", mask.sizes());
    check_shape(mask, "attn_mask", {batch, heads_q, len_q, len_k});
    TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == dtype,
                "fused_attn cuda: attn_mask must be bool or ", dtype, ", got ", mask.scalar_type());
    p.mask = mask.data_ptr();
    p.mask_kind = mask.scalar_type() == at::kBool ? kBoolMask : kAdditiveMask;
    copy_strides(mask, p.mask_stride);
  }
  p.key_padding = nullptr;
  p.key_spans = nullptr;
  if (key_padding_mask.has_value()) {
    const at::Tensor& padding = *key_padding_mask;
    TORCH_CHECK(padding.scalar_type() == at::kBool,
                "fused_attn cuda: key_padding_mask must be bool (true = ignore), got ",
                padding.scalar_type());
    TORCH_CHECK(padding.dim() == 2, "fused_attn cuda: key_padding_mask must be (B, L_k)");
    check_shape(padding, "key_padding_mask", {batch, len_k});
    p.key_padding = static_cast<const uint8_t*>(padding.data_ptr());
    copy_strides(padding, p.key_padding_stride);
  }
  p.batch = static_cast<int>(batch);
  p.heads_q = static_cast<int>(heads_q);
  p.heads_kv = static_cast<int>(heads_kv);
  p.group = static_cast<int>(heads_q / heads_kv);
  p.len_q = static_cast<int>(len_q);
  p.len_k = static_cast<int>(len_k);
  p.dim_qk = static_cast<int>(dim_qk);
  p.dim_v = static_cast<int>(dim_v);
  p.scale = static_cast<float>(scale);
  // Causal until set_variant says more: right bound 0, left unbounded, top-left.
  p.banded = is_causal;
  p.diagonal = 0;
  p.diagonal_shift = 0;
  p.window_left = static_cast<int>(len_q + len_k);
  p.window_right = is_causal ? 0 : static_cast<int>(len_q + len_k);
  p.softcap = 0.0f;
  p.alibi = nullptr;
  p.sinks = nullptr;
  return p;
}

// The key padding's span per batch row (AttentionParams::key_spans), computed on the mask's device
// without a host synchronisation; the caller keeps the returned tensor until the kernels are launched.
inline at::Tensor set_key_spans(AttentionParams& p, const std::optional<at::Tensor>& key_padding_mask) {
  if (!key_padding_mask.has_value() || p.len_k == 0) return {};
  const at::Tensor kept = key_padding_mask->logical_not();
  const at::Tensor index = at::arange(p.len_k, kept.options().dtype(at::kInt));
  const at::Tensor first = at::where(kept, index, p.len_k).amin(1);
  const at::Tensor end = at::where(kept, index + 1, 0).amax(1);
  at::Tensor spans = at::stack({first, at::maximum(first, end)}, 1).to(at::kInt).contiguous();
  p.key_spans = spans.data_ptr<int>();
  return spans;
}

// A call's score variant (fused_attn/scores.py) as the ops receive it.
struct VariantArgs {
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  bool bottom_right = false;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes;  // float32 (B, H_q), any strides
  int64_t diagonal_shift = 0;              // added to the alignment's diagonal
  std::optional<at::Tensor> block_tiles;   // a mask program (csrc/block_mask.h), both or neither
  std::optional<at::Tensor> block_bits;
  std::optional<at::Tensor> sinks;         // float32 (H_q,), contiguous; the forward ops' only
};

// The band, diagonal, softcap, ALiBi slopes and sinks of the call into the kernel parameters, on top of
// the causal band attention_params set.
inline void set_variant(AttentionParams& p, const VariantArgs& v) {
  TORCH_CHECK(v.window_left >= -1 && v.window_right >= -1, "fused_attn cuda: window_left and window_right "
              "must be -1 (unbounded) or >= 0, got ", v.window_left, " and ", v.window_right);
  TORCH_CHECK(std::isfinite(v.softcap) && v.softcap >= 0.0, "fused_attn cuda: softcap must be a finite "
              "number >= 0, got ", v.softcap);
  // A bound no index pair reaches, however far the diagonal is shifted.
  const int64_t beyond = static_cast<int64_t>(p.len_q) + p.len_k + std::abs(v.diagonal_shift);
  TORCH_CHECK(beyond <= std::numeric_limits<int>::max() / 4, "fused_attn cuda: diagonal_shift: expected an "
              "offset of magnitude below 2^29 - L_q - L_k, got ", v.diagonal_shift);
  const bool causal = p.banded;  // attention_params' band: right bound 0
  p.window_left = static_cast<int>(v.window_left == -1 ? beyond : std::min(v.window_left, beyond));
  p.window_right = static_cast<int>(causal ? 0 : v.window_right == -1 ? beyond : std::min(v.window_right, beyond));
  p.banded = p.banded || v.window_left != -1 || v.window_right != -1;
  p.bottom_right = v.bottom_right;
  p.diagonal_shift = static_cast<int>(v.diagonal_shift);
  p.diagonal = (v.bottom_right ? p.len_k - p.len_q : 0) + p.diagonal_shift;
  p.softcap = static_cast<float>(v.softcap);
  if (v.alibi_slopes.has_value() && v.alibi_slopes->defined()) {
    const at::Tensor& slopes = *v.alibi_slopes;
    TORCH_CHECK(slopes.scalar_type() == at::kFloat, "fused_attn cuda: alibi_slopes must be float32, got ",
                slopes.scalar_type());
    TORCH_CHECK(slopes.dim() == 2, "fused_attn cuda: alibi_slopes must be (B, H_q), got shape ", slopes.sizes());
    check_shape(slopes, "alibi_slopes", {p.batch, p.heads_q});
    p.alibi = slopes.data_ptr<float>();
    copy_strides(slopes, p.alibi_stride);
  }
  p.sinks = nullptr;
  if (v.sinks.has_value() && v.sinks->defined()) {
    const at::Tensor& sinks = *v.sinks;
    TORCH_CHECK(sinks.scalar_type() == at::kFloat, "fused_attn cuda: sinks must be float32, got ",
                sinks.scalar_type());
    TORCH_CHECK(sinks.dim() == 1, "fused_attn cuda: sinks must be (H_q,), one logit per query head, got shape ",
                sinks.sizes());
    check_shape(sinks, "sinks", {p.heads_q});
    TORCH_CHECK(sinks.is_contiguous(), "fused_attn cuda: sinks must be contiguous, got strides ", sinks.strides());
    p.sinks = sinks.data_ptr<float>();
  }
}

// The mask program of the call to `op` into the kernel parameters, checked by block_program_of.
inline void set_program(AttentionParams& p, const char* op, const VariantArgs& v, const at::Tensor& query) {
  p.program = fused_attn::block_program_of(op, v.block_tiles, v.block_bits, query, p.batch, p.heads_q, p.len_q,
                                           p.len_k);
}

// The call's dropout into the kernel parameters: dropout_p in [0, 1) and, when it is above 0, the
// call's (seed, offset, query_start, key_start) as a contiguous int64 tensor of four elements on the
// tensors' device, which the
// kernels read themselves (fused_attn/dropout.py draws it there).
inline void set_dropout(AttentionParams& p, double dropout_p, const std::optional<at::Tensor>& dropout_rng) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "fused_attn cuda: dropout_p must be in [0, 1), got ",
              dropout_p);
  p.dropout_rng = nullptr;
  p.drop_threshold = 0;
  p.keep_scale = 1.0f;
  if (dropout_p == 0.0) return;
  TORCH_CHECK(dropout_rng.has_value() && dropout_rng->defined(),
              "fused_attn cuda: dropout_rng: the call's (seed, offset, query_start, key_start) is needed with dropout_p > 0");
  const at::Tensor& rng = *dropout_rng;
  TORCH_CHECK(rng.scalar_type() == at::kLong && rng.dim() == 1 && rng.size(0) == 4 && rng.stride(0) == 1,
              "fused_attn cuda: dropout_rng must be a contiguous int64 tensor (seed, offset, query_start, "
              "key_start) of shape (4,), got ", rng.scalar_type(), " of shape ", rng.sizes(), " and strides ", rng.strides());
  p.dropout_rng = rng.data_ptr<int64_t>();
  p.drop_threshold = fused_attn::dropout_threshold(dropout_p);
  p.keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
}

inline void check_like_output(const at::Tensor& t, const char* name, const at::Tensor& query,
                              const AttentionParams& p) {
  TORCH_CHECK(t.dim() == 4, "fused_attn cuda: ", name, " must be 4-D, got shape ", t.sizes());
  check_shape(t, name, {p.batch, p.heads_q, p.len_q, p.dim_v});
  TORCH_CHECK(t.scalar_type() == query.scalar_type(), "fused_attn cuda: ", name,
              " must have query's dtype ", query.scalar_type(), ", got ", t.scalar_type());
}

// ---- split-KV decode ---------------------------------------------------------------------------

// FUSED_ATTN_CUDA_DECODE=0 runs every forward on the long-query kernel.
inline bool decode_enabled() {
  const char* setting = std::getenv("FUSED_ATTN_CUDA_DECODE");
  return setting == nullptr || std::string(setting) != "0";
}

// Whether a forward call runs the decode kernels: few query rows per key/value head, head dims up to
// kDecodeMaxHeadDim, keys to attend to, no dropout.
inline bool takes_decode(const AttentionParams& p) {
  return decode_enabled() && p.dropout_rng == nullptr && p.len_q > 0 && p.len_q <= kDecodeMaxQueries &&
         static_cast<int64_t>(p.group) * p.len_q <= kDecodeMaxRows && p.len_k > 0 &&
         std::max(p.dim_qk, p.dim_v) <= kDecodeMaxHeadDim;
}

// Splits of the keys: doubled while the blocks are fewer than two per SM and each split keeps at least
// kDecodeMinKeysPerSplit keys. FUSED_ATTN_CUDA_DECODE_SPLITS overrides it (at most one split per key).
inline int decode_split_count(const AttentionParams& p, int multiprocessors) {
  if (const char* forced = std::getenv("FUSED_ATTN_CUDA_DECODE_SPLITS"); forced != nullptr && *forced != '\0') {
    const std::string text(forced);
    const bool digits = text.size() <= 9 && text.find_first_not_of("0123456789") == std::string::npos;
    TORCH_CHECK(digits && std::stoi(text) >= 1, "fused_attn cuda: FUSED_ATTN_CUDA_DECODE_SPLITS: expected a "
                "positive integer, got '", text, "'");
    return std::min(std::stoi(text), std::max(1, p.len_k));
  }
  const int64_t blocks = static_cast<int64_t>(p.batch) * p.heads_kv;
  int splits = 1;
  while (blocks * splits < 2 * static_cast<int64_t>(multiprocessors) &&
         p.len_k / (2 * splits) >= kDecodeMinKeysPerSplit)
    splits *= 2;
  return splits;
}

// The decode and combine kernels of forward `params` (takes_decode): out and lse (B, H_q, L_q) through
// an fp32 workspace of the splits' outputs. `launch.multiprocessors()` is the device's SM count.
template <typename Launch>
void flash_decode(const ForwardParams& forward, at::ScalarType dtype, const at::TensorOptions& options,
                  const Launch& launch) {
  const AttentionParams& p = forward.attn;
  const int rows = p.group * p.len_q;
  DecodeParams params{};
  params.attn = p;
  params.splits = decode_split_count(p, launch.multiprocessors());
  const at::Tensor part_out =
      at::empty({p.batch, p.heads_kv, params.splits, rows, p.dim_v}, options.dtype(at::kFloat));
  const at::Tensor part_lse = at::empty({p.batch, p.heads_kv, params.splits, rows}, options.dtype(at::kFloat));
  params.part_out = part_out.data_ptr<float>();
  params.part_lse = part_lse.data_ptr<float>();

  CombineParams combine{};
  combine.part_out = params.part_out;
  combine.part_lse = params.part_lse;
  combine.out = forward.out;
  std::copy(forward.out_stride, forward.out_stride + 4, combine.out_stride);
  combine.lse = forward.lse;
  combine.sinks = p.sinks;
  combine.batch = p.batch;
  combine.heads_q = p.heads_q;
  combine.heads_kv = p.heads_kv;
  combine.group = p.group;
  combine.len_q = p.len_q;
  combine.dim_v = p.dim_v;
  combine.splits = params.splits;
  dispatch_decode_instance(dtype, std::max(p.dim_qk, p.dim_v), rows, [&](auto type, auto head, auto block_m) {
    using T = typename decltype(type)::type;
    constexpr int HEAD = decltype(head)::value, BM = decltype(block_m)::value;
    params.keys_per_split = decode_keys_per_split(p.len_k, params.splits, DecodeConfig<T, HEAD, BM>::block_n);
    launch(&flash_decode_kernel<T, HEAD, BM>, decode_shape<T, HEAD, BM>(p, params.splits), params);
    launch(&flash_decode_combine_kernel<T>, one_warp_per_row(static_cast<int64_t>(p.batch) * p.heads_q * p.len_q),
           combine);
  });
}

// The forward kernel on the problem and outputs of `params`.
template <typename Launch>
void launch_forward(const ForwardParams& params, at::ScalarType dtype, const Launch& launch) {
  const AttentionParams& p = params.attn;
  dispatch_instance(dtype, std::max(p.dim_qk, p.dim_v), [&](auto type, auto head) {
    using T = typename decltype(type)::type;
    constexpr int HEAD = decltype(head)::value;
    launch(&flash_forward_kernel<T, HEAD>, forward_shape<T, HEAD>(p), params);
  });
}

// Writes softmax(scale · Q Kᵀ + masks) V into `out` and returns the log-sum-exp (B, H_q, L_q); with
// `variant.sinks`, each row's softmax also takes its head's sink (a column without value), and so does
// the log-sum-exp; with `variant.block_tiles` / `block_bits`, a mask program hides keys too (in the
// long-query and the decode kernels alike).
template <typename Launch>
at::Tensor flash_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask,
                         const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                         double scale, const at::Tensor& out, double dropout_p,
                         const std::optional<at::Tensor>& dropout_rng, const VariantArgs& variant,
                         const Launch& launch) {
  ForwardParams params{};
  params.attn = attention_params(query, key, value, attn_mask, key_padding_mask, is_causal, scale);
  set_dropout(params.attn, dropout_p, dropout_rng);
  set_variant(params.attn, variant);
  set_program(params.attn, "flash_forward", variant, query);
  const at::Tensor spans = set_key_spans(params.attn, key_padding_mask);
  const AttentionParams& p = params.attn;
  check_like_output(out, "out", query, p);
  fused_attn::check_output_memory("flash_forward", "out", out,
                                  {{"query", &query}, {"key", &key}, {"value", &value},
                                   {"attn_mask", attn_mask.has_value() ? &*attn_mask : nullptr}});
  at::Tensor lse = at::empty({p.batch, p.heads_q, p.len_q}, query.options().dtype(at::kFloat));
  if (lse.numel() == 0) return lse;
  params.out = out.data_ptr();
  copy_strides(out, params.out_stride);
  params.lse = lse.data_ptr<float>();
  copy_strides(lse, params.lse_stride);
  if (takes_decode(p)) {
    flash_decode(params, query.scalar_type(), query.options(), launch);
    return lse;
  }
  launch_forward(params, query.scalar_type(), launch);
  return lse;
}

// The delta, dQ and dK/dV kernels of `params`, whose problem, grad_out, lse and delta strides are set:
// the gradients into grad_query, grad_key and grad_value (4-D, as the kernels index them). The delta
// kernel computes `delta` (B', H_q, L'), contiguous, = rowsum(dO * O) - grad_lse from `out` and
// `grad_out` viewed as (B', H_q, L', D_v) and `grad_lse` (B', H_q, L'), fp32, or undefined.
template <typename Launch>
void launch_backward(BackwardParams& params, at::ScalarType dtype, const at::Tensor& out, const at::Tensor& grad_out,
                     const at::Tensor& grad_lse, const at::Tensor& delta, const at::Tensor& grad_query,
                     const at::Tensor& grad_key, const at::Tensor& grad_value, const Launch& launch) {
  const AttentionParams& p = params.attn;
  params.delta = delta.data_ptr<float>();
  params.grad_q = grad_query.data_ptr();
  copy_strides(grad_query, params.grad_q_stride);
  params.grad_k = grad_key.data_ptr();
  copy_strides(grad_key, params.grad_k_stride);
  params.grad_v = grad_value.data_ptr();
  copy_strides(grad_value, params.grad_v_stride);

  const int64_t rows = delta.numel();
  TORCH_CHECK(rows / kWarps < INT_MAX, "fused_attn cuda: too many query rows");
  dispatch_instance(dtype, std::max(p.dim_qk, p.dim_v), [&](auto type, auto head) {
    using T = typename decltype(type)::type;
    constexpr int HEAD = decltype(head)::value;
    if (rows > 0) {
      DeltaParams delta_params{};
      delta_params.out = out.data_ptr();
      copy_strides(out, delta_params.out_stride);
      delta_params.grad_out = grad_out.data_ptr();
      copy_strides(grad_out, delta_params.grad_out_stride);
      delta_params.grad_lse = nullptr;
      if (grad_lse.defined()) {
        delta_params.grad_lse = grad_lse.data_ptr<float>();
        copy_strides(grad_lse, delta_params.grad_lse_stride);
      }
      delta_params.delta = delta.data_ptr<float>();
      delta_params.batch = static_cast<int>(delta.size(0));
      delta_params.heads = static_cast<int>(delta.size(1));
      delta_params.len_q = static_cast<int>(delta.size(2));
      delta_params.dim_v = p.dim_v;
      launch(&flash_backward_delta_kernel<T>, one_warp_per_row(rows), delta_params);
      if (p.len_q > 0) launch(&flash_backward_dq_kernel<T, HEAD>, backward_dq_shape<T, HEAD>(p), params);
    }
    // Also without query rows: every key then gets a zero gradient.
    if (p.len_k > 0 && (grad_key.numel() > 0 || grad_value.numel() > 0)) {
      launch(&flash_backward_dkdv_kernel<T, HEAD>, backward_dkdv_shape<T, HEAD>(p), params);
    }
  });
}

// Gradients of query, key and value; `grad_lse` (may be absent) is the gradient flowing into the
// log-sum-exp, entering as delta = rowsum(dO * O) - grad_lse. With `grad_mask` (zeros of shape
// (B, H_q, L_q, L_k) and query's dtype), also the gradient of the additive attn_mask, dS, written
// where a key is visible. Deterministic.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, double dropout_p,
    const std::optional<at::Tensor>& dropout_rng, const std::optional<at::Tensor>& grad_mask,
    const VariantArgs& variant, const Launch& launch) {
  BackwardParams params{};
  params.attn = attention_params(query, key, value, attn_mask, key_padding_mask, is_causal, scale);
  set_dropout(params.attn, dropout_p, dropout_rng);
  set_variant(params.attn, variant);
  set_program(params.attn, "flash_backward", variant, query);
  const at::Tensor spans = set_key_spans(params.attn, key_padding_mask);
  const AttentionParams& p = params.attn;
  check_like_output(out, "out", query, p);
  check_like_output(grad_out, "grad_out", query, p);
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "fused_attn cuda: lse must be float32, got ",
              lse.scalar_type());
  TORCH_CHECK(lse.dim() == 3, "fused_attn cuda: lse must be (B, H_q, L_q), got ", lse.sizes());
  check_shape(lse, "lse", {p.batch, p.heads_q, p.len_q});
  at::Tensor grad_lse_f32;
  if (grad_lse.has_value()) {
    TORCH_CHECK(at::isFloatingType(grad_lse->scalar_type()),
                "fused_attn cuda: grad_lse must be floating point, got ", grad_lse->scalar_type());
    TORCH_CHECK(grad_lse->dim() == 3, "fused_attn cuda: grad_lse must be (B, H_q, L_q)");
    check_shape(*grad_lse, "grad_lse", {p.batch, p.heads_q, p.len_q});
    grad_lse_f32 = grad_lse->to(at::kFloat);
  }

  params.grad_mask = nullptr;
  if (grad_mask.has_value() && grad_mask->defined()) {
    TORCH_CHECK(p.mask_kind == kAdditiveMask,
                "fused_attn cuda: grad_mask is computed only for an additive (floating) attn_mask");
    TORCH_CHECK(grad_mask->dim() == 4, "fused_attn cuda: grad_mask must be 4-D, got shape ",
                grad_mask->sizes());
    check_shape(*grad_mask, "grad_mask", {p.batch, p.heads_q, p.len_q, p.len_k});
    TORCH_CHECK(grad_mask->scalar_type() == query.scalar_type(),
                "fused_attn cuda: grad_mask must have query's dtype ", query.scalar_type(), ", got ",
                grad_mask->scalar_type());
    fused_attn::check_output_memory("flash_backward", "grad_mask", *grad_mask,
                                    {{"query", &query}, {"key", &key}, {"value", &value},
                                     {"attn_mask", &*attn_mask}, {"grad_out", &grad_out}});
    params.grad_mask = grad_mask->data_ptr();
    copy_strides(*grad_mask, params.grad_mask_stride);
  }

  at::Tensor grad_query = at::empty_like(query);
  at::Tensor grad_key = at::empty_like(key);
  at::Tensor grad_value = at::empty_like(value);
  at::Tensor delta = at::empty({p.batch, p.heads_q, p.len_q}, query.options().dtype(at::kFloat));
  params.grad_out = grad_out.data_ptr();
  copy_strides(grad_out, params.grad_out_stride);
  params.lse = lse.data_ptr<float>();
  copy_strides(lse, params.lse_stride);
  copy_strides(delta, params.delta_stride);
  launch_backward(params, query.scalar_type(), out, grad_out, grad_lse_f32, delta, grad_query, grad_key, grad_value,
                  launch);
  return {grad_query, grad_key, grad_value};
}

// ---- packed batches (attention_varlen) -----------------------------------------------------------

// A packed (total, H, ...) tensor as the (B, H, total, ...) view the kernels read, batch stride 0:
// each block finds its sequence's tokens through the bounds (AttentionParams::cu_seqlens_q/k).
inline at::Tensor batched(const at::Tensor& packed, int64_t batch) {
  const at::Tensor heads_first = packed.transpose(0, 1).unsqueeze(0);
  std::vector<int64_t> sizes(heads_first.sizes().begin(), heads_first.sizes().end());
  sizes[0] = batch;
  return heads_first.expand(sizes);
}

// The bounds of a packed batch as the kernels read them, and the longest sequences the grids are made
// for.
struct PackedBatch {
  at::Tensor cu_seqlens_q, cu_seqlens_k;  // int32, contiguous: kept until the kernels are launched
  int64_t batch, max_seqlen_q, max_seqlen_k;
};

// The longest sequence: `given`, or, -1, read from the lengths (a host synchronisation on a GPU).
inline int64_t longest(const at::Tensor& cu_seqlens, int64_t given, const char* name) {
  TORCH_CHECK(given >= -1, "fused_attn cuda: ", name, " must be -1 (not given) or >= 0, got ", given);
  if (given >= 0) return given;
  if (cu_seqlens.numel() < 2) return 0;
  return std::max<int64_t>(0, (cu_seqlens.slice(0, 1) - cu_seqlens.slice(0, 0, -1)).max().item<int64_t>());
}

// Checks the packed tensors and the bounds (their values are checked on the device by
// fused_attn/varlen.py; the kernels clamp them to the tensors whatever they are).
inline PackedBatch packed_batch(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                int64_t max_seqlen_k) {
  for (const auto& [t, name] : {std::pair{&query, "query"}, {&key, "key"}, {&value, "value"}})
    TORCH_CHECK(t->dim() == 3, "fused_attn cuda: ", name, " must be 3-D (total_tokens, H, D), got shape ",
                t->sizes());
  for (const auto& [t, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"}}) {
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, "fused_attn cuda: ", name,
                " must be int32 or int64, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 1 && t->size(0) >= 1, "fused_attn cuda: ", name, " must be (B + 1,), got shape ",
                t->sizes());
  }
  TORCH_CHECK(cu_seqlens_k.sizes() == cu_seqlens_q.sizes(), "fused_attn cuda: cu_seqlens_k must have the shape ",
              cu_seqlens_q.sizes(), " of cu_seqlens_q, got ", cu_seqlens_k.sizes());
  PackedBatch packed;
  packed.batch = cu_seqlens_q.size(0) - 1;
  packed.cu_seqlens_q = cu_seqlens_q.to(at::kInt).contiguous();
  packed.cu_seqlens_k = cu_seqlens_k.to(at::kInt).contiguous();
  // No sequence is longer than the packed tokens, whatever bound is given.
  packed.max_seqlen_q = std::min(longest(cu_seqlens_q, max_seqlen_q, "max_seqlen_q"), query.size(0));
  packed.max_seqlen_k = std::min(longest(cu_seqlens_k, max_seqlen_k, "max_seqlen_k"), key.size(0));
  return packed;
}

// The kernel parameters of a packed batch: the problem of the (B, H, total, D) views, whose lengths
// are then the longest sequences'; each block makes it its sequence's (enter_sequence).
inline AttentionParams packed_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                     const PackedBatch& packed, bool is_causal, double scale) {
  AttentionParams p = attention_params(batched(query, packed.batch), batched(key, packed.batch),
                                       batched(value, packed.batch), std::nullopt, std::nullopt, is_causal, scale);
  p.cu_seqlens_q = packed.cu_seqlens_q.data_ptr<int>();
  p.cu_seqlens_k = packed.cu_seqlens_k.data_ptr<int>();
  p.total_q = p.len_q;
  p.total_k = p.len_k;
  // The band's unbounded side, set from the totals, is beyond every sequence as well.
  p.len_q = static_cast<int>(packed.max_seqlen_q);
  p.len_k = static_cast<int>(packed.max_seqlen_k);
  return p;
}

inline void check_packed(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == static_cast<int64_t>(shape.size()), "fused_attn cuda: ", name, " must be ",
              shape.size(), "-D, got shape ", t.sizes());
  check_shape(t, name, shape);
  TORCH_CHECK(t.scalar_type() == dtype, "fused_attn cuda: ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// The problem of a packed batch into `params.attn` (and its dropout and score variant), with `out`
// (total_q, H_q, D_v) and `lse` (H_q, total_q), fp32, checked; returns the batch's bounds. A mask program
// is refused: its tiles would have to follow each sequence's own lengths, which the kernels do not do yet.
template <typename Params>
PackedBatch set_packed_problem(const char* op, Params& params, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
                               const at::Tensor& out, const at::Tensor& lse, double dropout_p,
                               const std::optional<at::Tensor>& dropout_rng, const VariantArgs& variant) {
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(!given(variant.block_tiles) && !given(variant.block_bits), op,
              ": block_tiles: a mask program is not taken with a packed batch (attention_varlen) yet");
  PackedBatch packed = packed_batch(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  params.attn = packed_params(query, key, value, packed, is_causal, scale);
  set_dropout(params.attn, dropout_p, dropout_rng);
  set_variant(params.attn, variant);
  const AttentionParams& p = params.attn;
  check_packed(out, "out", {p.total_q, p.heads_q, p.dim_v}, query.scalar_type());
  check_packed(lse, "lse", {p.heads_q, p.total_q}, at::kFloat);
  return packed;
}

// lse (H_q, total_q) as the kernels index it: (B, H_q, L) with the batch stride 0, the rows from each
// sequence's first token.
inline void set_packed_rows(int64_t (&stride)[3], const at::Tensor& rows) {
  stride[0] = 0;
  stride[1] = rows.stride(0);
  stride[2] = rows.stride(1);
}

// A packed batch (fused_attn/varlen.py): query (total_q, H_q, D_qk), key (total_k, H_kv, D_qk), value
// (total_k, H_kv, D_v); sequence b is tokens cu_seqlens[b] .. cu_seqlens[b + 1] (int32 or int64,
// (B + 1,)); max_seqlen_* the longest sequences or -1. Writes `out` (total_q, H_q, D_v) and `lse`
// (H_q, total_q), fp32. Every kernel reads its sequence's bounds itself: one launch, no host
// synchronisation when the longest lengths are given.
template <typename Launch>
void flash_forward_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                          int64_t max_seqlen_k, bool is_causal, double scale, const at::Tensor& out,
                          const at::Tensor& lse, double dropout_p, const std::optional<at::Tensor>& dropout_rng,
                          const VariantArgs& variant, const Launch& launch) {
  ForwardParams params{};
  const PackedBatch packed =
      set_packed_problem("flash_forward_varlen", params, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, is_causal, scale, out, lse, dropout_p, dropout_rng, variant);
  const AttentionParams& p = params.attn;
  for (const auto& [t, name] : {std::pair{&out, "out"}, {&lse, "lse"}})
    fused_attn::check_output_memory("flash_forward_varlen", name, *t,
                                    {{"query", &query}, {"key", &key}, {"value", &value}});
  fused_attn::check_output_memory("flash_forward_varlen", "lse", lse, {{"out", &out}});
  if (packed.batch == 0 || p.len_q == 0) return;
  params.out = out.data_ptr();
  copy_strides(batched(out, packed.batch), params.out_stride);
  params.lse = lse.data_ptr<float>();
  set_packed_rows(params.lse_stride, lse);
  launch_forward(params, query.scalar_type(), launch);
}

// The gradients of query, key and value of a packed batch, each as `at::empty_like` of its input;
// `grad_lse` (H_q, total_q) or absent. Deterministic.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward_varlen(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_lse, double dropout_p, const std::optional<at::Tensor>& dropout_rng,
    const VariantArgs& variant, const Launch& launch) {
  BackwardParams params{};
  const PackedBatch packed =
      set_packed_problem("flash_backward_varlen", params, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, is_causal, scale, out, lse, dropout_p, dropout_rng, variant);
  const AttentionParams& p = params.attn;
  check_packed(grad_out, "grad_out", {p.total_q, p.heads_q, p.dim_v}, query.scalar_type());
  at::Tensor grad_lse_f32;
  if (grad_lse.has_value()) {
    TORCH_CHECK(at::isFloatingType(grad_lse->scalar_type()),
                "fused_attn cuda: grad_lse must be floating point, got ", grad_lse->scalar_type());
    check_packed(*grad_lse, "grad_lse", {p.heads_q, p.total_q}, grad_lse->scalar_type());
    grad_lse_f32 = grad_lse->to(at::kFloat).unsqueeze(0);
  }
  at::Tensor grad_query = at::empty_like(query);
  at::Tensor grad_key = at::empty_like(key);
  at::Tensor grad_value = at::empty_like(value);
  if (packed.batch == 0) return {grad_query, grad_key, grad_value};  // then every total is 0
  at::Tensor delta = at::empty({p.heads_q, p.total_q}, query.options().dtype(at::kFloat));
  params.grad_out = grad_out.data_ptr();
  copy_strides(batched(grad_out, packed.batch), params.grad_out_stride);
  params.lse = lse.data_ptr<float>();
  set_packed_rows(params.lse_stride, lse);
  set_packed_rows(params.delta_stride, delta);
  // The delta kernel sees the packed rows as one batch row of total_q queries.
  launch_backward(params, query.scalar_type(), batched(out, 1), batched(grad_out, 1), grad_lse_f32,
                  delta.unsqueeze(0), batched(grad_query, packed.batch), batched(grad_key, packed.batch),
                  batched(grad_value, packed.batch), launch);
  return {grad_query, grad_key, grad_value};
}

}  // namespace fused_attn_cuda
