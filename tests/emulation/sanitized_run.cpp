// Test-only: runs every kernel of csrc/cuda through the emulation without torch, so that the host
// compiler's sanitizers can watch the kernels' memory accesses. Built by tests/emulation/build.py
// with -fsanitize=thread (a shared-memory race, i.e. a missing __syncthreads, is reported: the
// barriers are mutexes and condition variables, which ThreadSanitizer understands) and with
// -fsanitize=address,undefined (reads or writes outside the tensors, undefined behaviour).
//
// Exit status 0 when every output is written and finite; the sanitizers report on stderr.
// One OS thread per CUDA thread: ThreadSanitizer sees the races between threads, not between fibers.
#define CUDA_EMULATION_OS_THREADS 1
#include "cuda_emulation.h"  // first: it defines the CUDA names the kernel header uses

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <utility>
#include <random>
#include <vector>

#include "emulated_launch.h"

namespace {

using namespace fused_attn_cuda;

template <typename T>
std::vector<T> random_values(std::size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<T> values(count);
  for (auto& value : values) value = Element<T>::store(normal(rng));
  return values;
}

template <typename T>
std::vector<T> nan_values(std::size_t count) {
  return std::vector<T>(count, Element<T>::store(NAN));
}

// Contiguous (B, H, L, D) strides.
void contiguous(int64_t (&stride)[4], int heads, int length, int dim) {
  stride[3] = 1;
  stride[2] = dim;
  stride[1] = static_cast<int64_t>(length) * dim;
  stride[0] = stride[1] * heads;
}

bool none_nan(const std::vector<float>& values) {
  for (float value : values)
    if (std::isnan(value)) return false;
  return true;
}

template <typename T>
bool all_finite(const std::vector<T>& values) {
  for (const auto& value : values)
    if (!std::isfinite(Element<T>::load(value))) return false;
  return true;
}

// The inputs of one problem: GQA, L_q != L_k, causal, key padding and a broadcast mask: bool with
// some rows fully hidden, or, for `training`, an additive one whose gradient is computed, with
// dropout and every score variant, sinks included (a finite sink on even heads, -inf on odd ones).
template <typename T>
struct Problem {
  std::vector<T> q, k, v, grad_out, bias;
  std::vector<uint8_t> mask, padding;
  std::vector<float> slopes, sinks;
  int64_t dropout_rng[2] = {0x123456789abcdefLL, 7};
  AttentionParams attn{};

  Problem(int batch, int heads_q, int heads_kv, int len_q, int len_k, int dim_qk, int dim_v, bool training) {
    std::mt19937 rng(1234);
    const std::size_t q_size = static_cast<std::size_t>(batch) * heads_q * len_q;
    const std::size_t k_size = static_cast<std::size_t>(batch) * heads_kv * len_k;
    q = random_values<T>(q_size * dim_qk, rng);
    grad_out = random_values<T>(q_size * dim_v, rng);
    k = random_values<T>(k_size * dim_qk, rng);
    v = random_values<T>(k_size * dim_v, rng);
    mask.resize(static_cast<std::size_t>(len_q) * len_k);
    padding.resize(static_cast<std::size_t>(batch) * len_k);
    for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = rng() % 4 != 0 && i / len_k != 3;
    for (std::size_t i = 0; i < padding.size(); ++i) padding[i] = rng() % 5 == 0;
    bias = random_values<T>(mask.size(), rng);
    slopes.assign(static_cast<std::size_t>(batch) * heads_q, 0.25f);
    for (int h = 0; h < heads_q; ++h) sinks.push_back(h % 2 ? -INFINITY : 1.0f - 0.5f * h);

    attn.q = q.data();
    attn.k = k.data();
    attn.v = v.data();
    contiguous(attn.q_stride, heads_q, len_q, dim_qk);
    contiguous(attn.k_stride, heads_kv, len_k, dim_qk);
    contiguous(attn.v_stride, heads_kv, len_k, dim_v);
    attn.mask = training ? static_cast<const void*>(bias.data()) : mask.data();
    attn.mask_kind = training ? kAdditiveMask : kBoolMask;
    const int64_t mask_stride[4] = {0, 0, len_k, 1};  // (L_q, L_k) broadcast over batch and heads
    std::copy(mask_stride, mask_stride + 4, attn.mask_stride);
    attn.key_padding = padding.data();
    attn.key_padding_stride[0] = len_k;
    attn.key_padding_stride[1] = 1;
    attn.batch = batch;
    attn.heads_q = heads_q;
    attn.heads_kv = heads_kv;
    attn.group = heads_q / heads_kv;
    attn.len_q = len_q;
    attn.len_k = len_k;
    attn.dim_qk = dim_qk;
    attn.dim_v = dim_v;
    attn.scale = 0.2f;
    // Causal; for `training` also a window aligned bottom-right, a softcap and ALiBi.
    attn.banded = true;
    attn.bottom_right = training;
    attn.diagonal = training ? len_k - len_q : 0;
    attn.window_left = training ? 20 : len_q + len_k;
    attn.window_right = 0;
    attn.softcap = training ? 3.0f : 0.0f;
    attn.alibi = training ? slopes.data() : nullptr;
    attn.alibi_stride[0] = heads_q;
    attn.alibi_stride[1] = 1;
    attn.sinks = training ? sinks.data() : nullptr;
    attn.dropout_rng = training ? dropout_rng : nullptr;
    attn.drop_threshold = training ? fused_attn::dropout_threshold(0.25) : 0;
    attn.keep_scale = training ? 1.0f / 0.75f : 1.0f;
  }

