// Test-only host driver: the `cuda` backend's kernels (csrc/cuda/flash_kernels.cuh) and host glue
// (csrc/cuda/flash_dispatch.h), unchanged, run on CPU tensors through the emulation of the CUDA
// execution model in cuda_emulation.h. Built at test time by tests/emulation/build.py.
#include "cuda_emulation.h"  // first: it defines the CUDA names the kernel header uses

#include <torch/extension.h>

#include "flash_dispatch.h"

namespace {

using fused_attn_cuda::LaunchShape;

struct EmulatedLaunch {
  template <typename Params>
  void operator()(void (*kernel)(Params), const LaunchShape& shape, const Params& params) const {
    cuda_emulation::launch(kernel, {shape.grid[0], shape.grid[1], shape.grid[2]},
                           {shape.block, 1, 1}, shape.shared_bytes, params);
  }
};

void check_cpu(const std::optional<at::Tensor>& t, const char* name) {
  TORCH_CHECK(!t.has_value() || t->device().is_cpu(), "emulated cuda: ", name,
              " must be a CPU tensor, got ", t->device());
}

at::Tensor forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask,
                   const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale,
                   const at::Tensor& out) {
  for (const auto& [t, name] : {std::pair{std::optional<at::Tensor>(query), "query"},
                                {key, "key"}, {value, "value"}, {attn_mask, "attn_mask"},
                                {key_padding_mask, "key_padding_mask"}, {out, "out"}})
    check_cpu(t, name);
  // The emulated threads never touch Python: let other Python threads run meanwhile.
  pybind11::gil_scoped_release release;
  return fused_attn_cuda::flash_forward(query, key, value, attn_mask, key_padding_mask, is_causal,
                                        scale, out, EmulatedLaunch{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse) {
  for (const auto& [t, name] :
       {std::pair{std::optional<at::Tensor>(query), "query"}, {key, "key"}, {value, "value"},
        {attn_mask, "attn_mask"}, {key_padding_mask, "key_padding_mask"}, {out, "out"},
        {lse, "lse"}, {grad_out, "grad_out"}, {grad_lse, "grad_lse"}})
    check_cpu(t, name);
  pybind11::gil_scoped_release release;
  return fused_attn_cuda::flash_backward(query, key, value, attn_mask, key_padding_mask, is_causal,
                                         scale, out, lse, grad_out, grad_lse, EmulatedLaunch{});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fused_attn cuda kernels run on CPU tensors through a host emulation (tests only)";
  m.def("forward", &forward, "flash_forward(query, key, value, attn_mask, key_padding_mask, "
        "is_causal, scale, out) -> lse");
  m.def("backward", &backward, "flash_backward(query, key, value, attn_mask, key_padding_mask, "
        "is_causal, scale, out, lse, grad_out, grad_lse) -> (dq, dk, dv)");
}
