"""C++ kernels for the model's CPU path, compiled on first use (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions), as the attention kernel is; where that fails the model keeps PyTorch's ops.

- `int8_linear`: weight-only int8 matrix product (quant_linear.py).
- `int4_linear`: 4-bit weights (groups of 32 with a scale and a minimum, GGUF's Q4_1) times activations quantized to
  int8 per group of 32 on the fly (GGUF's Q8_1), multiplied with AVX512-VNNI's u8 x s8 dot product, as llama.cpp does.
- `add_rms_norm`: the residual sum and RMSNorm of a layer's input in one pass over each row (float32).
- `rope_`: rotate-half RoPE of a step's query and key heads in place, in the q/k/v product's own buffer (float32).

- `attn_in` and `mlp`: a decoder layer's decode-sized work around attention in two calls (RMSNorm, the q/k/v
  product and RoPE; the output projection, RMSNorm, gate/up, SiLU x up and down), for float32, int8 and int4 layers.

A decode step of a small model is a few hundred tiny ops, and on one core their Python dispatch costs as much as
reading the weights (measured on the demo model: ~3 ms of ~13 ms per token); each of these replaces several of them.
"""
from __future__ import annotations

from kvcache import native

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <math.h>
#include <cmath>
#include <vector>
#include <cstring>

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
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous() && w.size(1) == K && scale.numel() == N &&
              out.size(0) == M && out.size(1) == N, "int8_linear: bad shapes or strides");
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

// ---- 4-bit weights x int8 activations (quant_linear.Int4Dense) ----
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
bool has_int4() { return true; }
// Weights: per row, K/64 units of 32 bytes; byte j of a unit holds element j (low nibble) and element j + 32 (high
// nibble) of its 64, so one AND and one shift give two groups of 32 codes 0..15 in order. Group g dequantizes to
// d[g] * code + m[g] (d, m float16). Activations: per row and group of 32, a = da * qa with qa int8 in -127..127.
// dot(group) = d * da * sum(code * qa) + m * (da * sum(qa)): VNNI's vpdpbusd takes the codes as u8 and qa as s8.

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// R weight rows (stride K/2 bytes) against one quantized activation row `a` (scales da, sa): the activation's loads
// are shared and the R rows' accumulators are independent chains. Per 16 groups, each row's combined scales
// d[g] * da[g] are made in two registers and broadcast from there (a round trip through memory would stall on
// store forwarding), and the minima's term m[g] * sa[g] is accumulated alongside; the R sums are reduced together.
template <int R>
static inline void int4_dot(const uint8_t* row, const uint16_t* dr, const uint16_t* mr, int64_t K, const int8_t* a,
                            const float* da, const float* sa, float* out) {
  const int64_t G = K / 32, U = K / 64;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc0[R], acc1[R];
  __m512 mins[R];
  for (int r = 0; r < R; ++r) { acc0[r] = acc1[r] = _mm256_setzero_ps(); mins[r] = _mm512_setzero_ps(); }
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const __mmask16 k = (G - g0) >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g0)) - 1);
    const __m512 dav = _mm512_maskz_loadu_ps(k, da + g0), sav = _mm512_maskz_loadu_ps(k, sa + g0);
    __m256 clo[R], chi[R];
    for (int r = 0; r < R; ++r) {
      const __m512 c = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dr + r * G + g0)), dav);
      clo[r] = _mm512_castps512_ps256(c);
      chi[r] = _mm512_extractf32x8_ps(c, 1);
      mins[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mr + r * G + g0)), sav, mins[r]);
    }
    const int64_t u0 = g0 / 2, u1 = std::min<int64_t>(U, u0 + 8);
    for (int64_t u = u0; u < u1; ++u) {
      const int j = (int)(u - u0);
      const __m256i i0 = _mm256_set1_epi32((2 * j) & 7), i1 = _mm256_set1_epi32((2 * j + 1) & 7);
      const __m256i a0 = _mm256_loadu_si256((const __m256i*)(a + u * 64));
      const __m256i a1 = _mm256_loadu_si256((const __m256i*)(a + u * 64 + 32));
      for (int r = 0; r < R; ++r) {
        // the rows two blocks ahead: streamed from memory, they would otherwise wait on the hardware prefetcher
        _mm_prefetch((const char*)(row + (2 * R + r) * (K / 2) + u * 32), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(row + r * (K / 2) + u * 32));
        const __m256i s0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_and_si256(v, nib), a0);
        const __m256i s1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), a1);
        const __m256 c = j < 4 ? clo[r] : chi[r];
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_permutevar8x32_ps(c, i0), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_permutevar8x32_ps(c, i1), acc1[r]);
      }
    }
  }
  __m256 v[R];
  for (int r = 0; r < R; ++r)
    v[r] = _mm256_add_ps(_mm256_add_ps(acc0[r], acc1[r]),
                         _mm256_add_ps(_mm512_castps512_ps256(mins[r]), _mm512_extractf32x8_ps(mins[r], 1)));
  if constexpr (R == 4) {  // four horizontal sums at once
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  } else {
    for (int r = 0; r < R; ++r) out[r] = hsum256(v[r]);
  }
}

