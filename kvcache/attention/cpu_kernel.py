"""A C++ decode-attention kernel for CPU that reads K/V straight from the paged store.

The portable path gathers each sequence's blocks into a padded buffer before SDPA, which
on CPU costs as much memory traffic as the attention itself. This kernel walks the block
table instead: each sequence reads its blocks front to back once, for all heads. Compiled on first use with the system C++ compiler
(torch.utils.cpp_extension, cached under ~/.cache/torch_extensions); if that fails the
engine keeps the portable path and says so once. It is built with -fopenmp so that
at::parallel_for runs on torch's own OpenMP pool: the loader resolves libgomp.so.1 to the
copy torch already loaded, so no second runtime competes for the cores.
"""
from __future__ import annotations

import logging

import torch

from kvcache import native

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <math.h>
#include <vector>

// out, q: [B, H, D] fp32; k_cache, v_cache: [NB, BS, KVH, D] fp32;
// block_tables: [B, MAXNB] int64; context_lens: [B] int64; window <= 0 means none.
// DC is D when known at compile time (the common head sizes), else 0.
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

// Tree reduction: four shuffle-adds instead of sixteen scalar adds.
static inline float hsum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

template <int64_t DC>
static inline float dot(const float* q, const float* k, int64_t Drt) {
  if constexpr (DC > 0 && DC % 16 == 0) {
    v16 acc = *(const v16*)q * *(const v16*)k;
#pragma GCC unroll 8
    for (int64_t d = 16; d < DC; d += 16) acc += *(const v16*)(q + d) * *(const v16*)(k + d);
    return hsum(acc);
  } else {
    float s = 0.f;
#pragma omp simd reduction(+:s)
    for (int64_t d = 0; d < Drt; ++d) s += q[d] * k[d];
    return s;
  }
}

// Softmax of each of `rows` rows of `n` scores, in place; with cap > 0 the scores are soft-capped first,
// cap * tanh(s / cap) (Gemma-2's attn_logit_softcapping).
static inline void softmax_rows(float* s, int64_t rows, int64_t n, float cap) {
  for (int64_t h = 0; h < rows; ++h) {
    float* sh = s + h * n;
    if (cap > 0.f) {
      const float inv_cap = 1.f / cap;
      for (int64_t i = 0; i < n; ++i) sh[i] = cap * tanhf(sh[i] * inv_cap);
    }
    float m = sh[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sh[i]);
    float sum = 0.f;
#pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; ++i) { sh[i] = expf(sh[i] - m); sum += sh[i]; }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) sh[i] *= inv;
  }
}

template <int64_t DC>
static void decode_impl(float* op, const float* qp, const float* kp, const float* vp, const int64_t* bt,
                        const int64_t* cl, int64_t B, int64_t H, int64_t Drt, int64_t BS, int64_t KVH,
                        int64_t MAXNB, float sc, int64_t window, float cap) {
  const int64_t D = DC ? DC : Drt, G = H / KVH, blk = BS * KVH * D, tok = KVH * D;
  // One work item per sequence, all heads together: a token's K (or V) for every head is
  // one contiguous run of KVH * D floats, so each block is read front to back once. (Splitting
  // by KV head instead reads a third of every cache line run and wastes the prefetcher.)
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(H * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = cl[b];
      const int64_t j0 = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - j0;
      s.resize(H * n);  // scores, [head][token]
      const float* qb = qp + b * H * D;
      const int64_t* table = bt + b * MAXNB;
      for (int64_t bi = j0 / BS; bi * BS < L; ++bi) {
        const float* kb = kp + table[bi] * blk;
        const int64_t t0 = std::max(j0 - bi * BS, (int64_t)0), t1 = std::min(L - bi * BS, BS);
        for (int64_t t = t0; t < t1; ++t) {
          const float* kt = kb + t * tok;
          float* st = s.data() + bi * BS + t - j0;
          for (int64_t h = 0; h < H; ++h) {
            const float* k = kt + (h / G) * D;
            st[h * n] = dot<DC>(qb + h * D, k, D) * sc;
          }
        }
      }
      softmax_rows(s.data(), H, n, cap);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t bi = j0 / BS; bi * BS < L; ++bi) {
        const float* vb = vp + table[bi] * blk;
        const int64_t t0 = std::max(j0 - bi * BS, (int64_t)0), t1 = std::min(L - bi * BS, BS);
        for (int64_t t = t0; t < t1; ++t) {
          const float* vt = vb + t * tok;
          const float* pt = s.data() + bi * BS + t - j0;
          for (int64_t h = 0; h < H; ++h) {
            const float* v = vt + (h / G) * D;
            const float p = pt[h * n];
            float* a = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
          }
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * H * D);
    }
  });
}

