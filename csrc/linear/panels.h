// Float32 weights in panels of 32 output channels, and the GGUF codes that decode to them bit for bit (llama.py's
// Dense.pack): what panels.cpp computes with and layer.cpp hands it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "../isa.h"

namespace kvcache {

constexpr int64_t PANEL = 32, PANEL_CHUNK = 128, PANEL_X_BYTES = 512 << 10;


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
  // panel p (-1: none) as a float32 one to read ahead, or null: float32 panels only
  const float* ahead(int64_t p) const { return w != nullptr && p >= 0 ? w + p * K * PANEL : nullptr; }
  int64_t buffer() const { return w != nullptr ? 0 : K * PANEL; }  // floats get's buf needs
};

// A linear layer's tensors (see layer.cpp's linear) as panels, if they are: float32 panels [weight, (bias)], or with
// the same weights' code panels after them [weight, codes, scale, minimum, (bias)], which steps of up to code_rows()
// rows take; `n` becomes how many tensors the weight takes.
bool as_panels(const std::vector<at::Tensor>& L, const at::Tensor& x, Panels& w, size_t& n);
// out [M, N] = x [M, K] W^T for W in panels
void panels_linear(at::Tensor out, const at::Tensor& x, const Panels& w, const char* what);
// act [M, I] = silu(gate) * up of x [M, K] times [gate | up] in panels, without [M, 2I] between them
void panels_gate_up_silu(at::Tensor act, const at::Tensor& x, const Panels& w);

}  // namespace kvcache
