// Test-only host driver: the `cuda` backend's kernels (csrc/cuda/flash_kernels.cuh) and host glue
// (csrc/cuda/flash_dispatch.h), unchanged, run on CPU tensors through the emulation of the CUDA
// execution model in cuda_emulation.h. Built at test time by tests/emulation/build.py.
#include "cuda_emulation.h"  // first: it defines the CUDA names the kernel header uses

#include <torch/extension.h>

#include "emulated_launch.h"
#include "flash_dispatch.h"

namespace {

void check_cpu(const std::optional<at::Tensor>& t, const char* name) {
  TORCH_CHECK(!t.has_value() || t->device().is_cpu(), "emulated cuda: ", name,
              " must be a CPU tensor, got ", t->device());
}

at::Tensor forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask,
                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale,
                   const at::Tensor& out, double dropout_p, const std::optional<at::Tensor>& dropout_rng,
                   int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
                   const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
                   const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits,
                   const std::optional<at::Tensor>& sinks) {
  for (const auto& [t, name] : {std::pair{std::optional<at::Tensor>(query), "query"},
                                {key, "key"}, {value, "value"}, {attn_mask, "attn_mask"},
                                {key_padding_mask, "key_padding_mask"}, {out, "out"},
                                {dropout_rng, "dropout_rng"}, {alibi_slopes, "alibi_slopes"},
                                {block_tiles, "block_tiles"}, {block_bits, "block_bits"}, {sinks, "sinks"}})
    check_cpu(t, name);
  // The emulated threads never touch Python: let other Python threads run meanwhile.
  pybind11::gil_scoped_release release;
  return fused_attn_cuda::flash_forward(
      query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout_p, dropout_rng,
      {window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles, block_bits, sinks},
      EmulatedLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, double dropout_p,
    const std::optional<at::Tensor>& dropout_rng, const std::optional<at::Tensor>& grad_mask,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
    const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits) {
  for (const auto& [t, name] :
       {std::pair{std::optional<at::Tensor>(query), "query"}, {key, "key"}, {value, "value"},
        {attn_mask, "attn_mask"}, {key_padding_mask, "key_padding_mask"}, {out, "out"},
        {lse, "lse"}, {grad_out, "grad_out"}, {grad_lse, "grad_lse"}, {dropout_rng, "dropout_rng"},
        {grad_mask, "grad_mask"}, {alibi_slopes, "alibi_slopes"}, {block_tiles, "block_tiles"},
        {block_bits, "block_bits"}})
    check_cpu(t, name);
  pybind11::gil_scoped_release release;
  return fused_attn_cuda::flash_backward(query, key, value, attn_mask, key_padding_mask, is_causal,
                                         scale, out, lse, grad_out, grad_lse, dropout_p, dropout_rng, grad_mask,
                                         {window_left, window_right, bottom_right, softcap, alibi_slopes,
                                          diagonal_shift, block_tiles, block_bits},
                                         EmulatedLaunch{});
}

void forward_varlen(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                    int64_t max_seqlen_k, bool is_causal, double scale, const at::Tensor& out, const at::Tensor& lse,
                    double dropout_p, const std::optional<at::Tensor>& dropout_rng, int64_t window_left,
                    int64_t window_right, bool bottom_right, double softcap,
                    const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
                    const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits,
                    const std::optional<at::Tensor>& sinks) {
  for (const auto& [t, name] : {std::pair{std::optional<at::Tensor>(query), "query"}, {key, "key"}, {value, "value"},
                                {cu_seqlens_q, "cu_seqlens_q"}, {cu_seqlens_k, "cu_seqlens_k"}, {out, "out"},
                                {lse, "lse"}, {dropout_rng, "dropout_rng"}, {alibi_slopes, "alibi_slopes"},
                                {block_tiles, "block_tiles"}, {block_bits, "block_bits"}, {sinks, "sinks"}})
    check_cpu(t, name);
  pybind11::gil_scoped_release release;
  fused_attn_cuda::flash_forward_varlen(
      query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, out, lse,
      dropout_p, dropout_rng,
      {window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles, block_bits, sinks},
      EmulatedLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_varlen(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_lse, double dropout_p, const std::optional<at::Tensor>& dropout_rng,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
    const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits) {
  for (const auto& [t, name] :
       {std::pair{std::optional<at::Tensor>(query), "query"}, {key, "key"}, {value, "value"},
        {cu_seqlens_q, "cu_seqlens_q"}, {cu_seqlens_k, "cu_seqlens_k"}, {out, "out"}, {lse, "lse"},
        {grad_out, "grad_out"}, {grad_lse, "grad_lse"}, {dropout_rng, "dropout_rng"}, {alibi_slopes, "alibi_slopes"},
        {block_tiles, "block_tiles"}, {block_bits, "block_bits"}})
    check_cpu(t, name);
  pybind11::gil_scoped_release release;
  return fused_attn_cuda::flash_backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, is_causal, scale, out, lse, grad_out, grad_lse,
                                                dropout_p, dropout_rng,
                                                {window_left, window_right, bottom_right, softcap, alibi_slopes,
                                                 diagonal_shift, block_tiles, block_bits},
                                                EmulatedLaunch{});
}

// The split count the forward's decode kernels take for this problem (splits of the emulation's SM
// count, or FUSED_ATTN_CUDA_DECODE_SPLITS), or 0 when the long-query kernel runs it.
int64_t decode_splits(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double dropout_p,
                      const std::optional<at::Tensor>& dropout_rng) {
  auto p = fused_attn_cuda::attention_params(query, key, value, std::nullopt, std::nullopt, false, 1.0);
  fused_attn_cuda::set_dropout(p, dropout_p, dropout_rng);
  if (!fused_attn_cuda::takes_decode(p)) return 0;
  return fused_attn_cuda::decode_split_count(p, EmulatedLaunch{}.multiprocessors());
}

// ---- probes of the emulation itself: the CUDA semantics the kernels rely on ---------------------

struct ProbeArgs {
  const void* a;
  const void* b;
  float* out;
  int lane_mask, width;
};

// One warp: C = A B through WMMA fragments, operands staged in shared memory as the kernels do.
template <bool A_COL, bool B_COL>
__global__ void wmma_probe(const ProbeArgs args) {
  namespace wmma = nvcuda::wmma;
  auto* tiles = reinterpret_cast<__half*>(dynamic_shared_memory());
  auto* result = reinterpret_cast<float*>(tiles + 512);
  for (int e = threadIdx.x; e < 256; e += 32) {
    tiles[e] = static_cast<const __half*>(args.a)[e];
    tiles[256 + e] = static_cast<const __half*>(args.b)[e];
  }
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half,
                 std::conditional_t<A_COL, wmma::col_major, wmma::row_major>> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half,
                 std::conditional_t<B_COL, wmma::col_major, wmma::row_major>> b;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
  wmma::fill_fragment(c, 0.0f);
  wmma::load_matrix_sync(a, tiles, 16);
  wmma::load_matrix_sync(b, tiles + 256, 16);
  wmma::mma_sync(c, a, b, c);
  wmma::store_matrix_sync(result, c, 16, wmma::mem_row_major);
  __syncwarp();
  for (int e = threadIdx.x; e < 256; e += 32) args.out[e] = result[e];
}

__global__ void misaligned_wmma_probe(const ProbeArgs) {
  namespace wmma = nvcuda::wmma;
  auto* tiles = reinterpret_cast<__half*>(dynamic_shared_memory());
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
  wmma::load_matrix_sync(a, tiles + 8, 16);  // 16 bytes off a 256-bit boundary
}

__global__ void shuffle_probe(const ProbeArgs args) {
  args.out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<const float*>(args.a)[threadIdx.x],
                                          args.lane_mask, args.width);
}

// Half of each warp shuffles while the other half waits at __syncthreads: a deadlock on a GPU.
__global__ void divergent_probe(const ProbeArgs) {
  if (threadIdx.x % 32 < 16) {
    (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
  } else {
    __syncthreads();
  }
}

__global__ void unwritten_shared_probe(const ProbeArgs args) {
  args.out[threadIdx.x] = reinterpret_cast<const float*>(dynamic_shared_memory())[threadIdx.x];
}

// Warp 0 writes shared memory that warp 1 reads, with no __syncthreads between: a race on a GPU. Each thread of
// warp 1 returns what it read (shared memory starts as NaN).
__global__ void missing_barrier_probe(const ProbeArgs args) {
  auto* shared = reinterpret_cast<float*>(dynamic_shared_memory());
  if (threadIdx.x < 32) shared[threadIdx.x] = 1.0f;
  if (threadIdx.x >= 32) args.out[threadIdx.x - 32] = shared[threadIdx.x - 32];
}

at::Tensor run_probe(void (*kernel)(ProbeArgs), unsigned threads, ProbeArgs args, at::Tensor out) {
  args.out = out.data_ptr<float>();
  pybind11::gil_scoped_release release;
  cuda_emulation::launch(kernel, {1, 1, 1}, {threads, 1, 1}, 4096, args);
  return out;
}

at::Tensor wmma_product(const at::Tensor& a, const at::Tensor& b, bool a_col, bool b_col) {
  TORCH_CHECK(a.scalar_type() == at::kHalf && b.scalar_type() == at::kHalf && a.numel() == 256 &&
              b.numel() == 256 && a.is_contiguous() && b.is_contiguous(),
              "wmma_product: two contiguous 16x16 float16 tensors");
  void (*kernel)(ProbeArgs) = a_col ? (b_col ? &wmma_probe<true, true> : &wmma_probe<true, false>)
                                    : (b_col ? &wmma_probe<false, true> : &wmma_probe<false, false>);
  return run_probe(kernel, 32, ProbeArgs{a.data_ptr(), b.data_ptr(), nullptr, 0, 32},
                   at::empty({16, 16}, a.options().dtype(at::kFloat)));
}

at::Tensor shuffle_xor(const at::Tensor& values, int64_t lane_mask, int64_t width) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.numel() == 64,
              "shuffle_xor: 64 contiguous float32 values, one per thread of two warps");
  return run_probe(&shuffle_probe, 64,
                   ProbeArgs{values.data_ptr(), nullptr, nullptr, static_cast<int>(lane_mask),
                             static_cast<int>(width)},
                   at::empty_like(values));
}

