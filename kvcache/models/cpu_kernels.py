"""C++ kernels for the model's CPU path, compiled on first use (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions), as the attention kernel is; where that fails the model keeps PyTorch's ops.

- `int8_linear`: weight-only int8 matrix product (quant_linear.py).
- `add_rms_norm`: the residual sum and RMSNorm of a layer's input in one pass over each row (float32).
- `rope_`: rotate-half RoPE of a step's query and key heads in place, in the q/k/v product's own buffer (float32).

A decode step of a small model is a few hundred tiny ops; each of these replaces several of them (the sum, the
square, the mean, the rsqrt, two products; a concatenation, a negation, two products and a sum, per tensor).
"""
from __future__ import annotations

import logging
import os


log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <math.h>

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
    for (int64_t j = k; j < K; ++j) s += w[j] * x[r * K + j];
    out[r] = s;
  }
}

// out [M, N] fp32 = (x [M, K] fp32) (w [N, K] int8)^T * scale [N]; output channels split across torch's threads.
void int8_linear(torch::Tensor out, torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    float o[8];
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* row = wp + n * K;
      const float s = sp[n];
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) { dot_rows<8>(xp + m * K, K, row, o); for (int r = 0; r < 8; ++r) op[(m + r) * N + n] = o[r] * s; }
      for (; m + 4 <= M; m += 4) { dot_rows<4>(xp + m * K, K, row, o); for (int r = 0; r < 4; ++r) op[(m + r) * N + n] = o[r] * s; }
      for (; m < M; ++m) { dot_rows<1>(xp + m * K, K, row, o); op[m * N + n] = o[0] * s; }
    }
  });
}

// residual[t] += x[t] (skipped when x is undefined); out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * w.
void add_rms_norm(torch::Tensor out, torch::Tensor residual, c10::optional<torch::Tensor> x, torch::Tensor w,
                  double eps) {
  const int64_t T = residual.size(0), D = residual.size(1);
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
"""

_module = None
_tried = False


def load():
    """The compiled kernels, or None where they cannot be built (no compiler, no AVX-512; KVCACHE_CPU_KERNEL=0)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("KVCACHE_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline
        _module = load_inline("kvcache_cpu_model", cpp_sources=[_SOURCE],
                              functions=["int8_linear", "add_rms_norm", "rope_"],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
    except Exception as e:  # no compiler or no AVX-512: PyTorch's ops (int8 weights dequantized per call)
        log.warning("CPU model kernels unavailable (%s); using PyTorch's ops", str(e).splitlines()[0])
        _module = None
    return _module
