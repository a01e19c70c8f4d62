"""C++ kernels for the model's CPU path, compiled on first use (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions), as the attention kernel is; where that fails the model keeps PyTorch's ops.

- `pack_panels`, `panel_linear`: the float32 linear layers' product, on weights packed in panels of 32 output
  channels (llama.py's Dense.pack; on 2 MiB pages where the OS gives them, native.huge_page_zeros); it streams the
  weights from memory faster than oneDNN's linear at decode's row counts, and each row's result does not depend on
  the rows beside it.
- `code_panel_linear`: panel_linear on a GGUF grid's codes (Q4_0/Q4_1 4-bit, Q8_0 8-bit, a float32 scale and minimum
  per 32 inputs) that decode to the float32 weights bit for bit: a step of up to code_rows() rows (8 with AVX-512)
  reads 0.75-1.25 bytes a weight instead of 4 and decodes them in registers (llama.py's Dense keeps both forms for
  such layers; EXACT_CODES).
- `int8_linear`: weight-only int8 matrix product (quant_linear.py).
- `int4_linear`: 4-bit weights (groups of 32 with a scale and a minimum, GGUF's Q4_1) times activations quantized to
  int8 per group of 32 on the fly (GGUF's Q8_1), multiplied with AVX512-VNNI's u8 x s8 dot product, as llama.cpp does
  (on AVX2, vpmaddubsw and vpmaddwd compute the same integer sums: the results are bit-identical).
- `add_rms_norm`: the residual sum and RMSNorm of a layer's input in one pass over each row (float32).
- `silu_mul`: SiLU(gate) x up of the MLP in one pass, with the floats ATen's silu and mul_ give (Sleef's exp, as ATen's).
- `gate_up_silu`: the float32 gate/up product with SiLU x up in its epilogue (pairs of gate and up panels), the floats
  of panel_linear then silu_mul without the [T, 2I] tensor between them (the MLP of 1,700 rows 1.7-2.8% faster).
- `rope_`: rotate-half RoPE of a step's query and key heads in place, in the q/k/v product's own buffer (float32).

- `argmax_finite`: the sampler's greedy ids and each row's finiteness in one pass over the logits.
- `attn_in` and `mlp`: a decoder layer's work around attention in two calls (RMSNorm, the q/k/v
  product and RoPE; the output projection, RMSNorm, gate/up, SiLU x up and down), for float32, int8 and int4 layers.
- `decode_layers`: a decode step's layers in one call (attn_in, the attention module's paged_decode, mlp in turn), for
  LlamaModel's decode-only steps: ~40 Python calls a layer less (single-stream decode 1.05-1.18x, a batch of 32 ~1.03x).

The vector kernels (int8_linear, int4_linear, argmax_finite) have an AVX-512 version, an AVX2 + FMA one (8 floats a
register) and, but for int4_linear, a plain C++ one: the build (-march=native) compiles the one the CPU has, so that
AVX2-only CPUs (many AMD EPYC and Ryzen, older Xeons) get every kernel too; the rest is ATen, oneDNN and `omp simd`.

A decode step of a small model is a few hundred tiny ops, and on one core their Python dispatch costs as much as
reading the weights (measured on the demo model: ~3 ms of ~13 ms per token); each of these replaces several of them.
"""
from __future__ import annotations

from kvcache import native

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <math.h>
#include <cmath>
#include <vector>
#include <cstring>
#include <sleef.h>

// ---- int8 weights (quant_linear.Int8Dense): int8_channels per instruction set, as the compiler sees it ----
// Each computes out[m, n] for every row m and the output channels n in [begin, end) of int8_linear below. A product
// sums in the same order whatever rows are beside it (the same chain of 16 or 8 wide FMAs over k, then the tail):
// a batch-invariant layer gives each row what it gives it alone. The tails' FMAs are written out (std::fma): left to
// contraction, GCC's tuning for AMD Zen 4 (avoid_fma_chains) split some instantiations' chains into a multiply and an
// add and not others, so a row's tail rounded differently in a tile of 4 than alone.
#if defined(__AVX512F__)
// R activation rows against one int8 weight row: the weights are widened once per 16 and used R times.
template <int R>
static inline void dot_rows(const float* x, int64_t K, const int8_t* w, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + k))));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(acc[r]);
    for (int64_t j = k; j < K; ++j) s = std::fma((float)w[j], x[r * K + j], s);  // explicit: see above
    out[r] = s;
  }
}

static void int8_channels(const float* xp, int64_t M, int64_t K, const int8_t* wp, const float* sp, float* op,
                          int64_t N, int64_t begin, int64_t end) {
  float o[8];
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = wp + n * K;
    const float s = sp[n];
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) { dot_rows<8>(xp + m * K, K, row, o); for (int r = 0; r < 8; ++r) op[(m + r) * N + n] = o[r] * s; }
    for (; m + 4 <= M; m += 4) { dot_rows<4>(xp + m * K, K, row, o); for (int r = 0; r < 4; ++r) op[(m + r) * N + n] = o[r] * s; }
    for (; m < M; ++m) { dot_rows<1>(xp + m * K, K, row, o); op[m * N + n] = o[0] * s; }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The sum of a vector's 8 floats.
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R activation rows against C int8 weight rows (w, w + K, ...): out [R, C]. The weights are widened once per 8 and
// used R times. C = 2 gives a single row two FMA chains in flight: one would wait on the FMA's latency (measured on
// a 576 x 1,536 layer, one row: 0.13 ms against 0.22), while each product keeps its own chain, in order.
template <int R, int C>
static inline void dot_tile(const float* x, int64_t K, const int8_t* w, float* out) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c)
      wv[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + c * K + k))));
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = hsum8(acc[r][c]);
      for (int64_t j = k; j < K; ++j) s = std::fma((float)w[c * K + j], x[r * K + j], s);
      out[r * C + c] = s;
    }
}

// One tile, scaled per channel (s [C]) into o [R rows of stride N, C columns].
template <int R, int C>
static inline void int8_tile(const float* x, int64_t K, const int8_t* w, const float* s, float* o, int64_t N) {
  float t[R * C];
  dot_tile<R, C>(x, K, w, t);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r * N + c] = t[r * C + c] * s[c];
}

// Every row against C channels: 8 x 1 tiles while 8 rows remain (8 chains, 8 of the 16 ymm registers), then
// 4 x C, 2 x C and 1 x C.
template <int C>
static inline void int8_columns(const float* xp, int64_t M, int64_t K, const int8_t* w, const float* s, float* o,
                                int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8)
    for (int c = 0; c < C; ++c) int8_tile<8, 1>(xp + m * K, K, w + c * K, s + c, o + m * N + c, N);
  for (; m + 4 <= M; m += 4) int8_tile<4, C>(xp + m * K, K, w, s, o + m * N, N);
  for (; m + 2 <= M; m += 2) int8_tile<2, C>(xp + m * K, K, w, s, o + m * N, N);
  for (; m < M; ++m) int8_tile<1, C>(xp + m * K, K, w, s, o + m * N, N);
}

static void int8_channels(const float* xp, int64_t M, int64_t K, const int8_t* wp, const float* sp, float* op,
                          int64_t N, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + 2 <= end; n += 2) int8_columns<2>(xp, M, K, wp + n * K, sp + n, op + n, N);
  if (n < end) int8_columns<1>(xp, M, K, wp + n * K, sp + n, op + n, N);
}
#else
// Plain C++ (the compiler vectorizes what it can).
static void int8_channels(const float* xp, int64_t M, int64_t K, const int8_t* wp, const float* sp, float* op,
                          int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += wp[n * K + k] * xp[m * K + k];
      op[m * N + n] = s * sp[n];
    }
}
#endif

