// Dropout's random stream, for the CPU and CUDA kernels alike: which elements a call drops.
//
// Element (b, h, i, j) is dropped iff  philox4x32_10(counter, key)[j % 4] < threshold,  with
// counter = (j / 4, i, b * H_q + h, offset) and key = (seed mod 2^32, seed / 2^32): the formula
// of fused_attn/dropout.py, which the Triton kernels and the reference implement too. It depends on
// nothing but the element's indices and the call's (seed, offset), so any tiling or thread order
// drops the same elements, and the backward regenerates the forward's mask.
//
// Free of torch headers: the CUDA kernels include it as they are, the CPU kernels per instruction set.
// The functions are static, so each instruction-set copy of the CPU kernels keeps its own (an inline
// function shared between them would be linked once, from whichever copy came first).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FUSED_ATTN_HOST_DEVICE __host__ __device__
#else
#define FUSED_ATTN_HOST_DEVICE
#endif

namespace fused_attn {

struct DropoutParams {
  bool enabled = false;
  uint64_t seed = 0;
  uint32_t offset = 0;
  // An element is dropped when its 32-bit integer is below this (round(p * 2^32), at most 2^32 - 1).
  uint32_t threshold = 0;
  double keep_scale = 1.0;  // 1 / (1 - p)
};

// Philox4x32-10 (Salmon et al., 2011): the four 32-bit outputs for counter c and key (k0, k1).
FUSED_ATTN_HOST_DEVICE static inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kKeyBump0 = 0x9E3779B9u, kKeyBump1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t product0 = static_cast<uint64_t>(kMultiplier0) * c[0];
    const uint64_t product1 = static_cast<uint64_t>(kMultiplier1) * c[2];
    const uint32_t next0 = static_cast<uint32_t>(product1 >> 32) ^ c[1] ^ k0;
    const uint32_t next2 = static_cast<uint32_t>(product0 >> 32) ^ c[3] ^ k1;
    c[1] = static_cast<uint32_t>(product1);
    c[3] = static_cast<uint32_t>(product0);
    c[0] = next0;
    c[2] = next2;
    k0 += kKeyBump0;
    k1 += kKeyBump1;
  }
}

// The random integers of keys 4 * quad .. 4 * quad + 3 of query row `query` in head `batch_head`
// (= b * H_q + h), written to bits[0..4).
FUSED_ATTN_HOST_DEVICE static inline void dropout_bits(const DropoutParams& d, uint32_t batch_head, uint32_t query,
                                                uint32_t quad, uint32_t bits[4]) {
  bits[0] = quad;
  bits[1] = query;
  bits[2] = batch_head;
  bits[3] = d.offset;
  philox4x32_10(bits, static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32));
}

FUSED_ATTN_HOST_DEVICE static inline bool dropout_keeps(const DropoutParams& d, uint32_t bits) {
  return bits >= d.threshold;
}

}  // namespace fused_attn
