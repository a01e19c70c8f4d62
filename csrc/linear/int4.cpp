// int4_linear and q8_linear: 4-bit (GGUF Q4_1) and 8-bit codes with a scale and a minimum per group of 32 inputs,
// times activations quantized to int8 per group of 32 on the fly (GGUF Q8_1): integer dot products (AVX512-VNNI's
// vpdpbusd, AVX2's vpmaddubsw + vpmaddwd), as llama.cpp computes them.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "../isa.h"
#include "../ops.h"
#include "../parallel.h"

namespace kvcache {

// ---- 4-bit weights x int8 activations (quant_linear.Int4Dense) ----
// One int4_linear call's checked shapes, its activations quantized by `quantize` (per row: qa [K] int8, da [K/32]
// scales, sa [K/32] = da * sum(qa)) and its raw pointers; shared by every variant's kernel.
struct Int4Call {
  using Quantize = void (*)(const float*, int64_t, int8_t*, float*, float*);
  int64_t M, K, N, NB, G;
  std::vector<int8_t> qa;
  std::vector<float> da, sa;
  const uint8_t* wp;
  const uint16_t *dp, *mp;
  float* op;
  Int4Call(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m, Quantize quantize,
           int bits = 4)
      : M(x.size(0)), K(x.size(1)), N(out.size(1)), NB(qw.size(0)), G(K / 32) {
    TORCH_CHECK(K % 64 == 0 && x.is_contiguous() && out.is_contiguous() && out.size(0) == M && qw.is_contiguous() &&
                qw.size(1) == K * bits / 32 && qw.size(2) == 64 && NB * 16 >= N && NB * 16 < N + 16 && d.is_contiguous() &&
                m.is_contiguous() && d.size(0) == NB && d.size(1) == G && d.size(2) == 16 && m.sizes() == d.sizes(),
                bits == 4 ? "int4_linear: bad shapes or strides" : "q8_linear: bad shapes or strides");
    const float* xp = x.data_ptr<float>();
    qa.resize(M * K);
    da.resize(M * G);
    sa.resize(M * G);
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize(xp + r * K, K, qa.data() + r * K, da.data() + r * G, sa.data() + r * G);
    });
    wp = qw.data_ptr<uint8_t>();
    dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
    op = out.data_ptr<float>();
  }
};

#if defined(KVCACHE_AVX512)
bool has_int4() { return true; }
// Weights: per row, K/64 units of 32 bytes; byte j of a unit holds element j (low nibble) and element j + 32 (high
// nibble) of its 64, so one AND and one shift give two groups of 32 codes 0..15 in order. Group g dequantizes to
// d[g] * code + m[g] (d, m float16). Activations: per row and group of 32, a = da * qa with qa int8 in -127..127.
// dot(group) = d * da * sum(code * qa) + m * (da * sum(qa)): VNNI's vpdpbusd takes the codes as u8 and qa as s8.