  // A mask program (csrc/block_mask.h) over the problem, contiguous: each tile EMPTY, FULL or partial (random
  // bits) at random, so that the kernels skip blocks, read them whole and test bits, per head.
  std::vector<int32_t> program_tiles;
  std::vector<uint32_t> program_bits;

  void set_program() {
    std::mt19937 rng(99);
    const int q_tiles = static_cast<int>((attn.len_q + fused_attn::kTile - 1) / fused_attn::kTile);
    const int k_tiles = static_cast<int>((attn.len_k + fused_attn::kTile - 1) / fused_attn::kTile);
    int32_t partial = 0;
    for (int t = 0; t < attn.batch * attn.heads_q * q_tiles * k_tiles; ++t) {
      const unsigned kind = rng() % 3;
      program_tiles.push_back(kind == 0 ? fused_attn::kTileEmpty : kind == 1 ? fused_attn::kTileFull : partial++);
    }
    program_bits.resize(static_cast<std::size_t>(partial) * fused_attn::kTile * fused_attn::kWords);
    for (auto& word : program_bits) word = rng();
    attn.program.tiles = program_tiles.data();
    attn.program.bits = program_bits.data();
    const int64_t strides[4] = {static_cast<int64_t>(attn.heads_q) * q_tiles * k_tiles,
                                static_cast<int64_t>(q_tiles) * k_tiles, k_tiles, 1};
    std::copy(strides, strides + 4, attn.program.s);
  }

  std::size_t q_rows() const { return static_cast<std::size_t>(attn.batch) * attn.heads_q * attn.len_q; }
  std::size_t k_rows() const { return static_cast<std::size_t>(attn.batch) * attn.heads_kv * attn.len_k; }
};

// Exit status of a run: 1 (and a message) for each output with NaN or infinite elements.
int report(const char* name, std::initializer_list<std::pair<const char*, bool>> outputs_finite) {
  int failures = 0;
  for (const auto& [what, ok] : outputs_finite) {
    if (!ok) {
      std::fprintf(stderr, "%s: %s has unwritten or non-finite elements\n", name, what);
      ++failures;
    }
  }
  std::printf("%s: %s\n", name, failures ? "FAILED" : "ok");
  return failures;
}

// (B, H, L) rows of lse or delta, contiguous.
void contiguous_rows(int64_t (&stride)[3], int heads, int length) {
  stride[2] = 1;
  stride[1] = length;
  stride[0] = static_cast<int64_t>(heads) * length;
}

// A packed batch (attention_varlen): the sequences' lengths, split from the tokens of a one-row Problem.
struct Packing {
  std::vector<int> cu_seqlens_q, cu_seqlens_k;  // (B + 1,)
};

int longest(const std::vector<int>& cu_seqlens) {
  int longest = 0;
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) longest = std::max(longest, cu_seqlens[b + 1] - cu_seqlens[b]);
  return longest;
}

