// The check each device's forward makes before writing `out` through its strides while the inputs
// are still being read: two elements of `out` sharing memory, or memory shared with an input, would
// make the result depend on the order of the writes. Decided from address ranges, so it holds for
// the strided layouts this library reads in place (slices of packed projections, permuted views),
// where ATen's overlap status gives up.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

namespace fused_attn {

// [first byte, one past the last byte] a strided tensor can touch.
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  int64_t low = 0, high = 0;
  for (int64_t i = 0; i < t.dim(); ++i) {
    const int64_t extent = (t.size(i) - 1) * t.stride(i);
    (extent < 0 ? low : high) += extent;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto item = static_cast<int64_t>(t.element_size());
  return {base + low * item, base + (high + 1) * item};
}

inline void check_output_memory(const char* op, const char* name, const at::Tensor& out,
                                std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, op, ": ", name,
              ": expected a tensor whose elements do not share memory (not an expanded view)");
  for (const auto& [input_name, input] : inputs) {
    if (input == nullptr || !input->defined() || input->numel() == 0 || out.numel() == 0) continue;
    if (!out.storage().is_alias_of(input->storage())) continue;
    // Same storage: refuse when the address ranges meet (conservative for interleaved views).
    const auto [out_begin, out_end] = byte_range(out);
    const auto [in_begin, in_end] = byte_range(*input);
    TORCH_CHECK(out_end <= in_begin || in_end <= out_begin, op, ": ", name,
                ": expected memory apart from ", input_name, "'s");
  }
}

}  // namespace fused_attn