// out [M, N] fp32 = (x [M, K] fp32) (w [N, K] int8)^T * scale [N]; output channels split across torch's threads.
void int8_linear(torch::Tensor out, torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous() && w.size(1) == K && scale.numel() == N &&
              out.size(0) == M && out.size(1) == N, "int8_linear: bad shapes or strides");
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { int8_channels(xp, M, K, wp, sp, op, N, begin, end); });
}

// ---- 4-bit weights x int8 activations (quant_linear.Int4Dense) ----
// One int4_linear call's checked shapes, its activations quantized by `quantize` (per row: qa [K] int8, da [K/32]
// scales, sa [K/32] = da * sum(qa)) and its raw pointers; shared by the VNNI and the AVX2 kernels.
struct Int4Call {
  using Quantize = void (*)(const float*, int64_t, int8_t*, float*, float*);
  int64_t M, K, N, NB, G;
  std::vector<int8_t> qa;
  std::vector<float> da, sa;
  const uint8_t* wp;
  const uint16_t *dp, *mp;
  float* op;
  Int4Call(torch::Tensor out, torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m, Quantize quantize,
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

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
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
      _mm_prefetch((const char*)(lines + 8 * 64), _MM_HINT_T0);
      _mm_prefetch((const char*)(lines + 12 * 64), _MM_HINT_T0);
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
      for (int o = 16; o < 24; o += 2) _mm_prefetch((const char*)(lines + o * 64), _MM_HINT_T0);
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
static void grouped_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m) {
  const Int4Call c(out, x, qw, d, m, quantize_activation, BITS);
  const int64_t M = c.M, K = c.K, N = c.N, NB = c.NB, G = c.G;
  const std::vector<int8_t>& qa = c.qa;
  const std::vector<float>&da = c.da, &sa = c.sa;
  const uint8_t* wp = c.wp;
  const uint16_t *dp = c.dp, *mp = c.mp;
  float* op = c.op;
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
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
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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
      _mm_prefetch((const char*)(lines + 8 * 64), _MM_HINT_T0);
      _mm_prefetch((const char*)(lines + 12 * 64), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int o = 0; o < 4; ++o) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(lines + o * 64));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int t = 0; t < T; ++t) {
          const int32_t* a = (const int32_t*)(qa + t * K + g * 32 + o * 8);
          sum[t] = _mm256_add_epi16(sum[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a[0])),
                                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a[1]))));
        }
      }
    } else {
      const uint8_t* lines = wb + g * 8 * 64 + 32 * h;
      for (int o = 16; o < 24; o += 2) _mm_prefetch((const char*)(lines + o * 64), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int o = 0; o < 8; ++o) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(lines + o * 64));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int t = 0; t < T; ++t) {
          const __m256i a = _mm256_set1_epi32(*(const int32_t*)(qa + t * K + g * 32 + o * 4));
          sum[t] = _mm256_add_epi16(sum[t], _mm256_maddubs_epi16(lo, a));
          sum_hi[t] = _mm256_add_epi16(sum_hi[t], _mm256_maddubs_epi16(hi, a));
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
static void grouped_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m) {
  const Int4Call c(out, x, qw, d, m, quantize_activation, BITS);
  const int64_t M = c.M, K = c.K, N = c.N, NB = c.NB, G = c.G;
  const std::vector<int8_t>& qa = c.qa;
  const std::vector<float>&da = c.da, &sa = c.sa;
  const uint8_t* wp = c.wp;
  const uint16_t *dp = c.dp, *mp = c.mp;
  float* op = c.op;
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* wb = wp + b * (K * BITS / 32) * 64;
      const uint16_t* db = dp + b * G * 16;
      const uint16_t* mb = mp + b * G * 16;
      const int64_t n0 = b * 16;
      for (int h = 0; h < 2; ++h) {
        const int rows = (int)std::min<int64_t>(8, N - n0 - 8 * h);
        if (rows <= 0) break;
        int64_t t = 0;
        for (; t + 4 <= M; t += 4)
          int4_tile<4, BITS>(wb, db, mb, G, qa.data() + t * K, da.data() + t * G, sa.data() + t * G, K, op + t * N + n0, N,
                       h, rows);
        const int8_t* a = qa.data() + t * K;
        const float *dt = da.data() + t * G, *st = sa.data() + t * G;
        float* o = op + t * N + n0;
        switch (M - t) {
          case 3: int4_tile<3, BITS>(wb, db, mb, G, a, dt, st, K, o, N, h, rows); break;
          case 2: int4_tile<2, BITS>(wb, db, mb, G, a, dt, st, K, o, N, h, rows); break;
          case 1: int4_tile<1, BITS>(wb, db, mb, G, a, dt, st, K, o, N, h, rows); break;
          default: break;
        }
      }
    }
  });
}
#else  // no AVX512-VNNI or AVX2 here: Int4Dense dequantizes and uses PyTorch's matmul
bool has_int4() { return false; }
template <int BITS>
static void grouped_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, BITS == 4 ? "int4_linear" : "q8_linear", " needs AVX512-VNNI or AVX2");
}
#endif
void int4_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m) {
  grouped_linear<4>(out, x, qw, d, m);
}
void q8_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m) {
  grouped_linear<8>(out, x, qw, d, m);
}

// residual[t] += x[t] (skipped when x is undefined); out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * w.
void add_rms_norm(torch::Tensor out, torch::Tensor residual, c10::optional<torch::Tensor> x, torch::Tensor w,
                  double eps) {
  const int64_t T = residual.size(0), D = residual.size(1);
  TORCH_CHECK(residual.is_contiguous() && out.is_contiguous() && out.sizes() == residual.sizes() && w.numel() == D &&
              (!x.has_value() || (x->is_contiguous() && x->sizes() == residual.sizes())), "add_rms_norm: bad shapes");
  float* rp = residual.data_ptr<float>();
  const float* xp = x.has_value() ? x->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * D;
      float ss = 0.f;
      if (xp) {
        const float* xr = xp + t * D;
        #pragma omp simd reduction(+:ss)
        for (int64_t d = 0; d < D; ++d) { r[d] += xr[d]; ss += r[d] * r[d]; }
      } else {
        #pragma omp simd reduction(+:ss)
        for (int64_t d = 0; d < D; ++d) ss += r[d] * r[d];
      }
      const float inv = 1.f / sqrtf(ss / D + (float)eps);
      float* o = op + t * D;
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = r[d] * inv * wp[d];
    }
  });
}

// x [T, heads, D] (any row stride, heads contiguous by D): x = x * cos + rotate_half(x) * sin, cos/sin [T, D].
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const int64_t T = x.size(0), Hn = x.size(1), D = x.size(2), half = D / 2, stride = x.stride(0);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == D && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == T * D && sin.numel() == T * D, "rope_: x must be [T, heads, D] with heads packed by D "
              "and cos/sin [T, D]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < Hn; ++h) {
        float* v = xp + t * stride + h * D;
        #pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// ---- float32 weights in panels (llama.py's Dense.pack) ----
// W [N, K] is held as panels [ceil(N / 32)][K][32] (the last one zero-padded): panel p is output channels
// 32p .. 32p + 31, and the 32 weights that one input k meets in it are one contiguous 128 bytes, so a panel is read
// as one sequential stream (the hardware prefetcher's best case) while the rows of x are multiplied against it. Each
// output is a chain of FMAs from zero over each PANEL_CHUNK inputs in turn, and those chunks' sums added in order
// (rounding error grows with K / 128 + 128 instead of K), whatever the instruction set and whatever rows share the
// call: a row's result is what it is alone (batch-invariant) and bit-identical across the builds.
// Measured on 2 Zen 4 cores, weights streamed from DRAM as in a decode step, against oneDNN's linear on its own
// packed weights: 150-205 GFLOP/s against 97-122 at 8 rows, 206-226 against 182-201 at 64, both 218-228 at 2,048
// (`kvcache bench linear`).
constexpr int64_t PANEL = 32, PANEL_CHUNK = 128, PANEL_X_BYTES = 512 << 10;

