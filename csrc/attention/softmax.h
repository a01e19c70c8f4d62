// What decode and prefill attention share: GCC vector types of 16 floats (one AVX-512 register, two AVX2 ones),
// their horizontal sums and maxima, an inline exp, and the online softmax's step. Compiled with -ffast-math
// (setup.py: the attention sources), which assumes finite floats: the code tests bits where a NaN must survive.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../isa.h"

namespace kvcache {

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

// The native vector: one register of floats (AVX-512's 16; AVX2's 8, and 8 in the scalar variant, which GCC splits
// into what the target has). A wider GCC vector than the registers is lowered piecewise, and a scalar broadcast
// into one went through 16 stores to the stack on AVX2: the softmax and the tiles use the native width.
#if defined(KVCACHE_AVX512)
typedef v16 vf;
typedef vi16 vi;
#else
typedef v8 vf;
typedef vi8 vi;
#endif
constexpr int VL = sizeof(vf) / sizeof(float);

static inline vf splat(float x) { return (vf){} + x; }

// Tree reductions: shuffle-adds instead of scalar adds.
static inline float hsum(v8 a) {
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hsum(v16 v) {
  return hsum((v8)(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}

static inline float hmax(v8 c) {
  const v4 d = __builtin_shufflevector(c, c, 0, 1, 2, 3), e = __builtin_shufflevector(c, c, 4, 5, 6, 7);
  const v4 f = d > e ? d : e;
  return std::max(std::max(f[0], f[1]), std::max(f[2], f[3]));
}

static inline float hmax(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
           b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax((v8)(a > b ? a : b));
}

static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

template <int64_t DC>
static inline float dot(const float* q, const float* k, int64_t Drt) {
  if constexpr (DC > 0 && DC % VL == 0) {
    vf acc = *(const vf*)q * *(const vf*)k;
#pragma GCC unroll 16
    for (int64_t d = VL; d < DC; d += VL) acc += *(const vf*)(q + d) * *(const vf*)(k + d);
    return hsum(acc);
  } else {
    float s = 0.f;
#pragma omp simd reduction(+:s)
    for (int64_t d = 0; d < Drt; ++d) s += q[d] * k[d];
    return s;
  }
}

template <int64_t DC>
static inline void axpy(float* a, float p, const float* v, int64_t Drt) {
  if constexpr (DC > 0 && DC % VL == 0) {
    const vf pv = splat(p);
#pragma GCC unroll 16
    for (int64_t d = 0; d < DC; d += VL) *(vf*)(a + d) += pv * *(const vf*)(v + d);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < Drt; ++d) a[d] += p * v[d];
  }
}
// Running maxima start here, not at -inf: -ffast-math assumes finite floats.
constexpr float NO_SCORE = -1e30f;

// o [H, D] = acc [H, D] / l [H], the online softmax's output.
static inline void normalise(float* o, const float* acc, const float* l, int64_t H, int64_t D) {
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[h * D + d] * inv;
  }
}

// exp(x) on a register's lanes with x <= 0, exactly 0 below -87 (float32's normal range ends there): Cephes' expf, a
// Cody-Waite reduction by ln 2 and a degree-5 polynomial (within 2 ulp of exp), inline so that the rows of a tile
// overlap; libmvec's out-of-line expf took a fifth of a 2,000-token prefill attention. Every lane computes the same
// floats whatever the register's width.
// A non-finite x (a corrupt cache byte's score) comes back as itself, so that the row's output is not finite either:
// tested on the bits, since -ffast-math lets the compiler drop a NaN from comparisons (the clamp below is a max).
static inline vf exp_le0(vf x) {
  const vf lo = (vf){} - 87.f, zero = {};
  const vi bad = ((vi)x & 0x7fffffff) >= 0x7f800000, under = x < lo;
  const vf arg = x;
  x = under ? lo : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(fx, vi);  // toward 0; then floor: -1 (true) where that rounded up
  n += (vi)(__builtin_convertvector(n, vf) > fx);
  const vf fn = __builtin_convertvector(n, vf);
  x = x - fn * 0.693359375f;
  x = x - fn * -2.12194440e-4f;
  vf y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
          1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  y *= (vf)((n + 127) << 23);  // 2^n
  return bad ? arg : under ? zero : y;
}

// 0, 1, ..., VL - 1
static inline vf lanes() {
  vf l;
  for (int i = 0; i < VL; ++i) l[i] = (float)i;
  return l;
}

// The online softmax's step on a block, shared by decode and prefill: the scores s [nv vectors of VL], those at n
// and past it masked (weight 0), become exp(s - m') with m' the new running maximum (m becomes m'), and their sum is
// added to psum's lanes (psum starts at 0). Returns the factor the running sum and the unnormalised output must be
// scaled by to m' first: 1 where there is nothing to rescale (the maximum kept, or the first scores).
template <int NV>  // vectors of scores: NV, or nv at run time where NV is 0
static inline float softmax_step(float* s, int64_t nv, int64_t n, float& m, vf& psum) {
  const vf lane = lanes(), none = splat(NO_SCORE);
  auto scores = [&](int64_t j) { const vf x = *(const vf*)(s + j); return lane + (float)j < (float)n ? x : none; };
  if constexpr (NV > 0) nv = NV;
  vf mv = none;
  for (int64_t v = 0; v < nv; ++v) mv = vmax(mv, scores(VL * v));
  const float mx = std::max(m, hmax(mv));
  // not libm's expf: a call spills every vector register (and expf(-1e30) takes its slow underflow path)
  const float corr = mx != m && m != NO_SCORE ? exp_le0(splat(m - mx))[0] : 1.f;
  m = mx;
  psum = (vf){};
  for (int64_t v = 0; v < nv; ++v) {
    const vf p = exp_le0(scores(VL * v) - mx);
    *(vf*)(s + VL * v) = p;
    psum += p;
  }
  return corr;
}

// The online softmax over one block of n scores s (n >= 0; s has room for n rounded up to 16, and those past n
// become 0): s[j] becomes exp(s[j] - m') with m' the new running maximum, and the running sum l and the
// unnormalised output acc [D] are rescaled to m' before s's sum joins l.
static inline void online_softmax(float* s, int64_t n, float& m, float& l, float* acc, int64_t D) {
  vf sum;
  const float corr = softmax_step<0>(s, (n + VL - 1) / VL, n, m, sum);
  if (corr != 1.f) {
    l *= corr;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  }
  l += hsum(sum);
}

// online_softmax for a prefill tile's row of 32 scores, of which the first `valid` are the row's keys (the others
// become weight 0): the running sum stays a register wide (lsum, summed once at the end) and the vectors of scores
// never leave registers between the maximum and the exponentials. D is a multiple of 32.
static inline void online_softmax32(float* s, int64_t valid, float& m, vf& lsum, float* acc, int64_t D) {
  vf sum;
  const float corr = softmax_step<32 / VL>(s, 32 / VL, valid, m, sum);
  if (corr != 1.f) {
    lsum *= corr;
    for (int64_t d = 0; d < D; d += VL) *(vf*)(acc + d) *= corr;
  }
  lsum += sum;
}


}  // namespace kvcache