// Activation row x [K] -> qa [K] int8, da [G] scales, sa [G] = da * sum(qa) (G = K / 32), rounding half to even.
static void quantize_activation(const float* x, int64_t K, int8_t* qa, float* da, float* sa) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* v = x + g * 32;
    __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(v)), a1 = _mm512_abs_ps(_mm512_loadu_ps(v + 16));
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    if (!std::isfinite(_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)))) amax = NAN;  // NaN/inf rows stay non-finite
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(v), vi), _MM_FROUND_TO_NEAREST_INT));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(v + 16), vi), _MM_FROUND_TO_NEAREST_INT));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
    q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
    _mm_storeu_si128((__m128i*)(qa + g * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(qa + g * 32 + 16), _mm512_cvtepi32_epi8(q1));
    da[g] = d;
    sa[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// The weights are packed for vertical dot products (quant_linear.pack_int4): output rows in blocks of 16, one 64-byte
// line per block and 8 inputs, whose 4 bytes at 4 * r hold row r's codes of inputs 8o..8o+3 in the low nibbles and
// 8o+4..8o+7 in the high ones. A line's low (or high) nibbles are then one vpdpbusd operand whose lane r meets the
// 4 activation bytes broadcast to every lane: 16 rows x 4 inputs per instruction, with no horizontal sums. The
// scales and minima are [blocks, groups, 16] float16, one 32-byte load per block and group.
// Each output element sums its groups in order, fma(sum_g, d * da, acc) then fma(m, sa, acc), whatever the number
// of rows, the tile or the thread: every batch size computes the same float result.
// BITS 8 (q8_linear): the same with one byte per code (0..255, quant_linear.pack_q8): a line holds 4 inputs of the
// 16 rows, 8 lines a group, one vpdpbusd each.
template <int T, int BITS = 4>
static inline void int4_tile(const uint8_t* wb, const uint16_t* db, const uint16_t* mb, int64_t G, const int8_t* qa,
                             const float* da, const float* sa, int64_t K, float* out, int64_t ldo, __mmask16 rows) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(db + g * 16)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mb + g * 16)));
    __m512i sum[T];
    for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_si512();
    if constexpr (BITS == 4) {
      const uint8_t* lines = wb + g * 4 * 64;
      prefetch_l1((const char*)(lines + 8 * 64));
      prefetch_l1((const char*)(lines + 12 * 64));
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const __m512i v = _mm512_loadu_si512((const void*)(lines + o * 64));
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int t = 0; t < T; ++t) {
          const int32_t* a = (const int32_t*)(qa + t * K + g * 32 + o * 8);
          sum[t] = _mm512_dpbusd_epi32(sum[t], lo, _mm512_set1_epi32(a[0]));
          sum[t] = _mm512_dpbusd_epi32(sum[t], hi, _mm512_set1_epi32(a[1]));
        }
      }
    } else {
      const uint8_t* lines = wb + g * 8 * 64;
      for (int o = 16; o < 24; o += 2) prefetch_l1((const char*)(lines + o * 64));
#pragma GCC unroll 8
      for (int o = 0; o < 8; ++o) {
        const __m512i v = _mm512_loadu_si512((const void*)(lines + o * 64));
        for (int t = 0; t < T; ++t)
          sum[t] = _mm512_dpbusd_epi32(sum[t], v, _mm512_set1_epi32(*(const int32_t*)(qa + t * K + g * 32 + o * 4)));
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t i = t * G + g;
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(d, _mm512_set1_ps(da[i])), acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sa[i]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * ldo, rows, acc[t]);
}

// out [M, N] fp32 = x [M, K] against 4-bit weights qw [ceil(N/16), K/8, 64] (uint8, the layout above), d and m
// [ceil(N/16), K/32, 16] (float16); K % 64 == 0. Blocks of 16 output rows are split across torch's threads; each
// thread runs its blocks against 8 activation rows at a time, the block's weights staying in L1 between them.
// BITS 8: q8_linear, qw [ceil(N/16), K/4, 64].
template <int BITS>
static void grouped_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m) {
  const Int4Call c(out, x, qw, d, m, quantize_activation, BITS);
  const int64_t M = c.M, K = c.K, N = c.N, NB = c.NB, G = c.G;
  const std::vector<int8_t>& qa = c.qa;
  const std::vector<float>&da = c.da, &sa = c.sa;
  const uint8_t* wp = c.wp;
  const uint16_t *dp = c.dp, *mp = c.mp;
  float* op = c.op;
  parallel_items(NB, [&](WorkQueue& q) {  // blocks taken as threads free up (parallel.h)
    for (int64_t b = q.take(); b >= 0; b = q.take()) {
      const uint8_t* wb = wp + b * (K * BITS / 32) * 64;
      const uint16_t* db = dp + b * G * 16;
      const uint16_t* mb = mp + b * G * 16;
      const int64_t n0 = b * 16;
      const __mmask16 rows = N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
      int64_t t = 0;
      for (; t + 8 <= M; t += 8)
        int4_tile<8, BITS>(wb, db, mb, G, qa.data() + t * K, da.data() + t * G, sa.data() + t * G, K, op + t * N + n0, N, rows);
      const int64_t left = M - t;
      const int8_t* a = qa.data() + t * K;
      const float *dt = da.data() + t * G, *st = sa.data() + t * G;
      float* o = op + t * N + n0;
      switch (left) {
        case 7: int4_tile<7, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        case 6: int4_tile<6, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        case 5: int4_tile<5, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        case 4: int4_tile<4, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        case 3: int4_tile<3, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        case 2: int4_tile<2, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        case 1: int4_tile<1, BITS>(wb, db, mb, G, a, dt, st, K, o, N, rows); break;
        default: break;
      }
    }
  });
}
#elif defined(KVCACHE_AVX2)
bool has_int4() { return true; }
// The same layout and the same math as the VNNI kernel above, in 256-bit registers: every output comes out
// bit-identical to it. vpdpbusd's u8 x s8 dot of 4 bytes is vpmaddubsw (pairs, as int16) then vpmaddwd by ones
// (pairs of pairs, as int32); a pair is at most 2 x 15 x 127 = 3,810, so a group's 8 of them per int16 lane (4
// lines, low and high nibbles) add up as int16 without overflow, and one vpmaddwd per group widens them.

