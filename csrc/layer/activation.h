// SiLU(gate) x up with ATen's floats, shared by the MLP's kernels (layer.cpp's silu_mul, panels.cpp's gate/up
// epilogue).
#pragma once

#include <sleef.h>

#include <cmath>
#include <cstdint>

#include "../isa.h"

namespace kvcache {

// a[i] = silu(g[i]) * u[i] for i < n, rounded as ATen's silu and then mul_ round them: x / (1 + exp(-x)) with the
// exp ATen's vectorized silu calls (Sleef's, 1 ulp) on [0, vec) (a multiple of the pair of registers its loop takes),
// std::exp on the rest, then the product. a may be g.
static inline void silu_mul_span(const float* g, const float* u, float* a, int64_t n, int64_t vec) {
  int64_t i = 0;
#if defined(KVCACHE_AVX512)
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (; i < vec; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(sign, x))));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
#elif defined(KVCACHE_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i < vec; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(sign, x))));
    _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float s = g[i] / (1.f + std::exp(-g[i]));
    a[i] = s * u[i];
  }
}

// The part of a row of I that ATen's vectorized silu loop takes (in pairs of registers): silu_mul_span's `vec`.
static inline int64_t silu_vec(int64_t I) {
#if defined(KVCACHE_AVX512)
  return I / 32 * 32;
#elif defined(KVCACHE_AVX2)
  return I / 16 * 16;
#else
  return 0;
#endif
}

}  // namespace kvcache
