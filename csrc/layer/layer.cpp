// A decoder layer's work around attention in two calls (llama.py's DecoderLayer.forward, float32 activations):
// attn_in (RMSNorm, the q/k/v product, RoPE and the K/V write) and mlp (the output projection, RMSNorm, gate/up,
// SiLU x up and down), and their pieces (add_rms_norm, rope_, silu_mul).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm_ops.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../isa.h"
#include "../linear/panels.h"
#include "../ops.h"
#include "activation.h"

namespace kvcache {

// residual[t] += x[t] (skipped when x is undefined); out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * w.
void add_rms_norm(Tensor out, Tensor residual, OptTensor x, Tensor w,
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
void rope_(Tensor x, Tensor cos, Tensor sin) {
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

// ---- a decoder layer's work around attention in two calls (llama.py's DecoderLayer.forward, float32 activations) ----
// A linear layer arrives as its tensors: float32 Dense [weight [in, out] or oneDNN-packed, (bias)], Int8Dense [weight int8 [out, in],
// scale, (bias)] or Int4Dense [qweight uint8, scale, minimum, (bias)].
// A float32 weight packed by oneDNN (Dense.pack: mkldnn::_reorder_linear_weight) goes through oneDNN's linear, the
// op PyTorch's own CPU inference path (inductor's weight prepacking) calls, through the dispatcher; its result is
// used as it comes (no copy into a buffer of ours).
static Tensor packed_linear(const Tensor& x, const Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [T, in] times a linear layer of N outputs, as a new [T, N] tensor.
static Tensor linear(const std::vector<Tensor>& L, const Tensor& x_, int64_t N) {
  const Tensor x = x_.contiguous();
  Tensor out;
  size_t n = 1;
  Panels w;
  if (L[0].is_mkldnn()) {
    out = packed_linear(x, L[0]);
  } else if (as_panels(L, x, w, n)) {  // float32 or code panels
    out = x.new_empty({x.size(0), N});
    panels_linear(out, x, w, "linear");
  } else {
    out = x.new_empty({x.size(0), N});
    if (L[0].scalar_type() == at::kByte) {  // Int4Dense or Q8Dense, by the codes' bytes per input
      if (L[0].size(1) * 8 == x.size(1)) int4_linear(out, x, L[0], L[1], L[2]);
      else q8_linear(out, x, L[0], L[1], L[2]);
      n = 3;
    }
    else if (L[0].scalar_type() == at::kChar) { int8_linear(out, x, L[0], L[1]); n = 2; }
    else at::_ops::mm_out::call(x, L[0], out);
  }
  if (L.size() > n) out.add_(L[n]);
  return out;
}

// Row t's k and v (kv floats each, at H and H + kv of its row of src) into slot sp[t] of kp / vp, converted to the
// cache's type as KVStore.write's `x.to(cache.dtype)` converts (round to nearest even).
template <class C>
static void store_rows(C* kp, C* vp, const float* src, const int64_t* sp, int64_t T, int64_t row, int64_t H,
                       int64_t kv) {
  for (int64_t t = 0; t < T; ++t) {
    const float* k = src + t * row + H;
    if constexpr (std::is_same_v<C, float>) {
      std::memcpy(kp + sp[t] * kv, k, kv * sizeof(float));
      std::memcpy(vp + sp[t] * kv, k + kv, kv * sizeof(float));
    } else {
      for (int64_t i = 0; i < kv; ++i) {
        kp[sp[t] * kv + i] = C(k[i]);
        vp[sp[t] * kv + i] = C(k[kv + i]);
      }
    }
  }
}

// qkv [T, cols = (H + 2 KVH) * D] = (RMSNorm of residual += x) W_qkv, with RoPE applied to its first rope_heads
// heads. x undefined: the first layer, whose residual is its input. With k_cache/v_cache (a KVStore layer of float32,
// float16 or bfloat16, [blocks, block_size, KVH, D]) and slots, the step's k and v rows are then stored at their slots.
Tensor attn_in(Tensor residual, OptTensor x, Tensor norm, double eps,
                      std::vector<Tensor> w_qkv, int64_t cols, Tensor cos, Tensor sin,
                      int64_t rope_heads, int64_t head_dim, OptTensor k_cache,
                      OptTensor v_cache, OptTensor slots) {
  auto h = residual.new_empty(residual.sizes());
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
  const auto dtype = k_cache->scalar_type();
  TORCH_CHECK(v_cache->scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
              "attn_in: k_cache and v_cache both float32, float16 or bfloat16");
  const float* src = qkv.data_ptr<float>();
  const int64_t* sp = slots->data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cap, "attn_in: slot ", sp[t], " outside the cache's ", cap);
  if (dtype == at::kFloat) {
    store_rows(k_cache->data_ptr<float>(), v_cache->data_ptr<float>(), src, sp, T, row, H, kv);
  } else if (dtype == at::kHalf) {
    store_rows(k_cache->data_ptr<at::Half>(), v_cache->data_ptr<at::Half>(), src, sp, T, row, H, kv);
  } else {
    store_rows(k_cache->data_ptr<at::BFloat16>(), v_cache->data_ptr<at::BFloat16>(), src, sp, T, row, H, kv);
  }
  return qkv;
}

// act [T, I] = silu(gate) * up for gu [T, 2I] = [gate | up], in one pass: the same floats as
// at::silu(gate).mul_(up) (tests/models/test_cpu_kernels_isa.py), without the tensor between them, the second pass
// and its parallel region: 22 -> 12 us at 32 rows of the demo's 1,536, 1.58 -> 1.12 ms at 2,048 (GCC leaves a loop of
// expf scalar without -ffast-math).
void silu_mul(Tensor act, Tensor gu) {
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

// down(silu(gate) * up) [T, hidden] of RMSNorm(residual += o_proj(attn)), gate/up fused as [gate | up] of I each.
Tensor mlp(Tensor residual, Tensor attn, std::vector<Tensor> w_o, Tensor norm,
                  double eps, std::vector<Tensor> w_gate_up, std::vector<Tensor> w_down, int64_t I) {
  const int64_t D = residual.size(1);
  auto o = linear(w_o, attn, D);
  auto h = residual.new_empty(residual.sizes());
  add_rms_norm(h, residual, o.contiguous(), norm, eps);
  auto act = h.new_empty({h.size(0), I});
  Panels w;
  size_t n = 0;
  if (I % PANEL == 0 && as_panels(w_gate_up, h, w, n) && w_gate_up.size() == n) {
    panels_gate_up_silu(act, h, w);  // panels with no bias: the product and SiLU x up in one pass
  } else {
    silu_mul(act, linear(w_gate_up, h, 2 * I).contiguous());
  }
  return linear(w_down, act, D);
}

}  // namespace kvcache
