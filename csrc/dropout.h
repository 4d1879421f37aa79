// Dropout's random stream, for the CPU and CUDA kernels alike: which elements a call drops.
//
// Element (b, h, i, j) is dropped iff  philox4x32_10(counter, key)[J % 4] < threshold,  with
// I = query_start + i, J = key_start + j, counter = (J / 4, I, b * H_q + h, offset) and
// key = (seed mod 2^32, seed / 2^32): the formula of fused_attn/dropout.py, which the Triton kernels
// and the reference implement too. It depends on nothing but the element's indices and the call's
// (seed, offset, query_start, key_start), so any tiling or thread order drops the same elements, and
// the backward regenerates the forward's mask.
//
// Free of torch headers and host/device-neutral: the CUDA kernels include it as it is, the CPU
// kernels once per instruction set. The functions are static, so each instruction-set copy keeps its
// own (an inline function shared between them would be linked once, from whichever copy came first).
#pragma once

#include <cmath>
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
  // Positions of the call's first query and key in the sequence the stream is keyed on (ring
  // attention's blocks of a longer sequence); 0 for an ordinary call.
  int64_t query_start = 0, key_start = 0;
  // An element is dropped when its 32-bit integer is below this (round(p * 2^32), at most 2^32 - 1).
  uint32_t threshold = 0;
  double keep_scale = 1.0;  // 1 / (1 - p)
};

// round(p * 2^32), at most 2^32 - 1: the threshold of dropout probability p in [0, 1) (the same
// rounding as fused_attn/dropout.py).
static inline uint32_t dropout_threshold(double p) {
  const long long scaled = std::llround(p * 4294967296.0);
  return static_cast<uint32_t>(scaled < 4294967295LL ? scaled : 4294967295LL);
}

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

// N Philox4x32-10 blocks at once (the four outputs of block i end in c0[i] .. c3[i]), in
// structure-of-arrays form. The CUDA kernels run one block per thread (N = 1); the CPU kernels' AVX2
// and AVX512 copies run the same rounds in vector registers (csrc/cpu/flash_kernel.h: no compiler
// vectorises this loop, bench/NOTES.md, sections 10 and 11), their generic copy runs this one.
template <int N>
FUSED_ATTN_HOST_DEVICE static inline void philox4x32_10_blocks(uint32_t (&c0)[N], uint32_t (&c1)[N], uint32_t (&c2)[N],
                                        uint32_t (&c3)[N], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    for (int i = 0; i < N; ++i) philox_round(c0[i], c1[i], c2[i], c3[i], k0, k1);
    k0 += kPhiloxKeyBump0;
    k1 += kPhiloxKeyBump1;
  }
}

}  // namespace fused_attn