void misaligned_wmma() {
  run_probe(&misaligned_wmma_probe, 32, ProbeArgs{}, at::empty({1}));
}

void divergent_barrier(int64_t timeout_ms) {
  const auto saved = cuda_emulation::barrier_timeout;
  cuda_emulation::barrier_timeout = std::chrono::milliseconds(timeout_ms);
  try {
    run_probe(&divergent_probe, 64, ProbeArgs{}, at::empty({1}));
  } catch (...) {
    cuda_emulation::barrier_timeout = saved;
    throw;
  }
  cuda_emulation::barrier_timeout = saved;
}

at::Tensor missing_barrier() { return run_probe(&missing_barrier_probe, 64, ProbeArgs{}, at::empty({32})); }

at::Tensor unwritten_shared() { return run_probe(&unwritten_shared_probe, 32, ProbeArgs{}, at::empty({32})); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fused_attn cuda kernels run on CPU tensors through a host emulation (tests only)";
  m.def("forward", &forward, "flash_forward(query, key, value, attn_mask, key_padding_mask, "
        "is_causal, scale, out, dropout_p, dropout_rng, window_left, window_right, bottom_right, softcap, "
        "alibi_slopes, diagonal_shift, block_tiles, block_bits, sinks) -> lse", pybind11::arg("query"),
        pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("attn_mask"),
        pybind11::arg("key_padding_mask"), pybind11::arg("is_causal"), pybind11::arg("scale"),
        pybind11::arg("out"), pybind11::arg("dropout_p") = 0.0, pybind11::arg("dropout_rng") = pybind11::none(),
        pybind11::arg("window_left") = -1, pybind11::arg("window_right") = -1, pybind11::arg("bottom_right") = false,
        pybind11::arg("softcap") = 0.0, pybind11::arg("alibi_slopes") = pybind11::none(),
        pybind11::arg("diagonal_shift") = 0, pybind11::arg("block_tiles") = pybind11::none(),
        pybind11::arg("block_bits") = pybind11::none(), pybind11::arg("sinks") = pybind11::none());
  m.def("backward", &backward, "flash_backward(query, key, value, attn_mask, key_padding_mask, "
        "is_causal, scale, out, lse, grad_out, grad_lse, dropout_p, dropout_rng, grad_mask, window_left, "
        "window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles, block_bits) -> (dq, dk, dv)",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("attn_mask"),
        pybind11::arg("key_padding_mask"), pybind11::arg("is_causal"), pybind11::arg("scale"),
        pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("grad_out"), pybind11::arg("grad_lse"),
        pybind11::arg("dropout_p") = 0.0, pybind11::arg("dropout_rng") = pybind11::none(),
        pybind11::arg("grad_mask") = pybind11::none(), pybind11::arg("window_left") = -1,
        pybind11::arg("window_right") = -1, pybind11::arg("bottom_right") = false, pybind11::arg("softcap") = 0.0,
        pybind11::arg("alibi_slopes") = pybind11::none(), pybind11::arg("diagonal_shift") = 0,
        pybind11::arg("block_tiles") = pybind11::none(), pybind11::arg("block_bits") = pybind11::none());
  m.def("forward_varlen", &forward_varlen, "flash_forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, "
        "max_seqlen_q, max_seqlen_k, is_causal, scale, out, lse, dropout_p, dropout_rng, window_left, window_right, "
        "bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles=None, block_bits=None, sinks=None): writes "
        "out and lse",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("cu_seqlens_q"),
        pybind11::arg("cu_seqlens_k"), pybind11::arg("max_seqlen_q"), pybind11::arg("max_seqlen_k"),
        pybind11::arg("is_causal"), pybind11::arg("scale"), pybind11::arg("out"), pybind11::arg("lse"),
        pybind11::arg("dropout_p"), pybind11::arg("dropout_rng"), pybind11::arg("window_left"),
        pybind11::arg("window_right"), pybind11::arg("bottom_right"), pybind11::arg("softcap"),
        pybind11::arg("alibi_slopes"), pybind11::arg("diagonal_shift"),
        pybind11::arg("block_tiles") = pybind11::none(), pybind11::arg("block_bits") = pybind11::none(),
        pybind11::arg("sinks") = pybind11::none());
  m.def("backward_varlen", &backward_varlen, "flash_backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, "
        "max_seqlen_q, max_seqlen_k, is_causal, scale, out, lse, grad_out, grad_lse, dropout_p, dropout_rng, "
        "window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles, block_bits) "
        "-> (dq, dk, dv)");
  m.def("decode_splits", &decode_splits, "decode_splits(query, key, value, dropout_p, dropout_rng) -> the "
        "split count of the decode kernels, 0 if the forward runs the long-query kernel", pybind11::arg("query"),
        pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("dropout_p") = 0.0,
        pybind11::arg("dropout_rng") = pybind11::none());
  m.def("wmma_product", &wmma_product, "probe: A B of two 16x16 fp16 tiles through WMMA fragments");
  m.def("shuffle_xor", &shuffle_xor, "probe: __shfl_xor_sync over two warps");
  m.def("misaligned_wmma", &misaligned_wmma, "probe: a WMMA load off a 256-bit boundary (raises)");
  m.def("divergent_barrier", &divergent_barrier, "probe: a deadlocking divergent barrier (raises)");
  m.def("unwritten_shared", &unwritten_shared, "probe: what unwritten shared memory reads as");
  m.def("missing_barrier", &missing_barrier, "probe: what warp 1 reads of warp 0's write with no __syncthreads");
}