// Lines of the next panel read ahead while this one is multiplied: `lines` cache lines from `at`, spread evenly over
// a call's K inputs (tick once per input: K ticks issue exactly `lines`). With 3-8 row blocks a panel (17-64 rows in
// AVX-512's blocks of 8, 13-48 in AVX2's of 6), a panel's first row block had waited on DRAM while the others ran
// from cache; with the next panel's lines shared out among this panel's blocks, the weights stream in under the
// arithmetic. Measured with AVX-512 (the demo's layers from DRAM, 2 Zen 4 cores): 24-32 rows 1.06-1.09x, 48-64 rows
// 1.02-1.04x. At 1-16 rows (memory-bound; the hardware prefetcher keeps up) it was 0.88-0.96x, and into L2 only
// (_MM_HINT_T1) 0.94-0.98x: neither is done. Each block gets a share in proportion to its rows: with equal shares a
// last block of 1-2 rows issued a quarter of the lines in a tenth of the time (the MLP's GEMMs at 23 rows: 165 ->
// 204 GFLOP/s, 26 rows 187 -> 203, with the 7-row fix in panel_rows).
struct PanelAhead {
  const char* at = nullptr;
  int64_t lines = 0, K = 1, due = 0;
  inline void tick() {
    for (due += lines; due >= K; due -= K, at += 64) _mm_prefetch(at, _MM_HINT_T0);
  }
};

// out [ceil(N / 32), K, 32] = w [N, K] in panels, the last one's missing outputs zero; w may be strided (a
// transposed view of a [K, N] weight is read as it is, with no copy)
void pack_panels(torch::Tensor w, torch::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_panels: w must be a float32 [N, K] matrix on the CPU");
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL, sn = w.stride(0), sk = w.stride(1);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 3 &&
              out.size(0) == P && out.size(1) == K && out.size(2) == PANEL,
              "pack_panels: out must be a contiguous float32 [", P, ", ", K, ", ", PANEL, "] tensor on the CPU");
  const float* s = w.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < PANEL; ++j)
          d[(p * K + k) * PANEL + j] = p * PANEL + j < N ? s[(p * PANEL + j) * sn + k * sk] : 0.f;
  });
}

#if defined(__AVX512F__)
// 8 rows x 2 vectors of accumulators, their chunks' sums, 2 of weights and a broadcast (12 rows: 1-3% slower at
// 2,048 rows, where the sums spill; 6: slower at 8)
constexpr int PANEL_ROWS = 8;
// A tile's pieces, which panel_rows and code_tile share (so both give the same floats): one input's FMAs into MR
// rows' accumulators, a chunk's chains added to the sums in order, and the sums' first cols <= 32 stored
template <int MR>
static inline void tile_fma(const float* x, int64_t ldx, int64_t k, __m512 w0, __m512 w1, __m512 (&acc)[MR][2]) {
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
    acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
  }
}

template <int MR>
static inline void tile_sum(bool first, __m512 (&acc)[MR][2], float (&sum)[MR][2][16]) {
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h)
      _mm512_store_ps(sum[r][h], first ? acc[r][h] : _mm512_add_ps(_mm512_load_ps(sum[r][h]), acc[r][h]));
}

// the lanes of a panel's two vectors that hold its first cols <= 32 outputs
static inline void tile_masks(int64_t cols, __mmask16& m0, __mmask16& m1) {
  m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
}

template <int MR>
static inline void tile_store(float (&sum)[MR][2][16], float* out, int64_t ldo, int64_t cols) {
  __mmask16 m0, m1;
  tile_masks(cols, m0, m1);
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, _mm512_load_ps(sum[r][0]));
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, _mm512_load_ps(sum[r][1]));
  }
}

// out [MR, cols] (row stride ldo) = x [MR, K] (row stride ldx) times panel w [K][32]; cols <= 32 are stored
template <int MR>
static inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                              int64_t cols, const PanelAhead& ahead_) {
  // a local copy the compiler keeps in registers: a struct passed by value was stored field by field and read back
  // as one vector, a store-forwarding stall per call (half the samples of panels_linear's own code)
  PanelAhead ahead = ahead_;
  __m512 acc[MR][2];
  alignas(64) float sum[MR][2][16];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = k0; k < std::min(K, k0 + PANEL_CHUNK); ++k) {
      ahead.tick();
      tile_fma<MR>(x, ldx, k, _mm512_loadu_ps(w + k * PANEL), _mm512_loadu_ps(w + k * PANEL + 16), acc);
    }
    tile_sum<MR>(k0 == 0, acc, sum);  // the chunks' sums in order
    // At 7 rows GCC kept the 28 sums in registers and moved the two weight vectors to the stack instead, reloading
    // them for every FMA (105 GFLOP/s against 220 at 6 and 8 rows, from cache): the barrier keeps the sums in
    // memory. At 8 rows it cost 6% (the compiler's own choice, spilling sums, is better there), so 7 only.
    if constexpr (MR == 7) asm volatile("" : : "r"(&sum[0][0][0]) : "memory");
  }
  tile_store<MR>(sum, out, ldo, cols);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int PANEL_ROWS = 6;  // per half panel: 6 rows x 2 vectors of accumulators, 2 of weights, a broadcast: 15 of 16
template <int MR>
static inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                              int64_t cols, const PanelAhead& ahead_) {
  PanelAhead ahead = ahead_;  // (as above)
  for (int64_t half = 0; half < 2 && half * 16 < cols; ++half) {
    const float* wh = w + half * 16;
    __m256 acc[MR][2], sum[MR][2];
    for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
      for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t k = k0; k < std::min(K, k0 + PANEL_CHUNK); ++k) {
        if (half == 0) ahead.tick();  // the panel's lines over the first half's K inputs
        const __m256 w0 = _mm256_loadu_ps(wh + k * PANEL), w1 = _mm256_loadu_ps(wh + k * PANEL + 8);
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
          const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
          acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < 2; ++h) sum[r][h] = k0 == 0 ? acc[r][h] : _mm256_add_ps(sum[r][h], acc[r][h]);
    }
    const int64_t n = std::min<int64_t>(16, cols - half * 16);
    for (int r = 0; r < MR; ++r) {
      alignas(32) float t[16];
      _mm256_store_ps(t, sum[r][0]);
      _mm256_store_ps(t + 8, sum[r][1]);
      std::memcpy(out + r * ldo + half * 16, t, n * sizeof(float));
    }
  }
}
#else
constexpr int PANEL_ROWS = 4;
template <int MR>
static inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                              int64_t cols, const PanelAhead&) {
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float sum = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {  // the vector paths' chains and sums
        float s = 0.f;
        for (int64_t k = k0; k < std::min(K, k0 + PANEL_CHUNK); ++k) s = std::fma(x[r * ldx + k], w[k * PANEL + j], s);
        sum = k0 == 0 ? s : sum + s;
      }
      out[r * ldo + j] = sum;
    }
}
#endif

// panel_rows<m> for a run-time m <= MR
template <int MR>
static inline void panel_block(int64_t m, const float* x, int64_t ldx, const float* w, int64_t K, float* out,
                               int64_t ldo, int64_t cols, const PanelAhead& ahead) {
  if constexpr (MR > 1) {
    if (m < MR) return panel_block<MR - 1>(m, x, ldx, w, K, out, ldo, cols, ahead);
  }
  panel_rows<MR>(x, ldx, w, K, out, ldo, cols, ahead);
}

