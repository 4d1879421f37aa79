// Launches a kernel of csrc/cuda on the emulation at a LaunchShape of flash_kernels.cuh: the shapes
// the torch glue computes, used by the emulated extension and the sanitizer run alike.
#pragma once

#include "cuda_emulation.h"  // first: it defines the CUDA names the kernel header uses
#include "flash_kernels.cuh"

struct EmulatedLaunch {
  // The emulation has no SMs; this count makes the decode kernels split small test problems.
  static constexpr int kMultiprocessors = 4;
  int multiprocessors() const { return kMultiprocessors; }

  template <typename Params>
  void operator()(void (*kernel)(Params), const fused_attn_cuda::LaunchShape& shape, const Params& params) const {
    cuda_emulation::launch(kernel, {shape.grid[0], shape.grid[1], shape.grid[2]},
                           {shape.block, 1, 1}, shape.shared_bytes, params);
  }
};
