// A decode step's decoder layers in one call (llama.py's LlamaModel.forward, decode-only steps): per layer attn_in,
// paged_decode and mlp, the calls the layers' fused forward makes, without returning to Python between them.
#include <vector>

#include "../ops.h"

namespace kvcache {

// [x, residual] after every layer, for a step whose rows all decode: per layer attn_in (which stores K/V at
// `slots`), paged_decode over the float32, float16 or bfloat16 cache and mlp, the calls
// DecoderLayer._forward_fused makes, with the same arguments, so the same floats. x [T, hidden] is the embeddings
// (it becomes the residual stream, in place).
// `weights` holds each layer's input norm, post-attention norm, then its q/k/v, output, gate/up and down linears'
// tensors, `counts` [layers * 4] how many tensors each linear has; `caches` every layer's K then every layer's V;
// `windows` each layer's sliding window (0: none). Python's decode step made ~40 calls a layer: ~2.5 ms a step.
std::vector<Tensor> decode_layers(Tensor x, std::vector<Tensor> weights, std::vector<int64_t> counts,
                                  std::vector<Tensor> caches, std::vector<int64_t> windows, double eps, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, int64_t inter, Tensor cos, Tensor sin,
                                  Tensor slots, Tensor block_table, Tensor context_lens, Tensor runs, double scale,
                                  int64_t split_tokens) {
  const int64_t L = (int64_t)windows.size();
  TORCH_CHECK(L > 0 && (int64_t)counts.size() == 4 * L && (int64_t)caches.size() == 2 * L &&
              x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "decode_layers: ", L, " layers need 4 counts and 2 caches each, and x [T, hidden] contiguous float32");
  const int64_t T = x.size(0), hidden = x.size(1);
  int64_t expected = 2 * L;
  for (int64_t n : counts) {
    TORCH_CHECK(n >= 1, "decode_layers: a linear layer of ", n, " tensors");
    expected += n;
  }
  TORCH_CHECK((int64_t)weights.size() == expected, "decode_layers: the counts and norms make ", expected,
              " weights, not ", weights.size());
  Tensor residual = x, out;
  size_t at = 0;
  auto take = [&](int64_t n) {
    std::vector<Tensor> part(weights.begin() + at, weights.begin() + at + n);
    at += n;
    return part;
  };
  for (int64_t l = 0; l < L; ++l) {
    const Tensor norm_in = weights.at(at++), norm_post = weights.at(at++);
    const auto w_qkv = take(counts[4 * l]), w_o = take(counts[4 * l + 1]);
    const auto w_gate_up = take(counts[4 * l + 2]), w_down = take(counts[4 * l + 3]);
    const Tensor qkv = attn_in(residual, l == 0 ? OptTensor() : OptTensor(out), norm_in, eps, w_qkv,
                               (heads + 2 * kv_heads) * head_dim, cos, sin, heads + kv_heads, head_dim, caches[l],
                               caches[L + l], slots);
    const Tensor q = qkv.view({T, heads + 2 * kv_heads, head_dim}).narrow(1, 0, heads);
    Tensor o = x.new_empty({T, heads, head_dim});
    paged_decode(o, q, caches[l], caches[L + l], block_table, context_lens, scale, windows[l], 0.0, split_tokens, runs);
    out = mlp(residual, o.view({T, heads * head_dim}), w_o, norm_post, eps, w_gate_up, w_down, inter);
  }
  TORCH_CHECK(out.size(1) == hidden, "decode_layers: the layers' output has ", out.size(1), " columns, not ", hidden);
  return {out, residual};
}

}  // namespace kvcache