// The sum of a group's 32 floats in _mm512_reduce_add_ps's order over (v[0..16) + v[16..32)), as the VNNI kernel's
// finiteness check sums them (b0..b3: the 4 vectors of 8).
static inline float sum32(__m256 b0, __m256 b1, __m256 b2, __m256 b3) {
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(b1, b3), _mm256_add_ps(b0, b2));
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
}

// Activation row x [K] -> qa [K] int8, da [G] scales, sa [G] = da * sum(qa) (G = K / 32), rounding half to even.
static void quantize_activation(const float* x, int64_t K, int8_t* qa, float* da, float* sa) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* v = x + g * 32;
    __m256 a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i));
    __m256 mx = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    if (!std::isfinite(sum32(a[0], a[1], a[2], a[3]))) amax = NAN;  // NaN/inf rows stay non-finite
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i q[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), vi),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      q[i] = _mm256_min_epi32(_mm256_max_epi32(q[i], lo), hi);
      total = _mm256_add_epi32(total, q[i]);
    }
    // int32 -> int8: the two packs interleave 128-bit lanes; the permutation puts the 8 dwords back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)(qa + g * 32), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
    da[g] = d;
    sa[g] = d * (float)_mm_cvtsi128_si32(t4);
  }
}

// T activation rows against half h of a block (its rows 8h..8h+7: bytes 32h..32h+31 of each 64-byte line, scales and
// minima 8h..8h+7 of each group), `rows` of them stored (1..8). Up to 4 rows a tile: T float sums and T int16 sums
// stay in the 16 ymm registers.
// BITS 8: one byte per code, 8 lines a group; a code is split into its nibbles, each multiplied as the 4-bit codes
// are (no int16 overflow: a group's 8 pairs per lane), and sum = lo + 16 hi in int32: VNNI's integer sums exactly.
template <int T, int BITS = 4>
static inline void int4_tile(const uint8_t* wb, const uint16_t* db, const uint16_t* mb, int64_t G, const int8_t* qa,
                             const float* da, const float* sa, int64_t K, float* out, int64_t ldo, int h, int rows) {
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(db + g * 16 + 8 * h)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mb + g * 16 + 8 * h)));
    __m256i sum[T], sum_hi[T];
    for (int t = 0; t < T; ++t) sum[t] = sum_hi[t] = _mm256_setzero_si256();
    if constexpr (BITS == 4) {
      const uint8_t* lines = wb + g * 4 * 64 + 32 * h;
      prefetch_l1((const char*)(lines + 8 * 64));
      prefetch_l1((const char*)(lines + 12 * 64));
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(lines + o * 64));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int t = 0; t < T; ++t) {
          const int32_t* a = (const int32_t*)(qa + t * K + g * 32 + o * 8);
          sum[t] = _mm256_add_epi16(sum[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a[0])),
                                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a[1]))));
          in_register(sum[t]);
        }
      }
    } else {
      const uint8_t* lines = wb + g * 8 * 64 + 32 * h;
      for (int o = 16; o < 24; o += 2) prefetch_l1((const char*)(lines + o * 64));
#pragma GCC unroll 8
      for (int o = 0; o < 8; ++o) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(lines + o * 64));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int t = 0; t < T; ++t) {
          const __m256i a = _mm256_set1_epi32(*(const int32_t*)(qa + t * K + g * 32 + o * 4));
          sum[t] = _mm256_add_epi16(sum[t], _mm256_maddubs_epi16(lo, a));
          sum_hi[t] = _mm256_add_epi16(sum_hi[t], _mm256_maddubs_epi16(hi, a));
          in_register(sum[t]);
          in_register(sum_hi[t]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const int64_t i = t * G + g;
      __m256i total = _mm256_madd_epi16(sum[t], ones);
      if constexpr (BITS == 8) total = _mm256_add_epi32(total, _mm256_slli_epi32(_mm256_madd_epi16(sum_hi[t], ones), 4));
      const __m256 s = _mm256_cvtepi32_ps(total);
      acc[t] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(da[i])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(sa[i]), acc[t]);
    }
  }
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int t = 0; t < T; ++t) _mm256_maskstore_ps(out + t * ldo + 8 * h, mask, acc[t]);
}

