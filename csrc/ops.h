// Every kernel an ISA module exports, and the table (Ops) through which the bindings (csrc/bindings.cpp, the _C
// module) call the variant kvcache.native chose. Each ISA module (csrc/module.cpp) fills one table with its own
// definitions of these functions; the functions call each other directly (decode_layers calls paged_decode), never
// through another module.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace kvcache {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

// ---- attention (csrc/attention) ----
// out [B, H, D] = attention of q [B, H, D] over the first context_lens[b] tokens of block_tables[b] in a float32,
// float16 or bfloat16 store (k_cache, v_cache [blocks, block_size, KVH, D]); window <= 0: none; softcap <= 0: none;
// runs: see decode.cpp
void paged_decode(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens,
                  double scale, int64_t window, double softcap, int64_t split_tokens, Tensor runs);
// paged_decode over a quantized store's raw block bytes (store/quantized_store.py), decoded as they are read
void paged_decode_quant(Tensor out, Tensor q, Tensor raw, std::vector<int64_t> offsets, int64_t code, Tensor lut,
                        int64_t gk, int64_t gv, int64_t block_size, int64_t kv_heads, Tensor block_tables,
                        Tensor context_lens, double scale, int64_t window, Tensor full_src, Tensor full_rows,
                        Tensor full_start, double softcap, int64_t split_tokens, Tensor runs);
// out [n, H, D] = causal attention of the last n positions q [n, H, D] over k, v [L >= n, KVH, D] (float32)
void prefill_attention(Tensor out, Tensor q, Tensor k, Tensor v, double scale);

// ---- linear layers (csrc/linear) ----
void pack_panels(Tensor w, Tensor out);
void panel_linear(Tensor out, Tensor x, Tensor panels);
void code_panel_linear(Tensor out, Tensor x, Tensor codes, Tensor scale, Tensor minimum);
int64_t code_rows();
void gate_up_silu(Tensor act, Tensor x, Tensor panels);
void int8_linear(Tensor out, Tensor x, Tensor w, Tensor scale);
void int4_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m);
void q8_linear(Tensor out, Tensor x, Tensor qw, Tensor d, Tensor m);
bool has_int4();

// ---- a decoder layer's work around attention (csrc/layer) ----
void add_rms_norm(Tensor out, Tensor residual, OptTensor x, Tensor w, double eps);
void rope_(Tensor x, Tensor cos, Tensor sin);
void silu_mul(Tensor act, Tensor gu);
Tensor attn_in(Tensor residual, OptTensor x, Tensor norm, double eps, std::vector<Tensor> w_qkv, int64_t cols,
               Tensor cos, Tensor sin, int64_t rope_heads, int64_t head_dim, OptTensor k_cache, OptTensor v_cache,
               OptTensor slots);
Tensor mlp(Tensor residual, Tensor attn, std::vector<Tensor> w_o, Tensor norm, double eps,
           std::vector<Tensor> w_gate_up, std::vector<Tensor> w_down, int64_t inter);
std::vector<Tensor> decode_layers(Tensor x, std::vector<Tensor> weights, std::vector<int64_t> counts,
                                  std::vector<Tensor> caches, std::vector<int64_t> windows, double eps, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, int64_t inter, Tensor cos, Tensor sin,
                                  Tensor slots, Tensor block_table, Tensor context_lens, Tensor runs, double scale,
                                  int64_t split_tokens);

// ---- sampling (csrc/sampling.cpp) ----
std::vector<Tensor> argmax_finite(Tensor x);

// The table: bump OPS_VERSION whenever a field or a signature changes, so that a module built from other sources
// is refused instead of called through the wrong signature.
constexpr int OPS_VERSION = 1;

struct Ops {
  int version;
  const char* isa;
#define KVCACHE_OP(name) decltype(&kvcache::name) name
  KVCACHE_OP(paged_decode);
  KVCACHE_OP(paged_decode_quant);
  KVCACHE_OP(prefill_attention);
  KVCACHE_OP(pack_panels);
  KVCACHE_OP(panel_linear);
  KVCACHE_OP(code_panel_linear);
  KVCACHE_OP(code_rows);
  KVCACHE_OP(gate_up_silu);
  KVCACHE_OP(int8_linear);
  KVCACHE_OP(int4_linear);
  KVCACHE_OP(q8_linear);
  KVCACHE_OP(has_int4);
  KVCACHE_OP(add_rms_norm);
  KVCACHE_OP(rope_);
  KVCACHE_OP(silu_mul);
  KVCACHE_OP(attn_in);
  KVCACHE_OP(mlp);
  KVCACHE_OP(decode_layers);
  KVCACHE_OP(argmax_finite);
#undef KVCACHE_OP
};

}  // namespace kvcache