// rows [0, rows) of x (row stride K) times panel w into out (row stride ldo; cols <= 32 stored), in row blocks of
// PANEL_ROWS, reading the panel `next` (the thread's next one, or nullptr) ahead: its lines shared out among the
// blocks in proportion to their rows (PanelAhead)
static inline void panel_pass(const float* x, int64_t K, int64_t rows, const float* w, const float* next, float* out,
                              int64_t ldo, int64_t cols) {
  const int64_t blocks = (rows + PANEL_ROWS - 1) / PANEL_ROWS, lines = K * PANEL * 4 / 64;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t m0 = i * PANEL_ROWS, l0 = lines * m0 / rows, l1 = lines * std::min(rows, m0 + PANEL_ROWS) / rows;
    PanelAhead ahead;
    if (next != nullptr && blocks >= 3 && blocks <= 8) ahead = {(const char*)next + l0 * 64, l1 - l0, K, 0};
    panel_block<PANEL_ROWS>(std::min<int64_t>(PANEL_ROWS, rows - m0), x + m0 * K, K, w, K, out + m0 * ldo, ldo, cols,
                            ahead);
  }
}

// Rows of x per pass over a thread's panels: about PANEL_X_BYTES of x, which stay in the core's cache while its
// panels pass (a multiple of PANEL_ROWS)
static inline int64_t panel_chunk(int64_t K) {
  return std::max<int64_t>(1, PANEL_X_BYTES / (K * 4) / PANEL_ROWS) * PANEL_ROWS;
}

static void check_panels(const torch::Tensor& x, const torch::Tensor& wp, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && wp.is_contiguous() && wp.dim() == 3 &&
              x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && wp.size(1) == x.size(1) &&
              wp.size(2) == PANEL, what, ": x [M, K] and panels [P, K, 32] must be contiguous float32; got x ",
              x.sizes(), " and panels ", wp.sizes());
}

// A linear layer's weights in panels of 32 outputs: float32 ([P, K, 32], pack_panels), or codes that give those very
// floats (llama.py's Dense.pack, where a layer's weights are a GGUF grid's: Q4_0/Q4_1, Q8_0): weight = scale x code
// + minimum with codes [P, K, 16] of 4 bits (byte j: output j in its low half, j + 16 in its high) or [P, K, 32] of 8,
// scale and minimum [P, K / 32, 32] float32 per group of 32 inputs. The scale is a float16 and a code has at most 8
// bits, so the product is exact and the sum rounds once, as it did when the checkpoint was dequantized: the float32
// weights bit for bit, from 0.75 (4 bits) or 1.25 (8 bits) bytes a weight read from memory instead of 4.
struct Panels {
  const float* w = nullptr;  // float32 panels, or null for codes
  const uint8_t* codes = nullptr;
  const float *scale = nullptr, *minimum = nullptr;
  int64_t P = 0, K = 0, bits = 32;

  // panel p as float32 [K, 32]: the packed one, or its codes decoded into buf [K * 32]
  const float* get(int64_t p, float* buf) const {
    if (w != nullptr) return w + p * K * PANEL;
    if (bits == 4) decode<4>(p, buf);
    else decode<8>(p, buf);
    return buf;
  }
  template <int BITS>
  void decode(int64_t p, float* buf) const {
    typedef float f16v __attribute__((vector_size(64), aligned(4)));
    typedef uint8_t b16v __attribute__((vector_size(16), aligned(1)));
    typedef int32_t i16v __attribute__((vector_size(64), aligned(4)));
    // bytes -> int32 -> float: GCC lowers a direct byte-to-float conversion one element at a time
    auto widen = [](b16v b) { return __builtin_convertvector(__builtin_convertvector(b, i16v), f16v); };
    constexpr int64_t ROW = BITS == 4 ? 16 : PANEL;  // bytes of codes per input
    const int64_t G = K / PANEL;
    const uint8_t* c = codes + p * K * ROW;
    for (int64_t g = 0; g < G; ++g) {
      const float *s = scale + (p * G + g) * PANEL, *mn = minimum + (p * G + g) * PANEL;
      const f16v s0 = *(const f16v*)s, s1 = *(const f16v*)(s + 16), m0 = *(const f16v*)mn, m1 = *(const f16v*)(mn + 16);
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        f16v* o = (f16v*)(buf + k * PANEL);
        const b16v b = *(const b16v*)(c + k * ROW);
        if constexpr (BITS == 4) {
          o[0] = s0 * widen(b & 15) + m0;
          o[1] = s1 * widen(b >> 4) + m1;
        } else {
          o[0] = s0 * widen(b) + m0;
          o[1] = s1 * widen(*(const b16v*)(c + k * ROW + 16)) + m1;
        }
      }
    }
  }
  // the panel to read ahead after p, among a thread's panels [.., end): float32 ones only
  const float* ahead(int64_t p, int64_t end) const {
    return w != nullptr && p + 1 < end ? w + (p + 1) * K * PANEL : nullptr;
  }
  int64_t buffer() const { return w != nullptr ? 0 : K * PANEL; }  // floats get's buf needs
};

static Panels f32_panels(const torch::Tensor& wp) {
  Panels c;
  c.w = wp.data_ptr<float>();
  c.P = wp.size(0);
  c.K = wp.size(1);
  return c;
}

static Panels code_panels(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                          const torch::Tensor& minimum, const char* what) {
  const int64_t K = x.size(1), P = codes.size(0), G = K / PANEL;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && codes.is_contiguous() &&
              codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(1) == K && K % PANEL == 0 &&
              (codes.size(2) == 16 || codes.size(2) == PANEL) && scale.is_contiguous() && minimum.is_contiguous() &&
              scale.scalar_type() == at::kFloat && minimum.scalar_type() == at::kFloat &&
              scale.sizes() == minimum.sizes() && scale.dim() == 3 && scale.size(0) == P && scale.size(1) == G &&
              scale.size(2) == PANEL, what, ": x [M, K] float32 (K a multiple of 32), codes [P, K, 16 or 32] uint8, "
              "scale and minimum [P, K / 32, 32] float32, contiguous; got x ", x.sizes(), ", codes ", codes.sizes(),
              ", scale ", scale.sizes(), ", minimum ", minimum.sizes());
  Panels c;
  c.codes = codes.data_ptr<uint8_t>();
  c.scale = scale.data_ptr<float>();
  c.minimum = minimum.data_ptr<float>();
  c.P = P;
  c.K = K;
  c.bits = codes.size(2) == 16 ? 4 : 8;
  return c;
}

// out [M, N] = x [M, K] W^T for W in panels; the panels are split across torch's threads, and each thread runs all
// of x's rows against one panel (read once from memory, then from its cache) before the next.
#if defined(__AVX512F__)
// Code panel p's weights for input k, decoded in registers (Panels::decode's floats)
template <int BITS>
static inline void code_weights(const Panels& w, int64_t p, int64_t k, __m512 s0, __m512 s1, __m512 m0, __m512 m1,
                                __m512& w0, __m512& w1) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(w.codes + (p * w.K + k) * 16));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    w0 = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m0);
    w1 = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m1);
  } else {
    const uint8_t* c = w.codes + (p * w.K + k) * PANEL;
    w0 = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c))), m0);
    w1 = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + 16)))), m1);
  }
}

