"""A C++ decode-attention kernel for CPU that reads K/V straight from the paged store.

The portable path gathers each sequence's blocks into a padded buffer before SDPA, which
on CPU costs as much memory traffic as the attention itself. This kernel walks the block
table instead: each (sequence, KV head) pair reads its keys and values once and serves
all query heads of its group. Compiled on first use with the system C++ compiler
(torch.utils.cpp_extension, cached under ~/.cache/torch_extensions); if that fails the
engine keeps the portable path and says so once.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// out, q: [B, H, D] fp32; k_cache, v_cache: [NB, BS, KVH, D] fp32;
// block_tables: [B, MAXNB] int64; context_lens: [B] int64; window <= 0 means none.
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH, MAXNB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t blk = BS * KVH * D, tok = KVH * D;
  const float sc = (float)scale;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(G * D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / KVH, kh = w % KVH, L = cl[b];
      const int64_t j0 = window > 0 ? std::max<int64_t>(0, L - window) : 0, n = L - j0;
      s.resize(G * n);
      const float* qb = qp + (b * H + kh * G) * D;
      const int64_t* table = bt + b * MAXNB;
      for (int64_t j = j0; j < L; ++j) {
        const float* k = kp + table[j / BS] * blk + (j % BS) * tok + kh * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qq = qb + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+:dot)
          for (int64_t d = 0; d < D; ++d) dot += qq[d] * k[d];
          s[g * n + (j - j0)] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * n;
        float m = -INFINITY;
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = j0; j < L; ++j) {
        const float* v = vp + table[j / BS] * blk + (j % BS) * tok + kh * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * n + (j - j0)];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, op + (b * H + kh * G + g) * D);
    }
  });
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
    if os.environ.get("KVCACHE_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline
        _module = load_inline("kvcache_cpu_attention", cpp_sources=[_SOURCE], functions=["paged_decode"],
                              extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as e:  # no compiler, no headers: the portable path still works
        log.warning("CPU attention kernel unavailable (%s); using the portable PyTorch path", str(e).splitlines()[0])
        _module = None
    return _module


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None) -> None:
    """out[b] = attention of q[b] ([B, H, D]) over the first context_lens[b] tokens of its block table."""
    _module.paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale, window or 0)