// Forward and backward of one problem (Problem). With `packing`, the problem's one batch row holds
// the packed tokens of its sequences: (1, H, total, D) tensors read as (B, H, total, D) views of
// batch stride 0, no masks (as flash_dispatch.h's packed_params sets them up); with `program`, a mask
// program (Problem::set_program). Returns the number of outputs with NaN or infinite elements (lse: NaN).
template <typename T, int HEAD>
int run(const char* name, int batch, int heads_q, int heads_kv, int len_q, int len_k, int dim_qk,
        int dim_v, bool training = false, const Packing* packing = nullptr, bool program = false) {
  Problem<T> problem(batch, heads_q, heads_kv, len_q, len_k, dim_qk, dim_v, training);
  if (program) problem.set_program();
  const std::size_t q_size = problem.q_rows(), k_size = problem.k_rows();
  auto out = nan_values<T>(q_size * dim_v), grad_q = nan_values<T>(q_size * dim_qk);
  auto grad_k = nan_values<T>(k_size * dim_qk), grad_v = nan_values<T>(k_size * dim_v);
  std::vector<float> lse(q_size, NAN), delta(q_size, NAN);
  std::vector<T> grad_mask(q_size * len_k, Element<T>::store(0.0f));

  ForwardParams forward{};
  forward.out = out.data();
  contiguous(forward.out_stride, heads_q, len_q, dim_v);
  forward.lse = lse.data();
  contiguous_rows(forward.lse_stride, heads_q, len_q);
  BackwardParams backward{};
  backward.grad_out = problem.grad_out.data();
  contiguous(backward.grad_out_stride, heads_q, len_q, dim_v);
  backward.lse = lse.data();
  contiguous_rows(backward.lse_stride, heads_q, len_q);
  backward.delta = delta.data();
  contiguous_rows(backward.delta_stride, heads_q, len_q);
  backward.grad_q = grad_q.data();
  contiguous(backward.grad_q_stride, heads_q, len_q, dim_qk);
  backward.grad_k = grad_k.data();
  contiguous(backward.grad_k_stride, heads_kv, len_k, dim_qk);
  backward.grad_v = grad_v.data();
  contiguous(backward.grad_v_stride, heads_kv, len_k, dim_v);
  backward.grad_mask = training && packing == nullptr ? grad_mask.data() : nullptr;
  contiguous(backward.grad_mask_stride, heads_q, len_q, len_k);

  AttentionParams& attn = problem.attn;
  if (packing != nullptr) {
    for (int64_t* stride : {attn.q_stride, attn.k_stride, attn.v_stride, forward.out_stride, backward.grad_out_stride,
                            backward.grad_q_stride, backward.grad_k_stride, backward.grad_v_stride})
      stride[0] = 0;
    for (int64_t* stride : {forward.lse_stride, backward.lse_stride, backward.delta_stride}) stride[0] = 0;
    attn.mask = nullptr;
    attn.mask_kind = kNoMask;
    attn.key_padding = nullptr;
    attn.alibi_stride[0] = 0;  // one row of slopes for every sequence
    attn.cu_seqlens_q = packing->cu_seqlens_q.data();
    attn.cu_seqlens_k = packing->cu_seqlens_k.data();
    attn.batch = static_cast<int>(packing->cu_seqlens_q.size()) - 1;
    attn.total_q = len_q;
    attn.total_k = len_k;
    attn.len_q = longest(packing->cu_seqlens_q);
    attn.len_k = longest(packing->cu_seqlens_k);
  }
  forward.attn = attn;
  backward.attn = attn;
  // Launched at the shapes the torch glue (flash_dispatch.h) computes.
  const EmulatedLaunch launch;
  launch(&flash_forward_kernel<T, HEAD>, forward_shape<T, HEAD>(attn), forward);

  // The delta kernel reads the rows of the one batch row as they lie, packed or not.
  DeltaParams delta_params{};
  delta_params.out = out.data();
  contiguous(delta_params.out_stride, heads_q, len_q, dim_v);
  delta_params.grad_out = problem.grad_out.data();
  contiguous(delta_params.grad_out_stride, heads_q, len_q, dim_v);
  delta_params.grad_lse = nullptr;
  delta_params.delta = delta.data();
  delta_params.batch = batch;
  delta_params.heads = heads_q;
  delta_params.len_q = len_q;
  delta_params.dim_v = dim_v;
  launch(&flash_backward_delta_kernel<T>, one_warp_per_row(static_cast<int64_t>(q_size)), delta_params);

  launch(&flash_backward_dq_kernel<T, HEAD>, backward_dq_shape<T, HEAD>(attn), backward);
  launch(&flash_backward_dkdv_kernel<T, HEAD>, backward_dkdv_shape<T, HEAD>(attn), backward);

  return report(name, {{"out", all_finite(out)}, {"lse", none_nan(lse)}, {"grad_query", all_finite(grad_q)},
                       {"grad_key", all_finite(grad_k)}, {"grad_value", all_finite(grad_v)},
                       {"grad_mask", all_finite(grad_mask)}});
}

