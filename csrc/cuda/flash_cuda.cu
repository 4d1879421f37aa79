// The `cuda` backend's registration for the CUDA dispatch key: device checks, streams and launches.
// Argument checks, kernel parameters and instance choice are in flash_dispatch.h (shared with the
// CPU emulation of the tests); the kernels in flash_kernels.cuh.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "flash_dispatch.h"

namespace fused_attn_cuda {
namespace {

// Launches on the current stream of the query's device, after checking the device can run it.
struct CudaLaunch {
  cudaStream_t stream;
  int max_shared_bytes;
  int multiprocessor_count;

  int multiprocessors() const { return multiprocessor_count; }

  template <typename Params>
  void operator()(void (*kernel)(Params), const LaunchShape& shape, const Params& params) const {
    TORCH_CHECK(shape.shared_bytes <= static_cast<std::size_t>(max_shared_bytes),
                "fused_attn cuda: the kernel needs ", shape.shared_bytes,
                " bytes of shared memory per block, the device allows ", max_shared_bytes);
    if (shape.shared_bytes > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shape.shared_bytes)));
    }
    kernel<<<dim3(shape.grid[0], shape.grid[1], shape.grid[2]), dim3(shape.block),
             shape.shared_bytes, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

void check_device(const at::Tensor& query, const std::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->is_cuda(), "fused_attn cuda: ", name, " must be a CUDA tensor, got ", t->device());
  TORCH_CHECK(t->device() == query.device(), "fused_attn cuda: ", name, " must be on ",
              query.device(), " (as query), got ", t->device());
}

// The tensors forward and backward both take: query on a CUDA device, the others on the same one.
void check_attention_devices(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask,
                             const std::optional<at::Tensor>& key_padding_mask, const at::Tensor& out) {
  TORCH_CHECK(query.is_cuda(), "fused_attn cuda: query must be a CUDA tensor");
  check_device(query, key, "key");
  check_device(query, value, "value");
  check_device(query, attn_mask, "attn_mask");
  check_device(query, key_padding_mask, "key_padding_mask");
  check_device(query, out, "out");
}

CudaLaunch launcher_for(const at::Tensor& query) {
  const int device = query.get_device();
  int major = 0, max_shared_bytes = 0, multiprocessors = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_shared_bytes,
                                        cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  // bf16 WMMA fragments and the shared-memory budget need sm_80 or newer.
  TORCH_CHECK(major >= 8, "fused_attn cuda: needs compute capability 8.0 or newer, device ",
              device, " has ", major, ".x");
  return CudaLaunch{c10::cuda::getCurrentCUDAStream(device).stream(), max_shared_bytes, multiprocessors};
}

at::Tensor forward_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& attn_mask,
                        const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                        double scale, const at::Tensor& out, double dropout_p,
                        const std::optional<at::Tensor>& dropout_rng, int64_t window_left,
                        int64_t window_right, bool bottom_right, double softcap,
                        const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
                        const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits,
                        const std::optional<at::Tensor>& sinks) {
  check_attention_devices(query, key, value, attn_mask, key_padding_mask, out);
  check_device(query, dropout_rng, "dropout_rng");
  check_device(query, alibi_slopes, "alibi_slopes");
  check_device(query, sinks, "sinks");
  const c10::cuda::CUDAGuard guard(query.device());
  return flash_forward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, dropout_p,
                       dropout_rng,
                       {window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                        block_bits, sinks},
                       launcher_for(query));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, double dropout_p,
    const std::optional<at::Tensor>& dropout_rng, const std::optional<at::Tensor>& grad_mask,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift, const std::optional<at::Tensor>& block_tiles,
    const std::optional<at::Tensor>& block_bits) {
  check_attention_devices(query, key, value, attn_mask, key_padding_mask, out);
  check_device(query, lse, "lse");
  check_device(query, grad_out, "grad_out");
  check_device(query, grad_lse, "grad_lse");
  check_device(query, dropout_rng, "dropout_rng");
  check_device(query, grad_mask, "grad_mask");
  check_device(query, alibi_slopes, "alibi_slopes");
  const c10::cuda::CUDAGuard guard(query.device());
  return flash_backward(query, key, value, attn_mask, key_padding_mask, is_causal, scale, out, lse,
                        grad_out, grad_lse, dropout_p, dropout_rng, grad_mask,
                        {window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                         block_bits},
                        launcher_for(query));
}

// The tensors of a packed batch's forward and backward alike: query on a CUDA device, the others on the
// same one.
void check_packed_devices(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const at::Tensor& out,
                          const at::Tensor& lse, const std::optional<at::Tensor>& dropout_rng,
                          const std::optional<at::Tensor>& alibi_slopes) {
  check_attention_devices(query, key, value, std::nullopt, std::nullopt, out);
  check_device(query, cu_seqlens_q, "cu_seqlens_q");
  check_device(query, cu_seqlens_k, "cu_seqlens_k");
  check_device(query, lse, "lse");
  check_device(query, dropout_rng, "dropout_rng");
  check_device(query, alibi_slopes, "alibi_slopes");
}

void forward_varlen_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                         int64_t max_seqlen_k, bool is_causal, double scale, const at::Tensor& out,
                         const at::Tensor& lse, double dropout_p, const std::optional<at::Tensor>& dropout_rng,
                         int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
                         const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift,
                         const std::optional<at::Tensor>& block_tiles, const std::optional<at::Tensor>& block_bits,
                         const std::optional<at::Tensor>& sinks) {
  check_packed_devices(query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, dropout_rng, alibi_slopes);
  check_device(query, sinks, "sinks");
  const c10::cuda::CUDAGuard guard(query.device());
  flash_forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                       out, lse, dropout_p, dropout_rng,
                       {window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift, block_tiles,
                        block_bits, sinks},
                       launcher_for(query));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_varlen_cuda(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool is_causal, double scale,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_lse, double dropout_p, const std::optional<at::Tensor>& dropout_rng,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t diagonal_shift, const std::optional<at::Tensor>& block_tiles,
    const std::optional<at::Tensor>& block_bits) {
  check_packed_devices(query, key, value, cu_seqlens_q, cu_seqlens_k, out, lse, dropout_rng, alibi_slopes);
  check_device(query, grad_out, "grad_out");
  check_device(query, grad_lse, "grad_lse");
  const c10::cuda::CUDAGuard guard(query.device());
  return flash_backward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                               scale, out, lse, grad_out, grad_lse, dropout_p, dropout_rng,
                               {window_left, window_right, bottom_right, softcap, alibi_slopes, diagonal_shift,
                                block_tiles, block_bits},
                               launcher_for(query));
}

}  // namespace
}  // namespace fused_attn_cuda

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("flash_forward", &fused_attn_cuda::forward_cuda);
  m.impl("flash_backward", &fused_attn_cuda::backward_cuda);
  m.impl("flash_forward_varlen", &fused_attn_cuda::forward_varlen_cuda);
  m.impl("flash_backward_varlen", &fused_attn_cuda::backward_varlen_cuda);
}
