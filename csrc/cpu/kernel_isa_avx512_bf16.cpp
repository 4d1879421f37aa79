// The CPU kernels compiled for AVX512 machines with AVX512-BF16 (Cooper Lake, Sapphire Rapids and
// later, AMD Zen 4): the same source as kernel_isa_avx512.cpp, plus the hardware float -> bf16
// conversion for P, and bf16 products kept in bf16 for oneDNN's brgemm on CPUs without AMX too
// (typed_products in flash_kernel.h).
// attention_cpu.cpp chooses them at run time.
// The instruction set is enabled for this file alone (the pragma below, before any include, as
// ATen enables it per file with compiler flags), so the package still loads on older CPUs.

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define FUSED_ATTN_ISA 513
#include "isa_feature_macros.h"
#define CPU_CAPABILITY AVX512_BF16
#define CPU_CAPABILITY_AVX512
#define FUSED_ATTN_AVX512_BF16
#include "flash_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
