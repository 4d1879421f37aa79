// fused_attn::rotary on the CPU: the rotary embedding of fused_attn/rotary.py in one pass over x.
//
// A decode step turns one query row per head and one new key row per kv head: in torch that is a dozen
// small operations, about 0.1 ms, a tenth of the step (bench/NOTES.md section 35); here it is one loop.
// Each pair (x1, x2) becomes (x1·cos − x2·sin, x1·sin + x2·cos), every product and sum rounded to float32
// (float64 for float64 tensors) as torch's separate operations round them, and the result once to x's
// dtype: bit for bit the torch definition. This file is built for the baseline ISA, without FMA, so the
// compiler cannot contract a product and a sum into one rounding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>

namespace fused_attn_cpu {
namespace {

template <typename scalar_t, typename table_t>
void turn_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
               bool interleaved, at::Tensor& out) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t heads = x.size(1), length = x.size(2), half = cos.size(1);
  const auto* x_data = x.const_data_ptr<scalar_t>();
  auto* out_data = out.data_ptr<scalar_t>();
  const auto* cos_data = cos.const_data_ptr<table_t>();
  const auto* sin_data = sin.const_data_ptr<table_t>();
  const auto* position_data = positions.const_data_ptr<int64_t>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2), xs3 = x.stride(3);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2), os3 = out.stride(3);
  // The second element of pair j: the next dimension (interleaved), or the one rotary_dim / 2 further.
  const int64_t second = interleaved ? 1 : half, step = interleaved ? 2 : 1;
  at::parallel_for(0, x.size(0) * heads * length, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % length, h = (row / length) % heads, b = row / (length * heads);
      const int64_t p = position_data[b * positions.stride(0) + i * positions.stride(1)];
      const table_t* c = cos_data + p * cos.stride(0);
      const table_t* s = sin_data + p * sin.stride(0);
      const scalar_t* src = x_data + b * xs0 + h * xs1 + i * xs2;
      scalar_t* dst = out_data + b * os0 + h * os1 + i * os2;
      for (int64_t j = 0; j < half; ++j) {
        const int64_t d1 = j * step, d2 = d1 + second;
        const acc_t x1 = static_cast<acc_t>(src[d1 * xs3]), x2 = static_cast<acc_t>(src[d2 * xs3]);
        const acc_t cj = static_cast<acc_t>(c[j * cos.stride(1)]), sj = static_cast<acc_t>(s[j * sin.stride(1)]);
        const acc_t x1c = x1 * cj, x2s = x2 * sj, x1s = x1 * sj, x2c = x2 * cj;
        dst[d1 * os3] = static_cast<scalar_t>(x1c - x2s);
        dst[d2 * os3] = static_cast<scalar_t>(x1s + x2c);
      }
      for (int64_t d = 2 * half; d < x.size(3); ++d) dst[d * os3] = src[d * xs3];
    }
  });
}

// x (B, H, L, D) turned at positions (B, L) by the tables (seqlen_ro, rotary_dim / 2) of x's dtype or float32.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                  bool interleaved) {
  const char* op = "rotary";
  TORCH_CHECK(x.dim() == 4, op, ": x: expected a 4-D tensor (B, H, L, D), got shape ", x.sizes());
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && 2 * cos.size(1) <= x.size(3), op,
              ": cos, sin: expected two tables (seqlen_ro, rotary_dim / 2) alike with rotary_dim <= ", x.size(3),
              ", got shapes ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(sin.scalar_type() == cos.scalar_type() &&
                  (cos.scalar_type() == x.scalar_type() || cos.scalar_type() == at::kFloat),
              op, ": cos, sin: expected x's dtype ", x.scalar_type(), " or float32, got ", cos.scalar_type(), " and ",
              sin.scalar_type());
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == x.size(0) && positions.size(1) == x.size(2) &&
                  positions.scalar_type() == at::kLong,
              op, ": positions: expected int64 (B, L) = (", x.size(0), ", ", x.size(2), "), got ",
              positions.scalar_type(), " of shape ", positions.sizes());
  const auto* position_data = positions.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < positions.size(0); ++b) {
    for (int64_t i = 0; i < positions.size(1); ++i) {
      const int64_t p = position_data[b * positions.stride(0) + i * positions.stride(1)];
      TORCH_CHECK(p >= 0 && p < cos.size(0), op, ": positions: entry (", b, ", ", i, ") = ", p,
                  " is not a row of the tables [0, ", cos.size(0), ")");
    }
  }
  at::Tensor out = at::empty_like(x);
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    if (cos.scalar_type() == x.scalar_type()) {
      turn_rows<scalar_t, scalar_t>(x, cos, sin, positions, interleaved, out);
    } else {
      turn_rows<scalar_t, float>(x, cos, sin, positions, interleaved, out);
    }
  });
  return out;
}

}  // namespace
}  // namespace fused_attn_cpu

TORCH_LIBRARY_FRAGMENT(fused_attn, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool interleaved) -> Tensor");
}

TORCH_LIBRARY_IMPL(fused_attn, CPU, m) {
  m.impl("rotary", &fused_attn_cpu::rotary);
}
