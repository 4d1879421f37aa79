// A mask program as the kernels read it (fused_attn/masks.py builds it): which keys each query sees,
// described per tile of kTile × kTile (query rows × keys), for the CPU and CUDA kernels alike.
//
//   tiles  int32 (B, H_q, ⌈L_q / kTile⌉, ⌈L_k / kTile⌉), any strides (0 where it broadcasts):
//          kTileEmpty  no query of the tile sees a key of it: the tile is never visited;
//          kTileFull   every query of the tile sees every key of it: nothing is read per score;
//          p >= 0      partial: query i sees key j iff bit (j % 32) of
//                      bits[(p · kTile + i % kTile) · kWords + (j % kTile) / 32] is set.
//   bits   int32 (P, kTile, kWords), contiguous: the rows of the P partial tiles.
//
// What the program hides adds to what the call's other rules hide (causal, window, padding, masks).
// Kernel blocks that divide kTile and start at multiples of their size lie inside one tile, so one
// load of its state decides the block. Free of torch headers and host/device-neutral, as dropout.h.
#pragma once

#include <cstdint>

#include "dropout.h"  // FUSED_ATTN_HOST_DEVICE

namespace fused_attn {

constexpr int64_t kTile = 128;
constexpr int64_t kWords = kTile / 32;
constexpr int32_t kTileEmpty = -1;
constexpr int32_t kTileFull = -2;

struct BlockProgram {
  const int32_t* tiles = nullptr;  // null: the call has no program
  int64_t s[4] = {0, 0, 0, 0};     // strides of tiles, in elements
  const uint32_t* bits = nullptr;

  FUSED_ATTN_HOST_DEVICE bool present() const { return tiles != nullptr; }

  // The state of the tile holding query i and key j of head h of batch row b.
  FUSED_ATTN_HOST_DEVICE int32_t tile(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return tiles[b * s[0] + h * s[1] + (i / kTile) * s[2] + (j / kTile) * s[3]];
  }

  // The kWords words of query i's row in partial tile `state` (its bit j % 32 of word (j % kTile) / 32).
  FUSED_ATTN_HOST_DEVICE const uint32_t* row(int32_t state, int64_t i) const {
    return bits + (static_cast<int64_t>(state) * kTile + i % kTile) * kWords;
  }

  // Whether query i sees key j in a tile of state `state` (the program's part of the answer).
  FUSED_ATTN_HOST_DEVICE bool sees(int32_t state, int64_t i, int64_t j) const {
    if (state == kTileFull) return true;
    if (state == kTileEmpty) return false;
    return (row(state, i)[(j % kTile) / 32] >> (j % 32)) & 1u;
  }
};

}  // namespace fused_attn