// One row x [K] times code panels p[0] and p[1] (p[1] < 0: p[0] only) into out[i] (cols[i] <= 32 of them): the
// floats of panel_rows<1> on their decoded panels (the chunks' chains and sums in the same order), the weights decoded
// in registers. One row's one chain per output waits on each FMA's latency (~28 GFLOP/s on 2 cores, the codes' speed
// at one row through a decoded buffer); two panels' four chains side by side keep the FMA unit busy.
template <int BITS>
static void code_row(const Panels& w, const int64_t p[2], const float* x, float* const out[2], const int64_t cols[2]) {
  const bool two = p[1] >= 0;
  const int64_t K = w.K, G = K / PANEL;
  __m512 acc[2][2], sum[2][2];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int i = 0; i < 2; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t g = k0 / PANEL; g < std::min(K, k0 + PANEL_CHUNK) / PANEL; ++g) {
      __m512 sv[2][2], mv[2][2];
      for (int i = 0; i < 2; ++i) {
        const int64_t q = p[two ? i : 0];
        for (int h = 0; h < 2; ++h) {
          sv[i][h] = _mm512_loadu_ps(w.scale + (q * G + g) * PANEL + 16 * h);
          mv[i][h] = _mm512_loadu_ps(w.minimum + (q * G + g) * PANEL + 16 * h);
        }
      }
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        const __m512 a = _mm512_set1_ps(x[k]);
        for (int i = 0; i < 2; ++i) {
          __m512 w0, w1;
          code_weights<BITS>(w, p[two ? i : 0], k, sv[i][0], sv[i][1], mv[i][0], mv[i][1], w0, w1);
          acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
        }
      }
    }
    for (int i = 0; i < 2; ++i)
      for (int h = 0; h < 2; ++h) sum[i][h] = k0 == 0 ? acc[i][h] : _mm512_add_ps(sum[i][h], acc[i][h]);
  }
  for (int i = 0; i < (two ? 2 : 1); ++i) {
    __mmask16 m0, m1;
    tile_masks(cols[i], m0, m1);
    _mm512_mask_storeu_ps(out[i], m0, sum[i][0]);
    _mm512_mask_storeu_ps(out[i] + 16, m1, sum[i][1]);
  }
}

// MR rows of x (row stride ldx) times code panel p into out (row stride ldo, cols <= 32 stored): panel_rows<MR>'s
// floats on the decoded panel, the weights decoded in registers once per input for all MR rows
template <int BITS, int MR>
static inline void code_tile(const Panels& w, int64_t p, const float* x, int64_t ldx, float* out, int64_t ldo,
                             int64_t cols) {
  const int64_t K = w.K, G = K / PANEL;
  __m512 acc[MR][2];
  alignas(64) float sum[MR][2][16];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = k0 / PANEL; g < std::min(K, k0 + PANEL_CHUNK) / PANEL; ++g) {
      const float *sp = w.scale + (p * G + g) * PANEL, *mp = w.minimum + (p * G + g) * PANEL;
      const __m512 s0 = _mm512_loadu_ps(sp), s1 = _mm512_loadu_ps(sp + 16);
      const __m512 m0 = _mm512_loadu_ps(mp), m1 = _mm512_loadu_ps(mp + 16);
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        __m512 w0, w1;
        code_weights<BITS>(w, p, k, s0, s1, m0, m1, w0, w1);
        tile_fma<MR>(x, ldx, k, w0, w1, acc);
      }
    }
    tile_sum<MR>(k0 == 0, acc, sum);
  }
  tile_store<MR>(sum, out, ldo, cols);
}

template <int BITS, int MR>
static inline void code_block(int64_t m, const Panels& w, int64_t p, const float* x, int64_t ldx, float* out,
                              int64_t ldo, int64_t cols) {
  if constexpr (MR > 1) {
    if (m < MR) return code_block<BITS, MR - 1>(m, w, p, x, ldx, out, ldo, cols);
  }
  code_tile<BITS, MR>(w, p, x, ldx, out, ldo, cols);
}

// rows [0, rows) of x (row stride K) times code panel p, in blocks of PANEL_ROWS rows
static void code_pass(const Panels& w, int64_t p, const float* x, int64_t rows, float* out, int64_t ldo, int64_t cols) {
  for (int64_t m0 = 0; m0 < rows; m0 += PANEL_ROWS) {
    const int64_t m = std::min<int64_t>(PANEL_ROWS, rows - m0);
    if (w.bits == 4) code_block<4, PANEL_ROWS>(m, w, p, x + m0 * w.K, w.K, out + m0 * ldo, ldo, cols);
    else code_block<8, PANEL_ROWS>(m, w, p, x + m0 * w.K, w.K, out + m0 * ldo, ldo, cols);
  }
}

// code_row<w.bits>
static void code_row(const Panels& w, const int64_t p[2], const float* x, float* const out[2], const int64_t cols[2]) {
  if (w.bits == 4) code_row<4>(w, p, x, out, cols);
  else code_row<8>(w, p, x, out, cols);
}

// code_row of panels p0 and p1 (-1: none) at their columns of a row of N outputs
static void code_row(const Panels& w, int64_t p0, int64_t p1, const float* x, float* row, int64_t N) {
  const int64_t p[2] = {p0, p1};
  const int64_t cols[2] = {std::min(PANEL, N - p0 * PANEL), p1 < 0 ? 0 : std::min(PANEL, N - p1 * PANEL)};
  float* const out[2] = {row + p0 * PANEL, row + std::max<int64_t>(p1, 0) * PANEL};
  code_row(w, p, x, out, cols);
}
#endif

static void panels_linear(torch::Tensor out, const torch::Tensor& x, const Panels& w, const char* what) {
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) &&
              out.size(1) <= w.P * PANEL && out.size(1) > (w.P - 1) * PANEL,
              what, ": out [M, N] must be contiguous float32 with 32 (P - 1) < N <= 32 P");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), chunk = panel_chunk(K);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(__AVX512F__)
  if (M == 1 && w.w == nullptr) {  // one row: the codes decoded in registers, two panels at a time
    at::parallel_for(0, (w.P + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) code_row(w, 2 * i, 2 * i + 1 < w.P ? 2 * i + 1 : -1, xp, op, N);
    });
    return;
  }
  if (w.w == nullptr) {  // more rows: blocks of PANEL_ROWS, the codes decoded in registers once per input and block
    at::parallel_for(0, w.P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c0 = 0; c0 < M; c0 += chunk)
        for (int64_t p = begin; p < end; ++p)
          code_pass(w, p, xp + c0 * K, std::min(M, c0 + chunk) - c0, op + c0 * N + p * PANEL, N,
                    std::min(PANEL, N - p * PANEL));
    });
    return;
  }
#endif
  at::parallel_for(0, w.P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(w.buffer());
    for (int64_t c0 = 0; c0 < M; c0 += chunk)
      for (int64_t p = begin; p < end; ++p)
        panel_pass(xp + c0 * K, K, std::min(M, c0 + chunk) - c0, w.get(p, buf.data()), w.ahead(p, end),
                   op + c0 * N + p * PANEL, N, std::min(PANEL, N - p * PANEL));
  });
}

void panel_linear(torch::Tensor out, torch::Tensor x, torch::Tensor wp) {
  check_panels(x, wp, "panel_linear");
  panels_linear(out, x, f32_panels(wp), "panel_linear");
}

// panel_linear on code panels (Panels): the floats panel_linear gives on the float32 panels they decode to
void code_panel_linear(torch::Tensor out, torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                       torch::Tensor minimum) {
  panels_linear(out, x, code_panels(x, codes, scale, minimum, "code_panel_linear"), "code_panel_linear");
}

