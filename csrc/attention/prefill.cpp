// Causal prefill attention in float32 (prefill_attention): flash attention on register tiles.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../ops.h"
#include "../parallel.h"
#include "softmax.h"

namespace kvcache {

// ---- causal prefill attention (float32) ----
// out [n, H, D] = softmax(q k^T * sc + causal mask) v for the n queries at positions off .. off + n - 1 of a context
// of L = off + n keys: q [n, H, D], k, v [L, KVH, D] with any row stride (heads packed by D), G = H / KVH query heads
// per KV head, D a multiple of 32. Flash attention: per KV head and block of QB query positions (their QB x G rows
// share each key and value), blocks of KB keys with an online softmax, blocks wholly above the diagonal skipped.
// Both products run on a register tile (mm_tile), the keys transposed once per call into KB-wide panels.
// SDPA's CPU kernel runs these shapes (the demo's heads, 64-512 tokens) at 35-65 GFLOP/s on 2 cores.
constexpr int64_t PQB = 16, PKB = 32;  // online_softmax32: PKB is 32
// A register tile: MM_ROWS rows x MM_COLS columns of accumulators (AVX-512: 12 x 2 registers of 16; AVX2: 6 x 2 of
// 8, with 2 of weights and a broadcast in the 16 registers)
#if defined(KVCACHE_AVX512)
constexpr int MM_ROWS = 12, MM_COLS = 32;
#elif defined(KVCACHE_AVX2)
constexpr int MM_ROWS = 6, MM_COLS = 16;
#else
constexpr int MM_ROWS = 2, MM_COLS = 32;
#endif
constexpr int MM_VECS = MM_COLS / VL;

// out [MR, MM_COLS] (+= with ACC) x [MR, K] (row stride ldx) times w [K, MM_COLS] (row stride ldw)
template <int MR, bool ACC>
static inline void mm_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
                           int64_t ldo) {
  vf acc[MR][MM_VECS];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < MM_VECS; ++j) acc[r][j] = (vf){};
  for (int64_t k = 0; k < K; ++k) {
    vf wv[MM_VECS];
    for (int j = 0; j < MM_VECS; ++j) wv[j] = *(const vf*)(w + k * ldw + VL * j);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const vf a = splat(x[r * ldx + k]);
      for (int j = 0; j < MM_VECS; ++j) acc[r][j] += a * wv[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < MM_VECS; ++j) {
      vf* o = (vf*)(out + r * ldo + VL * j);
      if constexpr (ACC) *o += acc[r][j];
      else *o = acc[r][j];
    }
}

template <int MR, bool ACC>
static inline void mm_rows(int64_t m, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
                           int64_t ldo) {
  if constexpr (MR > 1) {
    if (m < MR) return mm_rows<MR - 1, ACC>(m, x, ldx, w, ldw, K, out, ldo);
  }
  mm_tile<MR, ACC>(x, ldx, w, ldw, K, out, ldo);
}

// out [M, cols] (+)= x [M, K] w [K, cols], cols a multiple of 32
template <bool ACC>
static void mm(int64_t M, int64_t cols, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
               int64_t ldo) {
  for (int64_t c = 0; c < cols; c += MM_COLS)
    for (int64_t r = 0; r < M; r += MM_ROWS)
      mm_rows<MM_ROWS, ACC>(std::min<int64_t>(MM_ROWS, M - r), x + r * ldx, ldx, w + c, ldw, K, out + r * ldo + c, ldo);
}

void prefill_attention(Tensor out, Tensor q, Tensor k, Tensor v, double scale) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1), off = L - n;
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes() &&
              v.sizes() == k.sizes() && k.size(2) == D && D % 32 == 0 && H % KVH == 0 && off >= 0 &&
              q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 &&
              v.stride(1) == D, "prefill_attention: q [n, H, D], k, v [L >= n, KVH, D] float32 with heads packed by D "
              "(D a multiple of 32), out contiguous like q");
  const int64_t G = H / KVH, NKB = (L + PKB - 1) / PKB, NQB = (n + PQB - 1) / PQB, R = PQB * G;
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  // keys transposed into panels kt [KVH][NKB][D][PKB] (past L: zero)
  std::vector<float> kt(KVH * NKB * D * PKB, 0.f);
  at::parallel_for(0, KVH * NKB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / NKB, jb = i % NKB;
      float* panel = kt.data() + i * D * PKB;
      for (int64_t j = jb * PKB; j < std::min(L, (jb + 1) * PKB); ++j)
        for (int64_t d = 0; d < D; ++d) panel[d * PKB + (j - jb * PKB)] = kp[j * ks + kh * D + d];
    }
  });
  // work items: a KV head and a pair of query blocks, one from each end, so that the items cost about the same
  const int64_t pairs = (NQB + 1) / 2;
  parallel_items(KVH * pairs, [&](WorkQueue& queue) {  // taken as threads free up (parallel.h)
    std::vector<float> qb(R * D), s(R * PKB), o(R * D), m(R), l(R);
    std::vector<vf> lsum(R);
    for (int64_t item = queue.take(); item >= 0; item = queue.take()) {
      const int64_t kh = item / pairs, t = item % pairs;
      for (int64_t which = 0; which < (t == NQB - 1 - t ? 1 : 2); ++which) {
        const int64_t qi = which ? NQB - 1 - t : t;
        const int64_t i0 = qi * PQB, nq = std::min(PQB, n - i0), rows = nq * G;
        for (int64_t i = 0; i < nq; ++i)  // row i * G + g: query i0 + i of head kh * G + g, scaled
          for (int64_t g = 0; g < G; ++g) {
            const float* src = qp + (i0 + i) * qs + (kh * G + g) * D;
            float* dst = qb.data() + (i * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * sc;
          }
        std::fill(m.begin(), m.begin() + rows, NO_SCORE);
        std::fill(lsum.begin(), lsum.begin() + rows, (vf){});
        std::fill(o.begin(), o.begin() + rows * D, 0.f);
        const int64_t last = off + i0 + nq - 1;  // the last key any row of the block sees
        for (int64_t jb = 0; jb <= last / PKB; ++jb) {
          const int64_t j0 = jb * PKB, nk = std::min(PKB, L - j0);
          mm<false>(rows, PKB, qb.data(), D, kt.data() + (kh * NKB + jb) * D * PKB, PKB, D, s.data(), PKB);
          for (int64_t i = 0, r = 0; i < nq; ++i) {
            // keys j0 .. j0 + valid - 1 are query i's; the block's others weigh nothing in the product with v
            const int64_t valid = std::max<int64_t>(0, std::min(nk, off + i0 + i - j0 + 1));
            for (int64_t g = 0; g < G; ++g, ++r)
              online_softmax32(s.data() + r * PKB, valid, m[r], lsum[r], o.data() + r * D, D);
          }
          mm<true>(rows, D, s.data(), PKB, vp + j0 * vs + kh * D, vs, nk, o.data(), D);
        }
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            l[r] = hsum(lsum[r]);
            normalise(op + ((i0 + i) * H + kh * G + g) * D, o.data() + r * D, l.data() + r, 1, D);
          }
      }
    }
  });
}

}  // namespace kvcache