// out [M, N] fp32 = x [M, K] against 4-bit weights qw [N, K/2] (uint8), d and m [N, K/32] (float16); K % 64 == 0.
void int4_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m) {
  const int64_t M = x.size(0), K = x.size(1), N = qw.size(0), G = K / 32;
  TORCH_CHECK(K % 64 == 0 && qw.size(1) == K / 2 && d.size(1) == G && m.size(1) == G, "int4_linear: bad shapes");
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> qa(M * K);
  std::vector<float> da(M * G), sa(M * G);
  for (int64_t r = 0; r < M; ++r) quantize_activation(xp + r * K, K, qa.data() + r * K, da.data() + r * G, sa.data() + r * G);
  const uint8_t* wp = qw.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  constexpr int R = 4;
  at::parallel_for(0, (N + R - 1) / R, 4, [&](int64_t begin, int64_t end) {
    float dots[R];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * R, rows = std::min<int64_t>(R, N - n0);
      const uint8_t* row = wp + n0 * (K / 2);
      for (int64_t t = 0; t < M; ++t) {
        const int8_t* a = qa.data() + t * K;
        const float* dat = da.data() + t * G;
        const float* sat = sa.data() + t * G;
        if (rows == R) int4_dot<R>(row, dp + n0 * G, mp + n0 * G, K, a, dat, sat, dots);
        else for (int64_t r = 0; r < rows; ++r)
          int4_dot<1>(row + r * (K / 2), dp + (n0 + r) * G, mp + (n0 + r) * G, K, a, dat, sat, dots + r);
        for (int64_t r = 0; r < rows; ++r) op[t * N + n0 + r] = dots[r];
      }
    }
  });
}
#else  // no AVX512-VNNI here: Int4Dense dequantizes and uses PyTorch's matmul
bool has_int4() { return false; }
void int4_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "int4_linear needs AVX512-VNNI");
}
#endif

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

// ---- a decoder layer's decode-sized work in two calls (llama.py's DecoderLayer.forward, float32 activations) ----
// A linear layer arrives as its tensors: float32 Dense [weight [in, out], (bias)], Int8Dense [weight int8 [out, in],
// scale, (bias)] or Int4Dense [qweight uint8, scale, minimum, (bias)].
static void linear_into(const std::vector<torch::Tensor>& L, const torch::Tensor& x_, torch::Tensor out) {
  const torch::Tensor x = x_.contiguous();
  size_t n;
  if (L[0].scalar_type() == at::kByte) { int4_linear(out, x, L[0], L[1], L[2]); n = 3; }
  else if (L[0].scalar_type() == at::kChar) { int8_linear(out, x, L[0], L[1]); n = 2; }
  else { at::mm_out(out, x, L[0]); n = 1; }
  if (L.size() > n) out.add_(L[n]);
}

static int64_t out_features(const std::vector<torch::Tensor>& L) {
  return L[0].scalar_type() == at::kFloat ? L[0].size(1) : L[0].size(0);
}

// qkv [T, (H + 2 KVH) * D] = (RMSNorm of residual += x) W_qkv, with RoPE applied to its first rope_heads heads.
// x undefined: the first layer, whose residual is its input. With k_cache/v_cache (a float32 KVStore layer,
// [blocks, block_size, KVH, D]) and slots, the step's k and v rows are then stored at their slots.
void attn_in(torch::Tensor qkv, torch::Tensor residual, c10::optional<torch::Tensor> x, torch::Tensor norm, double eps,
             std::vector<torch::Tensor> w_qkv, torch::Tensor cos, torch::Tensor sin, int64_t rope_heads, int64_t head_dim,
             c10::optional<torch::Tensor> k_cache, c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slots) {
  auto h = torch::empty_like(residual);
  add_rms_norm(h, residual, x, norm, eps);
  linear_into(w_qkv, h, qkv);
  rope_(qkv.view({qkv.size(0), -1, head_dim}).narrow(1, 0, rope_heads), cos, sin);
  if (!k_cache.has_value()) return;
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
}

// out [T, hidden] = down(silu(gate) * up) of RMSNorm(residual += o_proj(attn)), gate/up fused as [gate | up].
void mlp(torch::Tensor out, torch::Tensor residual, torch::Tensor attn, std::vector<torch::Tensor> w_o, torch::Tensor norm,
         double eps, std::vector<torch::Tensor> w_gate_up, std::vector<torch::Tensor> w_down) {
  const int64_t T = residual.size(0), I = out_features(w_gate_up) / 2;
  auto o = torch::empty_like(residual);
  linear_into(w_o, attn, o);
  auto h = torch::empty_like(residual);
  add_rms_norm(h, residual, o, norm, eps);
  auto gu = torch::empty({T, 2 * I}, residual.options());
  linear_into(w_gate_up, h, gu);
  auto act = torch::empty({T, I}, residual.options());
  float* gp = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gp + t * 2 * I;
    const float* u = g + I;
    float* a = ap + t * I;
    #pragma omp simd
    for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
  linear_into(w_down, act, out);
}
"""

_module = None
_tried = False
_int4: bool | None = None


def has_int4() -> bool:
    """Whether the compiled kernels include int4_linear (AVX512-VNNI)."""
    global _int4
    if _int4 is None:
        _int4 = load() is not None and bool(load().has_int4())
    return _int4


def load():
    """The compiled kernels, or None where they cannot be built (no compiler, no AVX-512; KVCACHE_CPU_KERNEL=0)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    _module = native.build("kvcache_cpu_model", _SOURCE, ["int8_linear", "int4_linear", "has_int4", "add_rms_norm",
                           "rope_", "attn_in", "mlp"], [], "using PyTorch's ops")
    return _module
