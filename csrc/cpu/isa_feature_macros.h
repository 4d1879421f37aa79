// The feature macros of the instruction set enabled by the `#pragma GCC target` of the kernel_isa_*
// file that includes this header, before any other include. GCC enables the instructions after the
// pragma but leaves undefined the macros that ATen's vector and Sleef headers test, so they are
// defined here to match. FUSED_ATTN_ISA: 2 (AVX2), 512 (AVX512), 513 (AVX512 with AVX512-BF16).

#pragma once

#if FUSED_ATTN_ISA >= 2
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
#endif

#if FUSED_ATTN_ISA >= 512
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
#endif

#if FUSED_ATTN_ISA >= 513
#ifndef __AVX512BF16__
#define __AVX512BF16__ 1
#endif
#endif