// out [M, N] fp32 = x [M, K] against 4-bit weights qw [ceil(N/16), K/8, 64], d and m [ceil(N/16), K/32, 16], as the
// VNNI int4_linear. Blocks of 16 output rows are split across torch's threads; each runs a block's two halves (a
// half past N skipped) against 4 activation rows at a time, the block's weights staying in L1 between them.
template <int BITS>
static void grouped_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m) {
  const Int4Call c(out, x, qw, d, m, quantize_activation, BITS);
  const int64_t M = c.M, K = c.K, N = c.N, NB = c.NB, G = c.G;
  const std::vector<int8_t>& qa = c.qa;
  const std::vector<float>&da = c.da, &sa = c.sa;
  const uint8_t* wp = c.wp;
  const uint16_t *dp = c.dp, *mp = c.mp;
  float* op = c.op;
  // Rows in chunks of about 96 KiB of int8 activations (L2), each chunk against all of a thread's blocks: without
  // them a prefill's activations (2,048 x 576 bytes and more) stream from L3 once per half-block.
  const int64_t chunk = std::max<int64_t>(16, (96 * 1024 / K) / 4 * 4);
  // work items: (chunk of rows, block), chunk by chunk, taken by the threads as they free up (parallel.h)
  parallel_each((M + chunk - 1) / chunk * NB, [&](int64_t item, int64_t) {
    const int64_t m0 = item / NB * chunk, b = item % NB, m1 = std::min(M, m0 + chunk);
    const uint8_t* wb = wp + b * (K * BITS / 32) * 64;
    const uint16_t* db = dp + b * G * 16;
    const uint16_t* mb = mp + b * G * 16;
    const int64_t n0 = b * 16;
    for (int h = 0; h < 2; ++h) {
      const int rows = (int)std::min<int64_t>(8, N - n0 - 8 * h);
      if (rows <= 0) break;
      int64_t t = m0;
      for (; t + 4 <= m1; t += 4)
        int4_tile<4, BITS>(wb, db, mb, G, qa.data() + t * K, da.data() + t * G, sa.data() + t * G, K, op + t * N + n0,
                           N, h, rows);
      const int8_t* a = qa.data() + t * K;
      const float *dt = da.data() + t * G, *st = sa.data() + t * G;
      float* o = op + t * N + n0;
      switch (m1 - t) {
        case 3: int4_tile<3, BITS>(wb, db, mb, G, a, dt, st, K, o, N, h, rows); break;
        case 2: int4_tile<2, BITS>(wb, db, mb, G, a, dt, st, K, o, N, h, rows); break;
        case 1: int4_tile<1, BITS>(wb, db, mb, G, a, dt, st, K, o, N, h, rows); break;
        default: break;
      }
    }
  });
}
#else
bool has_int4() { return true; }
// The same layout and the same math in plain C++: the integer sums of the vector kernels (exact), and their float
// steps in their order (std::fma, and the finiteness sum in _mm512_reduce_add_ps's order): every output is the VNNI
// kernel's, bit for bit.

