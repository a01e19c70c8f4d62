// paged_decode (a float32, float16 or bfloat16 store) and paged_decode_quant (a quantized one): each call's checks
// and shape, then the templates of decode.h.
#include "decode.h"

namespace kvcache {

Decode decode_shape(Tensor out, Tensor q, Tensor block_tables, Tensor context_lens,
                           int64_t block_size, int64_t kv_heads, double scale, int64_t window, double softcap,
                           int64_t split_tokens, Tensor runs) {
  TORCH_CHECK(runs.numel() == 0 || (runs.is_contiguous() && runs.scalar_type() == at::kLong && runs.numel() == q.size(0)),
              "runs: one int64 per row");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2)) &&
              (q.size(0) == 1 || q.stride(0) >= q.size(1) * q.size(2)) &&
              out.is_contiguous() && q.scalar_type() == at::kFloat && out.sizes() == q.sizes(),
              "paged_decode: q [B, H, D] float32 with heads packed by D (any row stride), out contiguous like q");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.size(0) == q.size(0) &&
              context_lens.numel() == q.size(0) && q.size(1) % kv_heads == 0 && split_tokens > 0);
  return Decode{out.data_ptr<float>(), q.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                context_lens.data_ptr<int64_t>(), runs.numel() ? runs.data_ptr<int64_t>() : nullptr, q.size(0), q.size(1), q.size(2), block_size, kv_heads,
                block_tables.size(1), window, std::max<int64_t>(1, split_tokens / block_size), (float)scale,
                (float)softcap, q.stride(0)};
}

void paged_decode_quant(Tensor out, Tensor q, Tensor raw, std::vector<int64_t> offsets,
                        int64_t code, Tensor lut, int64_t gk, int64_t gv, int64_t block_size,
                        int64_t kv_heads, Tensor block_tables, Tensor context_lens, double scale,
                        int64_t window, Tensor full_src, Tensor full_rows, Tensor full_start,
                        double softcap, int64_t split_tokens, Tensor runs) {
  TORCH_CHECK(raw.is_contiguous() && lut.is_contiguous() && offsets.size() == 6);
  TORCH_CHECK(lut.scalar_type() == at::kFloat && raw.scalar_type() == at::kByte);
  const Decode c = decode_shape(out, q, block_tables, context_lens, block_size, kv_heads, scale, window, softcap,
                                split_tokens, runs);
  const bool kivi = code == 4 || code == 2;
  TORCH_CHECK(!kivi || runs.numel() == 0, "KIVI rows attend one at a time (no runs)");
  if (kivi) TORCH_CHECK(full_src.is_contiguous() && full_rows.is_contiguous() && full_start.is_contiguous() &&
                        full_src.scalar_type() == at::kFloat);
  QuantLayout src;
  src.raw = raw.data_ptr<uint8_t>(); src.ROW = raw.size(1);
  src.ko = offsets[0]; src.vo = offsets[1]; src.kso = offsets[2]; src.vso = offsets[3]; src.kzo = offsets[4];
  src.vzo = offsets[5]; src.lut = lut.data_ptr<float>(); src.GK = gk; src.GV = gv; src.KVH = kv_heads;
  src.D = c.D;
  src.fsrc = kivi ? full_src.data_ptr<float>() : nullptr;
  src.frows = kivi ? full_rows.data_ptr<int64_t>() : nullptr;
  src.fstart = kivi ? full_start.data_ptr<int64_t>() : nullptr;
  src.FR = kivi ? full_rows.size(1) : 0;
  switch (code) {
    case 0: decode_quant<0>(c, src); break;
    case 1: decode_quant<1>(c, src); break;
    case 5: decode_quant<5>(c, src); break;
    case 6: decode_quant<6>(c, src); break;
    case 4: decode_quant<4>(c, src); break;
    case 2: decode_quant<2>(c, src); break;
    default: TORCH_CHECK(false, "paged_decode_quant: unknown format code ", code);
  }
}

void paged_decode(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache,
                  Tensor block_tables, Tensor context_lens, double scale, int64_t window,
                  double softcap, int64_t split_tokens, Tensor runs) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == dtype &&
              (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) && k_cache.dim() == 4 &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2),
              "paged_decode: k_cache and v_cache [blocks, block_size, KVH, D] contiguous, both float32, float16 or "
              "bfloat16, with q's D");
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), D = q.size(2);
  const Decode c = decode_shape(out, q, block_tables, context_lens, BS, KVH, scale, window, softcap, split_tokens,
                                runs);
  if (dtype == at::kFloat) {
    decode_dispatch(c, F32Src{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), BS * KVH * D, KVH * D, D});
    return;
  }
  const auto* k = (const uint16_t*)k_cache.data_ptr();
  const auto* v = (const uint16_t*)v_cache.data_ptr();
  if (dtype == at::kHalf) decode_dispatch(c, HalfSrc<false>{k, v, BS * KVH * D, KVH * D, D});
  else decode_dispatch(c, HalfSrc<true>{k, v, BS * KVH * D, KVH * D, D});
}


}  // namespace kvcache