// Steps of at most this many rows take a layer's code panels where it has them: with the codes decoded in registers
// (AVX-512), measured on a 576 x 1,536 layer from memory (2 Zen 4 cores), against the float32 panels in two runs:
// 2.97-2.99x at 1 row, 2.8-3.2x at 2, 1.8-2.0x at 4, 1.17-1.29x at 8, 0.93-1.09x at 16, 0.79-0.82x from 32 (where the
// arithmetic bounds both, and decoding adds to it; decoding a chunk of the panel into L1 once for every row block
// instead gave 0.85x at 32 rows, 0.91x at 64, 0.95x at 256). Without AVX-512 (a decoded panel in memory): none.
#if defined(__AVX512F__)
constexpr int64_t CODE_ROWS = 8;
#else
constexpr int64_t CODE_ROWS = 0;
#endif
int64_t code_rows() { return CODE_ROWS; }

// A linear layer's tensors (see linear below) as panels, if they are: float32 panels [weight, (bias)], or with the
// same weights' code panels after them [weight, codes, scale, minimum, (bias)] (llama.py's Dense.pack), which steps
// of up to CODE_ROWS rows take; `n` becomes how many tensors the weight takes.
static bool as_panels(const std::vector<torch::Tensor>& L, const torch::Tensor& x, Panels& w, size_t& n) {
  if (L[0].is_mkldnn() || L[0].dim() != 3 || L[0].scalar_type() != at::kFloat) return false;
  check_panels(x, L[0], "linear");
  n = L.size() >= 4 && L[1].dim() == 3 && L[1].scalar_type() == at::kByte ? 4 : 1;
  w = n == 4 && x.size(0) <= CODE_ROWS ? code_panels(x, L[1], L[2], L[3], "linear") : f32_panels(L[0]);
  TORCH_CHECK(w.P == L[0].size(0), "linear: ", w.P, " code panels for ", L[0].size(0), " float32 ones");
  return true;
}

// ---- a decoder layer's work around attention in two calls (llama.py's DecoderLayer.forward, float32 activations) ----
// A linear layer arrives as its tensors: float32 Dense [weight [in, out] or oneDNN-packed, (bias)], Int8Dense [weight int8 [out, in],
// scale, (bias)] or Int4Dense [qweight uint8, scale, minimum, (bias)].
// A float32 weight packed by oneDNN (Dense.pack: mkldnn::_reorder_linear_weight) goes through oneDNN's linear, the
// op PyTorch's own CPU inference path (inductor's weight prepacking) calls, through the dispatcher; its result is
// used as it comes (no copy into a buffer of ours).
static torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [T, in] times a linear layer of N outputs, as a new [T, N] tensor.
static torch::Tensor linear(const std::vector<torch::Tensor>& L, const torch::Tensor& x_, int64_t N) {
  const torch::Tensor x = x_.contiguous();
  torch::Tensor out;
  size_t n = 1;
  Panels w;
  if (L[0].is_mkldnn()) {
    out = packed_linear(x, L[0]);
  } else if (as_panels(L, x, w, n)) {  // float32 or code panels
    out = torch::empty({x.size(0), N}, x.options());
    panels_linear(out, x, w, "linear");
  } else {
    out = torch::empty({x.size(0), N}, x.options());
    if (L[0].scalar_type() == at::kByte) {  // Int4Dense or Q8Dense, by the codes' bytes per input
      if (L[0].size(1) * 8 == x.size(1)) int4_linear(out, x, L[0], L[1], L[2]);
      else q8_linear(out, x, L[0], L[1], L[2]);
      n = 3;
    }
    else if (L[0].scalar_type() == at::kChar) { int8_linear(out, x, L[0], L[1]); n = 2; }
    else at::mm_out(out, x, L[0]);
  }
  if (L.size() > n) out.add_(L[n]);
  return out;
}

// qkv [T, cols = (H + 2 KVH) * D] = (RMSNorm of residual += x) W_qkv, with RoPE applied to its first rope_heads
// heads. x undefined: the first layer, whose residual is its input. With k_cache/v_cache (a float32 KVStore layer,
// [blocks, block_size, KVH, D]) and slots, the step's k and v rows are then stored at their slots.
torch::Tensor attn_in(torch::Tensor residual, c10::optional<torch::Tensor> x, torch::Tensor norm, double eps,
                      std::vector<torch::Tensor> w_qkv, int64_t cols, torch::Tensor cos, torch::Tensor sin,
                      int64_t rope_heads, int64_t head_dim, c10::optional<torch::Tensor> k_cache,
                      c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slots) {
  auto h = torch::empty_like(residual);
  add_rms_norm(h, residual, x, norm, eps);
  auto qkv = linear(w_qkv, h, cols);
  TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == cols, "attn_in: the q/k/v product has ", qkv.size(1),
              " columns, not ", cols);
  rope_(qkv.view({qkv.size(0), -1, head_dim}).narrow(1, 0, rope_heads), cos, sin);
  if (!k_cache.has_value()) return qkv;
  const int64_t T = qkv.size(0), row = qkv.size(1), kv = k_cache->size(2) * head_dim, H = rope_heads * head_dim - kv;
  const int64_t cap = k_cache->size(0) * k_cache->size(1);
  TORCH_CHECK(k_cache->is_contiguous() && v_cache->is_contiguous() && v_cache->sizes() == k_cache->sizes() &&
              k_cache->size(3) == head_dim && slots->numel() == T && slots->scalar_type() == at::kLong &&
              row == (rope_heads + k_cache->size(2)) * head_dim, "attn_in: bad cache, slots or qkv shapes");
  const float* src = qkv.data_ptr<float>();
  float* kp = k_cache->data_ptr<float>();
  float* vp = v_cache->data_ptr<float>();
  const int64_t* sp = slots->data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cap, "attn_in: slot ", sp[t], " outside the cache's ", cap);
    std::memcpy(kp + sp[t] * kv, src + t * row + H, kv * sizeof(float));
    std::memcpy(vp + sp[t] * kv, src + t * row + H + kv, kv * sizeof(float));
  }
  return qkv;
}

// a[i] = silu(g[i]) * u[i] for i < n, rounded as ATen's silu and then mul_ round them: x / (1 + exp(-x)) with the
// exp ATen's vectorized silu calls (Sleef's, 1 ulp) on [0, vec) (a multiple of the pair of registers its loop takes),
// std::exp on the rest, then the product. a may be g.
static inline void silu_mul_span(const float* g, const float* u, float* a, int64_t n, int64_t vec) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (; i < vec; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_xor_ps(sign, x))));
    _mm512_storeu_ps(a + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
#elif defined(__AVX2__)
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
#if defined(__AVX512F__)
  return I / 32 * 32;
#elif defined(__AVX2__)
  return I / 16 * 16;
#else
  return 0;
#endif
}

// act [T, I] = silu(gate) * up for gu [T, 2I] = [gate | up], in one pass: the same floats as
// at::silu(gate).mul_(up) (tests/models/test_cpu_kernels_isa.py), without the tensor between them, the second pass
// and its parallel region: 22 -> 12 us at 32 rows of the demo's 1,536, 1.58 -> 1.12 ms at 2,048 (GCC leaves a loop of
// expf scalar without -ffast-math).
void silu_mul(torch::Tensor act, torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && act.dim() == 2 && gu.is_contiguous() && act.is_contiguous() &&
              gu.scalar_type() == at::kFloat && act.scalar_type() == at::kFloat && gu.size(1) % 2 == 0 &&
              act.size(0) == gu.size(0) && act.size(1) == gu.size(1) / 2,
              "silu_mul: gu [T, 2I] and act [T, I], contiguous float32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, vec = silu_vec(I);
  const float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_span(gp + t * 2 * I, gp + t * 2 * I + I, ap + t * I, I, vec);
  });
}