// The split-KV decode and combine kernels on a problem of few query rows (Problem without dropout),
// the keys in `splits` splits of whole key blocks, as flash_decode (flash_dispatch.h) launches them;
// with `sinks`, Problem's sinks folded in by the combine kernel; with `program`, a mask program.
template <typename T, int HEAD, int BM>
int run_decode(const char* name, int batch, int heads_q, int heads_kv, int len_q, int len_k, int dim, int splits,
               bool sinks = false, bool program = false) {
  Problem<T> problem(batch, heads_q, heads_kv, len_q, len_k, dim, dim, false);
  problem.attn.sinks = sinks ? problem.sinks.data() : nullptr;
  if (program) problem.set_program();
  problem.attn.bottom_right = true;  // causal bottom-right: the queries see most keys
  problem.attn.diagonal = len_k - len_q;
  const AttentionParams& attn = problem.attn;
  const int rows = attn.group * len_q;
  auto out = nan_values<T>(problem.q_rows() * dim);
  std::vector<float> lse(problem.q_rows(), NAN);
  std::vector<float> part_out(static_cast<std::size_t>(batch) * heads_kv * splits * rows * dim, NAN);
  std::vector<float> part_lse(static_cast<std::size_t>(batch) * heads_kv * splits * rows, NAN);

  DecodeParams decode{};
  decode.attn = attn;
  decode.part_out = part_out.data();
  decode.part_lse = part_lse.data();
  decode.splits = splits;
  decode.keys_per_split = decode_keys_per_split(len_k, splits, DecodeConfig<T, HEAD, BM>::block_n);
  const EmulatedLaunch launch;
  launch(&flash_decode_kernel<T, HEAD, BM>, decode_shape<T, HEAD, BM>(attn, splits), decode);

  CombineParams combine{};
  combine.part_out = part_out.data();
  combine.part_lse = part_lse.data();
  combine.out = out.data();
  contiguous(combine.out_stride, heads_q, len_q, dim);
  combine.lse = lse.data();
  combine.sinks = attn.sinks;
  combine.batch = batch;
  combine.heads_q = heads_q;
  combine.heads_kv = heads_kv;
  combine.group = attn.group;
  combine.len_q = len_q;
  combine.dim_v = dim;
  combine.splits = splits;
  launch(&flash_decode_combine_kernel<T>, one_warp_per_row(static_cast<int64_t>(problem.q_rows())), combine);
  return report(name, {{"out", all_finite(out)}, {"lse", none_nan(lse)}});
}

}  // namespace

int main() {
  int failures = 0;
  // Head dims padded inside their instance; several query and key blocks; a GQA group of 2.
  failures += run<__half, 64>("float16, head 64", 1, 2, 1, 70, 90, 40, 48);
  failures += run<__nv_bfloat16, 32>("bfloat16, head 32", 2, 2, 2, 80, 45, 32, 24);
  failures += run<float, 128>("float32, head 128", 1, 2, 1, 40, 50, 72, 100);
  // Dropout, the gradient of an additive mask and sinks.
  failures += run<__half, 32>("float16, head 32, training", 1, 2, 1, 40, 52, 24, 32, true);
  // A packed batch: sequences of 21, 0, 40 and 9 queries and 30, 13, 0 and 9 keys (one without queries,
  // one without keys), with dropout and the score variants (sinks too), bottom-right per sequence.
  const Packing packing{{0, 21, 21, 61, 70}, {0, 30, 43, 43, 52}};
  failures += run<__half, 32>("float16, head 32, packed batch", 1, 2, 1, 70, 52, 24, 32, true, &packing);
  // Split-KV decode: a GQA group of 2 x 3 rows and 4 x 5 rows (row 3 hidden by the mask), keys in three
  // splits; sinks in the second.
  failures += run_decode<__nv_bfloat16, 64, 16>("bfloat16, head 64, decode", 2, 2, 1, 3, 150, 40, 3);
  failures += run_decode<float, 32, 64>("float32, head 32, decode, sinks", 1, 4, 1, 5, 90, 32, 3, true);
  // Mask programs over 2 x 3 and 1 x 3 tiles (of 128), with dropout, the mask gradient and the score
  // variants; in the decode kernels, per head of a GQA group of 4.
  failures += run<__nv_bfloat16, 32>("bfloat16, head 32, mask program", 1, 2, 1, 150, 260, 32, 16, true, nullptr, true);
  failures += run_decode<__half, 32, 16>("float16, head 32, decode, mask program", 1, 4, 1, 3, 300, 32, 2, true, true);
  return failures == 0 ? 0 : 1;
}
