// The sampler's greedy rows (engine/sampler.py): each row's argmax and whether it is finite, in one pass.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "isa.h"
#include "ops.h"

namespace kvcache {

// ---- the sampler's greedy rows (engine/sampler.py) ----
// argmax_lanes scans row [0, V16) (V16 a multiple of 16) as 16 lanes, lane l holding elements l, l + 16, ...: per
// lane the first maximum (strictly greater replaces, so each lane keeps its first; a NaN never does) and its index
// (0 while the lane has seen nothing above -inf), and nf[l], the sum of a * 0 over the lane (0 while every value
// is finite: x * 0 is 0 for a finite x, NaN for an infinity or a NaN). Every instruction set scans the same 16 lanes,
// so that argmax_finite's result, non-finite rows included, does not depend on the CPU.
#if defined(KVCACHE_AVX512)
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
#elif defined(KVCACHE_AVX2)
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
std::vector<Tensor> argmax_finite(Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) < (1LL << 31),
              "argmax_finite: x must be a contiguous float32 [rows, vocab < 2^31]");
  const int64_t R = x.size(0), V = x.size(1);
  auto ids = x.new_empty({R}, x.options().dtype(at::kLong));
  auto finite = x.new_empty({R}, x.options().dtype(at::kBool));
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

}  // namespace kvcache