// act [M, I] = silu_mul of x [M, K] times the gate/up weights [gate | up] packed by pack_panels (2I / 32 panels, I a
// multiple of 32), without [M, 2I] between them: each thread takes pairs of panels, gate panel j and up panel
// j + I / 32 (the same 32 channels of each), writes the gate's outputs in act and the up's in a buffer of its own,
// and combines them in place while both are in its cache. The floats of silu_mul(act, panel_linear(x, W)).
static void panels_gate_up_silu(torch::Tensor act, const torch::Tensor& x, const Panels& w) {
  const int64_t M = x.size(0), K = x.size(1), I = act.size(1), half = w.P / 2, chunk = panel_chunk(K);
  TORCH_CHECK(act.dim() == 2 && act.is_contiguous() && act.scalar_type() == at::kFloat && act.size(0) == M &&
              I % PANEL == 0 && w.P == 2 * I / PANEL,
              "gate_up_silu: act [M, I] must be contiguous float32 with I a multiple of 32, for 2I / 32 panels; got I = ",
              I, " and ", w.P, " panels");
  const int64_t vec = silu_vec(PANEL);  // each 32 channels of a row: where silu_vec(I) puts them (I % 32 == 0)
  const float* xp = x.data_ptr<float>();
  float* ap = act.data_ptr<float>();
#if defined(__AVX512F__)
  if (M == 1 && w.w == nullptr) {  // one row: gate panel j and up panel j side by side, decoded in registers
    at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float up[PANEL];
      for (int64_t j = begin; j < end; ++j) {
        const int64_t p[2] = {j, j + half}, cols[2] = {PANEL, PANEL};
        float* const out[2] = {ap + j * PANEL, up};
        code_row(w, p, xp, out, cols);
        silu_mul_span(ap + j * PANEL, up, ap + j * PANEL, PANEL, vec);
      }
    });
    return;
  }
  if (w.w == nullptr) {
    at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> up(std::min(chunk, M) * PANEL);
      for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t rows = std::min(M, c0 + chunk) - c0;
        for (int64_t j = begin; j < end; ++j) {
          float* a = ap + c0 * I + j * PANEL;
          code_pass(w, j, xp + c0 * K, rows, a, I, PANEL);
          code_pass(w, j + half, xp + c0 * K, rows, up.data(), PANEL, PANEL);
          for (int64_t r = 0; r < rows; ++r) silu_mul_span(a + r * I, up.data() + r * PANEL, a + r * I, PANEL, vec);
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, half, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> up(std::min(chunk, M) * PANEL), gbuf(w.buffer()), ubuf(w.buffer());
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t rows = std::min(M, c0 + chunk) - c0;
      for (int64_t j = begin; j < end; ++j) {
        const float *gate = w.get(j, gbuf.data()), *upw = w.get(j + half, ubuf.data());
        float* a = ap + c0 * I + j * PANEL;
        panel_pass(xp + c0 * K, K, rows, gate, w.w != nullptr ? upw : nullptr, a, I, PANEL);
        panel_pass(xp + c0 * K, K, rows, upw, w.ahead(j, end), up.data(), PANEL, PANEL);
        for (int64_t r = 0; r < rows; ++r) silu_mul_span(a + r * I, up.data() + r * PANEL, a + r * I, PANEL, vec);
      }
    }
  });
}

void gate_up_silu(torch::Tensor act, torch::Tensor x, torch::Tensor wp) {
  check_panels(x, wp, "gate_up_silu");
  panels_gate_up_silu(act, x, f32_panels(wp));
}

// down(silu(gate) * up) [T, hidden] of RMSNorm(residual += o_proj(attn)), gate/up fused as [gate | up] of I each.
torch::Tensor mlp(torch::Tensor residual, torch::Tensor attn, std::vector<torch::Tensor> w_o, torch::Tensor norm,
                  double eps, std::vector<torch::Tensor> w_gate_up, std::vector<torch::Tensor> w_down, int64_t I) {
  const int64_t D = residual.size(1);
  auto o = linear(w_o, attn, D);
  auto h = torch::empty_like(residual);
  add_rms_norm(h, residual, o.contiguous(), norm, eps);
  auto act = torch::empty({h.size(0), I}, h.options());
  Panels w;
  size_t n = 0;
  if (I % PANEL == 0 && as_panels(w_gate_up, h, w, n) && w_gate_up.size() == n) {
    panels_gate_up_silu(act, h, w);  // panels with no bias: the product and SiLU x up in one pass
  } else {
    silu_mul(act, linear(w_gate_up, h, 2 * I).contiguous());
  }
  return linear(w_down, act, D);
}

// ---- a decode step's decoder layers in one call (llama.py's LlamaModel.forward, decode-only steps) ----
// The attention module's paged_decode (kvcache/attention/cpu_kernel.py), called through its address.
using PagedDecode = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                             double, int64_t, double, int64_t, torch::Tensor);

// [x, residual] after every layer, for a step whose rows all decode: per layer attn_in (which stores K/V at
// `slots`), paged_decode over the float32 cache and mlp, the calls DecoderLayer._forward_fused makes, with the same
// arguments, so the same floats. x [T, hidden] is the embeddings (it becomes the residual stream, in place).
// `weights` holds each layer's input norm, post-attention norm, then its q/k/v, output, gate/up and down linears'
// tensors, `counts` [layers * 4] how many tensors each linear has; `caches` every layer's K then every layer's V;
// `windows` each layer's sliding window (0: none). Python's decode step made ~40 calls a layer: ~2.5 ms a step.
std::vector<torch::Tensor> decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> counts,
                                         std::vector<torch::Tensor> caches, std::vector<int64_t> windows, double eps,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                                         torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                         torch::Tensor block_table, torch::Tensor context_lens, torch::Tensor runs,
                                         double scale, int64_t split_tokens, int64_t attention) {
  const int64_t L = (int64_t)windows.size();
  TORCH_CHECK(L > 0 && (int64_t)counts.size() == 4 * L && (int64_t)caches.size() == 2 * L && attention != 0 &&
              x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "decode_layers: ", L, " layers need 4 counts and 2 caches each, and x [T, hidden] contiguous float32");
  const int64_t T = x.size(0), hidden = x.size(1);
  int64_t expected = 2 * L;
  for (int64_t n : counts) {
    TORCH_CHECK(n >= 1, "decode_layers: a linear layer of ", n, " tensors");
    expected += n;
  }
  TORCH_CHECK((int64_t)weights.size() == expected, "decode_layers: the counts and norms make ", expected,
              " weights, not ", weights.size());
  const auto paged_decode = reinterpret_cast<PagedDecode>(attention);
  torch::Tensor residual = x, out;
  size_t at = 0;
  auto take = [&](int64_t n) {
    std::vector<torch::Tensor> part(weights.begin() + at, weights.begin() + at + n);
    at += n;
    return part;
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor norm_in = weights.at(at++), norm_post = weights.at(at++);
    const auto w_qkv = take(counts[4 * l]), w_o = take(counts[4 * l + 1]);
    const auto w_gate_up = take(counts[4 * l + 2]), w_down = take(counts[4 * l + 3]);
    const torch::Tensor qkv = attn_in(residual, l == 0 ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(out),
                                      norm_in, eps, w_qkv, (heads + 2 * kv_heads) * head_dim, cos, sin,
                                      heads + kv_heads, head_dim, caches[l], caches[L + l], slots);
    const torch::Tensor q = qkv.view({T, heads + 2 * kv_heads, head_dim}).narrow(1, 0, heads);
    torch::Tensor o = torch::empty({T, heads, head_dim}, x.options());
    paged_decode(o, q, caches[l], caches[L + l], block_table, context_lens, scale, windows[l], 0.0, split_tokens, runs);
    out = mlp(residual, o.view({T, heads * head_dim}), w_o, norm_post, eps, w_gate_up, w_down, inter);
  }
  TORCH_CHECK(out.size(1) == hidden, "decode_layers: the layers' output has ", out.size(1), " columns, not ", hidden);
  return {out, residual};
}

