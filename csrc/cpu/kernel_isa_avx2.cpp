// The CPU kernels compiled for AVX2 machines; attention_cpu.cpp chooses them at run time.
// The instruction set is enabled for this file alone (the pragma below, before any include, as
// ATen enables it per file with compiler flags), so the package still loads on older CPUs.

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
#define FUSED_ATTN_ISA 2
#include "isa_feature_macros.h"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "flash_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
