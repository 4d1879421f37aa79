// The CPU kernels compiled for any CPU (no vector extension assumed); attention_cpu.cpp chooses them at run time.
// Source file names sort this one before the kernel_isa_* files on purpose: where the
// instruction-set copies and this one emit the same inline helper of a shared header, the linker
// keeps the first copy it meets, which must be this baseline one.

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "flash_kernel.h"