// Quantized stores (store/quantized_store.py): each block is one row of `raw` [NB, ROW] bytes holding
// codes, fp16 scales and zero points at byte offsets ko, vo, kso, vso, kzo, vzo. FMT 0: one byte per value
// (fp8/int8, decoded through lut[256]) with one scale per token and KV head. FMT 1: KIVI int4/int2, PER codes
// per byte (lut[256 * PER]); keys scaled per channel over groups of GK tokens, values per token over groups of
// GV channels. Keys of positions >= full_start[b] are read in full precision from full_src rows full_rows[b].
// CODE: 0 fp8 through lut[256], 1 int8 (converted directly), 4 / 2 KIVI int4 / int2 (PER = 8 / CODE codes a byte).
// DC is D when known at compile time (64, 128), else 0.
template <int CODE, int64_t DC>
static void qdecode_impl(float* op, const float* qp, const uint8_t* raw, int64_t ROW, int64_t ko, int64_t vo,
                         int64_t kso, int64_t vso, int64_t kzo, int64_t vzo, const float* lut,
                         int64_t GK, int64_t GV, const int64_t* bt, const int64_t* cl, int64_t B, int64_t H, int64_t Drt,
                         int64_t BS, int64_t KVH, int64_t MAXNB, float sc, int64_t window, const float* fsrc,
                         const int64_t* frows, const int64_t* fstart, int64_t FR, float cap) {
  constexpr bool KIVI = CODE == 4 || CODE == 2;
  constexpr int PER = KIVI ? 8 / CODE : 1;
  constexpr uint8_t MASK = KIVI ? (1 << CODE) - 1 : 0xFF;
  const int64_t D = DC ? DC : Drt;
  const int64_t G = H / KVH, DP = D / PER, NVG = D / GV;
  // one byte-code -> float, vectorizable for the integer formats
  auto decode = [&](const uint8_t* c, int64_t d) -> float {
    if constexpr (CODE == 0) return lut[c[d]];
    else if constexpr (CODE == 1) return (float)(int8_t)c[d];
    else return (float)((c[d / PER] >> ((d % PER) * CODE)) & MASK);
  };
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(H * D), kv(D), kscale(KVH * D), kzero(KVH * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = cl[b];
      const int64_t j0 = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - j0;
      const int64_t fs = fstart ? fstart[b] : L;
      s.resize(H * n);
      const float* qb = qp + b * H * D;
      const int64_t* table = bt + b * MAXNB;
      for (int64_t bi = j0 / BS; bi * BS < L; ++bi) {
        const uint8_t* row = raw + table[bi] * ROW;
        const int64_t t0 = std::max(j0 - bi * BS, (int64_t)0), t1 = std::min(L - bi * BS, BS);
        int64_t group = -1;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t pos = bi * BS + t;
          if (KIVI && pos < fs && t / GK != group) {  // this group's per-channel scales, converted once
            group = t / GK;
            const at::Half* ks = (const at::Half*)(row + kso) + group * KVH * D;
            const at::Half* kz = (const at::Half*)(row + kzo) + group * KVH * D;
            for (int64_t i = 0; i < KVH * D; ++i) { kscale[i] = (float)ks[i]; kzero[i] = (float)kz[i]; }
          }
          for (int64_t kh = 0; kh < KVH; ++kh) {
            const float* k = kv.data();
            if (pos >= fs) {
              k = fsrc + (frows[b * FR + pos - fs] * KVH + kh) * D;
            } else if constexpr (!KIVI) {
              const uint8_t* c = row + ko + (t * KVH + kh) * D;
              const float ks = (float)((const at::Half*)(row + kso))[t * KVH + kh];
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) kv[d] = decode(c, d) * ks;
            } else {
              const uint8_t* c = row + ko + (t * KVH + kh) * DP;
              const float* ks = kscale.data() + kh * D;
              const float* kz = kzero.data() + kh * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) kv[d] = decode(c, d) * ks[d] + kz[d];
            }
            float* st = s.data() + pos - j0;
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = kh * G + g;
              st[h * n] = dot<DC>(qb + h * D, k, D) * sc;
            }
          }
        }
      }
      softmax_rows(s.data(), H, n, cap);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t bi = j0 / BS; bi * BS < L; ++bi) {
        const uint8_t* row = raw + table[bi] * ROW;
        const int64_t t0 = std::max(j0 - bi * BS, (int64_t)0), t1 = std::min(L - bi * BS, BS);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t pos = bi * BS + t;
          for (int64_t kh = 0; kh < KVH; ++kh) {
            if constexpr (!KIVI) {
              const uint8_t* c = row + vo + (t * KVH + kh) * D;
              const float vs = (float)((const at::Half*)(row + vso))[t * KVH + kh];
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) kv[d] = decode(c, d) * vs;
            } else {
              const uint8_t* c = row + vo + (t * KVH + kh) * DP;
              const at::Half* vs = (const at::Half*)(row + vso) + (t * KVH + kh) * NVG;
              const at::Half* vz = (const at::Half*)(row + vzo) + (t * KVH + kh) * NVG;
              for (int64_t vg = 0; vg < NVG; ++vg) {
                const float sv = (float)vs[vg], zv = (float)vz[vg];
#pragma omp simd
                for (int64_t d = vg * GV; d < (vg + 1) * GV; ++d) kv[d] = decode(c, d) * sv + zv;
              }
            }
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = kh * G + g;
              const float p = s[h * n + pos - j0];
              float* a = acc.data() + h * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += p * kv[d];
            }
          }
        }
      }
      std::copy(acc.begin(), acc.end(), op + b * H * D);
    }
  });
}

