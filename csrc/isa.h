// The instruction set this translation unit is compiled for, from the compiler's own macros: setup.py builds every
// kernel source once per variant (-march=x86-64-v4 -mavx512vnni, -march=x86-64-v3, and the target's baseline) into
// a module of its own (kvcache/_native/_C_<isa>), and kvcache.native loads the one the CPU runs (cpuid).
//   KVCACHE_AVX512: AVX-512 F/BW/VL/DQ with VNNI (16 floats a register)
//   KVCACHE_AVX2:   AVX2 + FMA + F16C, without AVX-512 (8 floats a register, 16 registers)
//   KVCACHE_SCALAR: neither (plain C++ and GCC vector extensions: SSE2 on x86-64, NEON on arm64)
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define KVCACHE_X86 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define KVCACHE_AVX512 1
#define KVCACHE_ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define KVCACHE_AVX2 1
#define KVCACHE_ISA_NAME "avx2"
#elif !defined(__AVX2__)
#define KVCACHE_SCALAR 1
#define KVCACHE_ISA_NAME "scalar"
#else
#error "an instruction set between the variants: build with setup.py's flags (x86-64-v4 + VNNI, x86-64-v3, or none)"
#endif

namespace kvcache {

// Read the cache line at p into every level of cache, ahead of its use (a hint: never faults).
static inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }

#if defined(KVCACHE_X86)
// Pins a vector accumulator to a register at this point. GCC reassociates integer vector sums freely (they are
// exact), and in a kernel that sums many products per accumulator it turns the chain into a tree whose leaves
// spill to the stack (16 ymm registers); this keeps the chain as written.
template <class V>
static inline void in_register(V& v) { asm volatile("" : "+x"(v)); }
#endif

}  // namespace kvcache
