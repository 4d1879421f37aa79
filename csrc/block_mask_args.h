// The ops' block_tiles / block_bits arguments (csrc/block_mask.h) checked and turned into the
// kernels' BlockProgram: every check the kernels rely on, with the op's name and the argument's.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "block_mask.h"

namespace fused_attn {

inline BlockProgram block_program_of(const char* op, const std::optional<at::Tensor>& block_tiles,
                                      const std::optional<at::Tensor>& block_bits, const at::Tensor& query,
                                      int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_k) {
  BlockProgram program;
  const bool has_tiles = block_tiles.has_value() && block_tiles->defined();
  const bool has_bits = block_bits.has_value() && block_bits->defined();
  TORCH_CHECK(has_tiles == has_bits, op, ": block_tiles, block_bits: expected both or neither");
  if (!has_tiles) return program;
  const at::Tensor& tiles = *block_tiles;
  const at::Tensor& bits = *block_bits;
  const int64_t q_tiles = (len_q + kTile - 1) / kTile, k_tiles = (len_k + kTile - 1) / kTile;
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.device() == query.device(), op,
              ": block_tiles: expected int32 on ", query.device(), ", got ", tiles.scalar_type(), " on ",
              tiles.device());
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(0) == batch && tiles.size(1) == heads_q && tiles.size(2) == q_tiles &&
                  tiles.size(3) == k_tiles,
              op, ": block_tiles: expected shape (B, H_q, ⌈L_q/", kTile, "⌉, ⌈L_k/", kTile, "⌉) = (", batch, ", ",
              heads_q, ", ", q_tiles, ", ", k_tiles, "), got ", tiles.sizes());
  TORCH_CHECK(bits.scalar_type() == at::kInt && bits.device() == query.device(), op,
              ": block_bits: expected int32 on ", query.device(), ", got ", bits.scalar_type(), " on ", bits.device());
  TORCH_CHECK(bits.dim() == 3 && bits.size(1) == kTile && bits.size(2) == kWords && bits.is_contiguous(), op,
              ": block_bits: expected a contiguous (P, ", kTile, ", ", kWords, ") tensor, got shape ", bits.sizes(),
              " and strides ", bits.strides());
  // Every partial tile's index must name a tile of bits (one pass over the small tile table; on a GPU
  // the table is checked on the device by the ops' Python layer, which built it).
  if (tiles.device().is_cpu() && tiles.numel() > 0) {
    const at::Tensor flat = tiles.contiguous();
    const int32_t* t = flat.data_ptr<int32_t>();
    for (int64_t n = 0; n < flat.numel(); ++n) {
      TORCH_CHECK(t[n] >= kTileFull && t[n] < bits.size(0), op, ": block_tiles: expected -1 (empty), -2 (full) or ",
                  "a partial tile's index below ", bits.size(0), ", got ", t[n]);
    }
  }
  program.tiles = tiles.data_ptr<int32_t>();
  for (int d = 0; d < 4; ++d) program.s[d] = tiles.stride(d);
  program.bits = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  return program;
}

}  // namespace fused_attn