template <int CODE>
static void qdecode_dispatch(int64_t D, auto args) {
  if (D == 64) std::apply(qdecode_impl<CODE, 64>, args);
  else if (D == 128) std::apply(qdecode_impl<CODE, 128>, args);
  else std::apply(qdecode_impl<CODE, 0>, args);
}

void paged_decode_quant(torch::Tensor out, torch::Tensor q, torch::Tensor raw, std::vector<int64_t> offsets,
                        int64_t code, torch::Tensor lut, int64_t gk, int64_t gv, int64_t block_size,
                        int64_t kv_heads, torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                        int64_t window, torch::Tensor full_src, torch::Tensor full_rows, torch::Tensor full_start,
                        double softcap) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && raw.is_contiguous() && lut.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous() && offsets.size() == 6);
  TORCH_CHECK(q.scalar_type() == at::kFloat && lut.scalar_type() == at::kFloat && raw.scalar_type() == at::kByte);
  const bool kivi = code == 4 || code == 2;
  if (kivi) TORCH_CHECK(full_src.is_contiguous() && full_rows.is_contiguous() && full_start.is_contiguous() &&
                        full_src.scalar_type() == at::kFloat);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  auto args = std::make_tuple(out.data_ptr<float>(), q.data_ptr<float>(), raw.data_ptr<uint8_t>(), raw.size(1),
                              offsets[0], offsets[1], offsets[2], offsets[3], offsets[4], offsets[5],
                              lut.data_ptr<float>(), gk, gv, block_tables.data_ptr<int64_t>(),
                              context_lens.data_ptr<int64_t>(), B, H, D, block_size, kv_heads,
                              block_tables.size(1), (float)scale, window,
                              kivi ? full_src.data_ptr<float>() : nullptr,
                              kivi ? full_rows.data_ptr<int64_t>() : nullptr,
                              kivi ? full_start.data_ptr<int64_t>() : nullptr, kivi ? full_rows.size(1) : (int64_t)0,
                              (float)softcap);
  switch (code) {
    case 0: qdecode_dispatch<0>(D, args); break;
    case 1: qdecode_dispatch<1>(D, args); break;
    case 4: qdecode_dispatch<4>(D, args); break;
    case 2: qdecode_dispatch<2>(D, args); break;
    default: TORCH_CHECK(false, "unknown code ", code);
  }
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window,
                  double softcap) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  auto args = std::make_tuple(out.data_ptr<float>(), q.data_ptr<float>(), k_cache.data_ptr<float>(),
                              v_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                              context_lens.data_ptr<int64_t>(), B, H, D, k_cache.size(1), k_cache.size(2),
                              block_tables.size(1), (float)scale, window, (float)softcap);
  if (D == 64) std::apply(decode_impl<64>, args);
  else if (D == 128) std::apply(decode_impl<128>, args);
  else std::apply(decode_impl<0>, args);
}
"""

_module = None
_tried = False


def load() -> object | None:
    """The compiled kernel module, or None if it cannot be built here (or KVCACHE_CPU_KERNEL=0)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    _module = native.build("kvcache_cpu_attention", _SOURCE, ["paged_decode", "paged_decode_quant"], ["-ffast-math"],
                           "using the portable PyTorch path")
    return _module


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None = None) -> None:
    """out[b] = attention of q[b] ([B, H, D]) over the first context_lens[b] tokens of its block table; scores
    soft-capped (c * tanh(s / c)) with `softcap`."""
    load().paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale, window or 0, softcap or 0.0)


def paged_decode_quant(out: torch.Tensor, q: torch.Tensor, store, layer: int, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, window: int | None,
                       full: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, softcap: float | None = None) -> None:
    """paged_decode over a QuantizedKVStore layer, dequantizing each token as it is read. Under KIVI `full` is
    (full-precision key rows [R, KVH, D], row of each sequence's current-group position [B, group], the position
    that group starts at [B])."""
    empty = torch.empty(0)
    src, rows, start = full if full is not None else (empty, empty, empty)
    code = store.bits if store.kivi_group else (1 if store.dtype == "int8" else 0)
    load().paged_decode_quant(out, q, store.raw[layer], store.offsets, code, store.lut,
                               store.kivi_group or 1, store.value_group, store.block_size,
                               store.num_kv_heads, block_tables, context_lens, scale, window or 0, src, rows, start,
                               softcap or 0.0)
