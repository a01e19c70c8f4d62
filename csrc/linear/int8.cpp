// int8_linear: weight-only int8 linear layers (quant_linear.Int8Dense): float32 activations times int8 weights,
// widened in registers, one scale per output channel.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../isa.h"
#include "../ops.h"

namespace kvcache {

// ---- int8 weights (quant_linear.Int8Dense): int8_channels per instruction set, as the compiler sees it ----
// Each computes out[m, n] for every row m and the output channels n in [begin, end) of int8_linear below. A product
// sums in the same order whatever rows are beside it (the same chain of 16 or 8 wide FMAs over k, then the tail):
// a batch-invariant layer gives each row what it gives it alone. The tails' FMAs are written out (std::fma): left to
// contraction, GCC's tuning for AMD Zen 4 (avoid_fma_chains) split some instantiations' chains into a multiply and an
// add and not others, so a row's tail rounded differently in a tile of 4 than alone.
#if defined(KVCACHE_AVX512)
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
#elif defined(KVCACHE_AVX2)
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
void int8_linear(Tensor out, Tensor x, Tensor w, Tensor scale) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous() && w.size(1) == K && scale.numel() == N &&
              out.size(0) == M && out.size(1) == N, "int8_linear: bad shapes or strides");
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { int8_channels(xp, M, K, wp, sp, op, N, begin, end); });
}

}  // namespace kvcache
