// fused_attn::row_dots on the CPU: rowsum(a * b) over the last dimension, one value per row, in float32
// (float64 for float64 inputs). The sinks' gradient takes it for every row of a call, from the output
// and its gradient (fused_attn/scores.py, sink_gradient): one pass over both, whatever the order of
// their rows in memory, each row summed by one thread in a fixed order (bit-identical across thread
// counts), where a float conversion of both and their product would walk memory three times.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

namespace fused_attn_cpu {
namespace {

// The element offset of row `row` (counted over the leading dimensions in order) through `strides`.
int64_t row_offset(int64_t row, at::IntArrayRef sizes, at::IntArrayRef strides) {
  int64_t offset = 0;
  for (int64_t dim = static_cast<int64_t>(sizes.size()) - 2; dim >= 0; --dim) {
    offset += (row % sizes[dim]) * strides[dim];
    row /= sizes[dim];
  }
  return offset;
}

template <typename scalar_t, typename acc_t>
void fill_row_dots(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const int64_t n = a.size(-1), rows = out.numel();
  const auto* a_data = a.const_data_ptr<scalar_t>();
  const auto* b_data = b.const_data_ptr<scalar_t>();
  auto* out_data = out.data_ptr<acc_t>();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* x = a_data + row_offset(row, a.sizes(), a.strides());
      const scalar_t* y = b_data + row_offset(row, b.sizes(), b.strides());
      // Independent partial sums, one per lane, which the compiler turns into vector registers; they
      // are added in a fixed order, so the result does not depend on the thread that summed the row.
      constexpr int64_t kLanes = 16;
      acc_t lanes[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          lanes[lane] += static_cast<acc_t>(x[i + lane]) * static_cast<acc_t>(y[i + lane]);
        }
      }
      acc_t sum = 0;
      for (int64_t lane = 0; lane < kLanes; ++lane) sum += lanes[lane];
      for (; i < n; ++i) sum += static_cast<acc_t>(x[i]) * static_cast<acc_t>(y[i]);
      out_data[row] = sum;
    }
  });
}

at::Tensor row_dots(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "row_dots: a, b: expected CPU tensors, got ", a.device(),
              " and ", b.device());
  TORCH_CHECK(a.dim() >= 1 && a.sizes() == b.sizes(), "row_dots: b: expected the shape of a, ", a.sizes(), ", got ",
              b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "row_dots: b: expected dtype ", a.scalar_type(), ", got ",
              b.scalar_type());
  // Rows of unit stride are read in place; anything else is copied once.
  const at::Tensor x = a.size(-1) > 1 && a.stride(-1) != 1 ? a.contiguous() : a;
  const at::Tensor y = b.size(-1) > 1 && b.stride(-1) != 1 ? b.contiguous() : b;
  const bool wide = a.scalar_type() == at::kDouble;
  at::Tensor out = at::empty(a.sizes().slice(0, a.dim() - 1), a.options().dtype(wide ? at::kDouble : at::kFloat));
  if (out.numel() == 0) return out;
  if (a.size(-1) == 0) return out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "row_dots", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      fill_row_dots<scalar_t, double>(x, y, out);
    } else {
      fill_row_dots<scalar_t, float>(x, y, out);
    }
  });
  return out;
}

}  // namespace
}  // namespace fused_attn_cpu

TORCH_LIBRARY_IMPL(fused_attn, CPU, m) {
  m.impl("row_dots", &fused_attn_cpu::row_dots);
}