// ---- the sampler's greedy rows (engine/sampler.py) ----
// argmax_lanes scans row [0, V16) (V16 a multiple of 16) as 16 lanes, lane l holding elements l, l + 16, ...: per
// lane the first maximum (strictly greater replaces, so each lane keeps its first; a NaN never does) and its index
// (0 while the lane has seen nothing above -inf), and nf[l], the sum of a * 0 over the lane (0 while every value
// is finite: x * 0 is 0 for a finite x, NaN for an infinity or a NaN). Every instruction set scans the same 16 lanes,
// so that argmax_finite's result, non-finite rows included, does not depend on the CPU.
#if defined(__AVX512F__)
static inline void argmax_lanes(const float* row, int64_t V16, float* bv, int32_t* bi, float* nf) {
  __m512 best = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps(), nonfinite = _mm512_setzero_ps();
  __m512i best_i = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t v = 0; v < V16; v += 16) {
    const __m512 a = _mm512_loadu_ps(row + v);
    nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(a, zero));
    const __mmask16 gt = _mm512_cmp_ps_mask(a, best, _CMP_GT_OQ);  // strictly greater: each lane keeps its first
    best = _mm512_mask_blend_ps(gt, best, a);
    best_i = _mm512_mask_blend_epi32(gt, best_i, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  _mm512_storeu_ps(bv, best);
  _mm512_storeu_ps(nf, nonfinite);
  _mm512_storeu_epi32(bi, best_i);
}
#elif defined(__AVX2__)
// The 16 lanes as two vectors of 8: lanes 0..7 (h = 0) and 8..15 (h = 1).
static inline void argmax_lanes(const float* row, int64_t V16, float* bv, int32_t* bi, float* nf) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256i step = _mm256_set1_epi32(16);
  __m256 best[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)}, nonfinite[2] = {zero, zero};
  __m256i best_i[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i idx[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
  for (int64_t v = 0; v < V16; v += 16)
    for (int h = 0; h < 2; ++h) {
      const __m256 a = _mm256_loadu_ps(row + v + 8 * h);
      nonfinite[h] = _mm256_add_ps(nonfinite[h], _mm256_mul_ps(a, zero));
      const __m256 gt = _mm256_cmp_ps(a, best[h], _CMP_GT_OQ);  // strictly greater: each lane keeps its first
      best[h] = _mm256_blendv_ps(best[h], a, gt);
      best_i[h] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_i[h]), _mm256_castsi256_ps(idx[h]), gt));
      idx[h] = _mm256_add_epi32(idx[h], step);
    }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(bv + 8 * h, best[h]);
    _mm256_storeu_ps(nf + 8 * h, nonfinite[h]);
    _mm256_storeu_si256((__m256i*)(bi + 8 * h), best_i[h]);
  }
}
#else
static inline void argmax_lanes(const float* row, int64_t V16, float* bv, int32_t* bi, float* nf) {
  for (int l = 0; l < 16; ++l) { bv[l] = -INFINITY; bi[l] = 0; nf[l] = 0.f; }
  for (int64_t v = 0; v < V16; v += 16)
    for (int l = 0; l < 16; ++l) {
      const float a = row[v + l];
      nf[l] += a * 0.f;
      if (a > bv[l]) { bv[l] = a; bi[l] = (int32_t)(v + l); }  // false for a NaN, as _CMP_GT_OQ
    }
}
#endif

// Per row of x [R, V] (float32, contiguous): the index of its first maximum, as torch.argmax gives it, and whether
// every value is finite, in one pass over the logits: 16 lanes (argmax_lanes), then the lanes and the row's tail.
std::vector<torch::Tensor> argmax_finite(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) < (1LL << 31),
              "argmax_finite: x must be a contiguous float32 [rows, vocab < 2^31]");
  const int64_t R = x.size(0), V = x.size(1);
  auto ids = torch::empty({R}, x.options().dtype(at::kLong));
  auto finite = torch::empty({R}, x.options().dtype(at::kBool));
  const float* xp = x.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * V;
      const int64_t v = V / 16 * 16;
      float bv[16], nf[16];
      int32_t bi[16];
      argmax_lanes(row, v, bv, bi, nf);
      float m = -INFINITY;
      int64_t at = -1;
      bool ok = true;
      for (int l = 0; l < 16; ++l) {
        ok = ok && nf[l] == 0.f;
        if (v > 0 && (bv[l] > m || (bv[l] == m && bi[l] < at) || at < 0)) { m = bv[l]; at = bi[l]; }
      }
      for (int64_t j = v; j < V; ++j) {
        ok = ok && std::isfinite(row[j]);
        if (at < 0 || row[j] > m) { m = row[j]; at = j; }
      }
      ip[r] = at < 0 ? 0 : at;  // a row of -inf only (not finite: an error) still gets an id in range
      fp[r] = ok;
    }
  });
  return {ids, finite};
}
"""

_int4: bool | None = None
_code_rows: int | None = None


def code_rows() -> int:
    """Steps of at most this many rows take a layer's code panels (code_panel_linear) where it has them: 8 with
    AVX-512, 0 without (or without the kernels)."""
    global _code_rows
    if _code_rows is None:
        _code_rows = int(load().code_rows()) if load() is not None else 0
    return _code_rows


def has_int4() -> bool:
    """Whether the compiled kernels include int4_linear (AVX512-VNNI, or AVX2 + FMA + F16C)."""
    global _int4
    if _int4 is None:
        _int4 = load() is not None and bool(load().has_int4())
    return _int4


# The compiled kernels, or None where they cannot be built (no compiler or headers; KVCACHE_CPU_KERNEL=0)
load = native.Kernels("kvcache_cpu_model", _SOURCE, ["pack_panels", "panel_linear", "code_panel_linear", "int8_linear",
                      "int4_linear", "q8_linear", "has_int4", "add_rms_norm", "rope_", "attn_in", "mlp", "silu_mul",
                      "gate_up_silu", "decode_layers", "argmax_finite", "code_rows"], [],
                      "using PyTorch's ops")


def pack_code_panels(codes, scale, minimum, bits: int) -> tuple:
    """Codes [N, K] (uint8; 4 or 8 bits), scales and minima [N, K / 32] (float32) as code_panel_linear's panels:
    codes [P, K, 16] (4 bits: byte j holds output j's code in its low half, j + 16's in its high) or [P, K, 32],
    scale and minimum [P, K / 32, 32], the last panel's missing outputs 0 (weight 0, as pack_panels pads)."""
    import torch
    n, k = codes.shape
    pad = -n % 32
    per = lambda t: torch.nn.functional.pad(t, (0, 0, 0, pad)).view(-1, 32, t.shape[1]).transpose(1, 2)  # noqa: E731
    c = per(codes)
    if bits == 4:
        c = c[..., :16] | (c[..., 16:] << 4)
    out = native.huge_page_zeros(tuple(c.shape), torch.uint8, touch=False)
    out.copy_(c)
    return out, per(scale).contiguous(), per(minimum).contiguous()


def pack_panels(w, kernels=None):
    """w [N, K] float32 in panels [ceil(N / 32), K, 32] for panel_linear (the last panel's missing outputs zero), on
    memory the OS may back with huge pages: decode streams every weight from memory each step. `kernels`: a
    module built from this source (default: load())."""
    import torch
    out = native.huge_page_zeros((-(-w.shape[0] // 32), w.shape[1], 32), torch.float32, touch=False)  # all written
    (kernels or load()).pack_panels(w, out)
    return out
