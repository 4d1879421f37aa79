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

constexpr int kPhiloxRounds = 10;
constexpr uint32_t kPhiloxKeyBump0 = 0x9E3779B9u, kPhiloxKeyBump1 = 0xBB67AE85u;

// One round of Philox4x32 (Salmon et al., 2011) on counter (c0, c1, c2, c3) with key (k0, k1).
FUSED_ATTN_HOST_DEVICE static inline void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3,
                                                       uint32_t k0, uint32_t k1) {
  const uint64_t product0 = static_cast<uint64_t>(0xD2511F53u) * c0;
  const uint64_t product1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
  const uint32_t next0 = static_cast<uint32_t>(product1 >> 32) ^ c1 ^ k0;
  const uint32_t next2 = static_cast<uint32_t>(product0 >> 32) ^ c3 ^ k1;
  c1 = static_cast<uint32_t>(product1);
  c3 = static_cast<uint32_t>(product0);
  c0 = next0;
  c2 = next2;
}

// Philox4x32-10: the four 32-bit outputs for counter c and key (k0, k1).
FUSED_ATTN_HOST_DEVICE static inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    philox_round(c[0], c[1], c[2], c[3], k0, k1);
    k0 += kPhiloxKeyBump0;
    k1 += kPhiloxKeyBump1;
  }
}

// N Philox4x32-10 blocks at once, in structure-of-arrays form: the same rounds, written so that a
// vectorising compiler runs the N blocks in SIMD lanes (the CPU kernels; one block per thread on GPUs).
template <int N>
static inline void philox4x32_10_blocks(uint32_t (&c0)[N], uint32_t (&c1)[N], uint32_t (&c2)[N],
                                        uint32_t (&c3)[N], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    for (int i = 0; i < N; ++i) philox_round(c0[i], c1[i], c2[i], c3[i], k0, k1);
    k0 += kPhiloxKeyBump0;
    k1 += kPhiloxKeyBump1;
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
