// The CPU kernels compiled for AVX512 machines with AVX512-BF16 (Cooper Lake, Sapphire Rapids and
// later): the same source as kernel_isa_avx512.cpp, plus the hardware float -> bf16 conversion for P.
// attention_cpu.cpp chooses them at run time.
// The instruction set is enabled for this file alone (the pragma below, before any include, as
// ATen enables it per file with compiler flags), so the package still loads on older CPUs.

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
#endif
// GCC enables the instructions after the pragma but leaves the feature macros that the vector and
// Sleef headers test undefined, so they are defined here to match the pragma.
#ifndef __SSE3__
#define __SSE3__ 1
#endif
#ifndef __SSSE3__
#define __SSSE3__ 1
#endif
#ifndef __SSE4_1__
#define __SSE4_1__ 1
#endif
#ifndef __SSE4_2__
#define __SSE4_2__ 1
#endif
#ifndef __POPCNT__
#define __POPCNT__ 1
#endif
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#ifndef __BMI__
#define __BMI__ 1
#endif
#ifndef __BMI2__
#define __BMI2__ 1
#endif
#ifndef __LZCNT__
#define __LZCNT__ 1
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#ifndef __AVX512BF16__
#define __AVX512BF16__ 1
#endif
#define CPU_CAPABILITY AVX512_BF16
#define CPU_CAPABILITY_AVX512
#define FUSED_ATTN_AVX512_BF16
#include "flash_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