// cvtps2dq's int32 of a float already rounded: the "integer indefinite" INT32_MIN for NaN and out of range
static inline int32_t to_int32(float r) {
  return std::isnan(r) || r >= 2147483648.f || r < -2147483648.f ? INT32_MIN : (int32_t)r;
}

// Activation row x [K] -> qa [K] int8, da [G] scales, sa [G] = da * sum(qa) (G = K / 32), rounding half to even.
static void quantize_activation(const float* x, int64_t K, int8_t* qa, float* da, float* sa) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* v = x + g * 32;
    float a[32], amax = 0.f;
    for (int i = 0; i < 32; ++i) {
      a[i] = std::fabs(v[i]);
      amax = std::max(amax, a[i]);
    }
    float s8[8], s4[4];  // sum32's tree: (b1 + b3) + (b0 + b2) over the 4 vectors of 8, then the halves, then pairs
    for (int j = 0; j < 8; ++j) s8[j] = (a[8 + j] + a[24 + j]) + (a[j] + a[16 + j]);
    for (int j = 0; j < 4; ++j) s4[j] = s8[4 + j] + s8[j];
    if (!std::isfinite((s4[0] + s4[2]) + (s4[1] + s4[3]))) amax = NAN;  // NaN/inf rows stay non-finite
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t total = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t q = std::min(127, std::max(-127, to_int32(std::nearbyint(v[i] * inv))));
      qa[g * 32 + i] = (int8_t)q;
      total += q;
    }
    da[g] = d;
    sa[g] = d * (float)total;
  }
}

// One block of 16 output rows (the `rows` first stored) against every activation row: per row and group, the
// integer sum of codes x qa, then fma(sum, d * da, acc) and fma(m, sa, acc), the groups in order
template <int BITS>
static void grouped_block(const uint8_t* wb, const uint16_t* db, const uint16_t* mb, int64_t G, const int8_t* qa,
                          const float* da, const float* sa, int64_t M, int64_t K, float* out, int64_t ldo, int rows) {
  for (int64_t t = 0; t < M; ++t)
    for (int r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* a = qa + t * K + g * 32;
        int32_t sum = 0;
        if constexpr (BITS == 4) {
          for (int o = 0; o < 4; ++o)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = wb[(g * 4 + o) * 64 + 4 * r + i];
              sum += (byte & 15) * a[o * 8 + i] + (byte >> 4) * a[o * 8 + 4 + i];
            }
        } else {
          for (int o = 0; o < 8; ++o)
            for (int i = 0; i < 4; ++i) sum += wb[(g * 8 + o) * 64 + 4 * r + i] * a[o * 4 + i];
        }
        const float d = (float)c10::Half(db[g * 16 + r], c10::Half::from_bits());
        const float m = (float)c10::Half(mb[g * 16 + r], c10::Half::from_bits());
        acc = std::fma((float)sum, d * da[t * G + g], acc);
        acc = std::fma(m, sa[t * G + g], acc);
      }
      out[t * ldo + r] = acc;
    }
}

template <int BITS>
static void grouped_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m) {
  const Int4Call c(out, x, qw, d, m, quantize_activation, BITS);
  parallel_items(c.NB, [&](WorkQueue& q) {  // blocks taken as threads free up (parallel.h)
    for (int64_t b = q.take(); b >= 0; b = q.take())
      grouped_block<BITS>(c.wp + b * (c.K * BITS / 32) * 64, c.dp + b * c.G * 16, c.mp + b * c.G * 16, c.G,
                          c.qa.data(), c.da.data(), c.sa.data(), c.M, c.K, c.op + b * 16, c.N,
                          (int)std::min<int64_t>(16, c.N - b * 16));
  });
}
#endif
void int4_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m) {
  grouped_linear<4>(out, x, qw, d, m);
}
void q8_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m) {
  grouped_linear<8>(out, x, qw, d, m);
}

}  // namespace kvcache
