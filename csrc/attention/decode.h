// Decode attention for CPU that reads K/V straight from the paged store: the templates paged_decode (decode.cpp) and
// paged_decode_quant's formats (decode_quant.cpp: byte formats; decode_kivi.cpp: KIVI) instantiate, one translation
// unit each so that the build compiles them in parallel.
//
// It walks each sequence's block table one block at a time with an online softmax (flash-decoding): each block's
// keys and values are read once for all heads (the query heads of a KV head share each read), the next block is
// prefetched, and quantized blocks are decoded as they are read. Each sequence's context is cut into splits of
// split_tokens, run in parallel and combined, so that one long sequence keeps every core busy; the splits depend on
// the sequence's own length only, so a row's arithmetic does not depend on what else is in the batch.
//
// out, q: [B, H, D] fp32; k_cache, v_cache: [NB, BS, KVH, D] fp32 (F32Src), fp16 or bf16 (HalfSrc);
// block_tables: [B, MAXNB] int64; context_lens: [B] int64; window <= 0 means none.
// DC is D when known at compile time (the common head sizes), else 0.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "../ops.h"
#include "../parallel.h"
#include "softmax.h"

namespace kvcache {



// Prefetches of a block issued a few cache lines at a time between the pieces of work on the block before it
// (step), instead of all at once: a burst of hundreds fills the core's miss buffers and stalls the arithmetic until
// they drain, so memory and compute took turns (15 GB/s from DRAM, where reading alone runs at 33). flush() issues
// what is left at once (a work item's first blocks, which nothing comes before).
struct Prefetcher {
  const int64_t pieces;  // steps a block's work takes
  const char* p[2] = {nullptr, nullptr};
  int64_t left[2] = {0, 0};  // bytes still to prefetch in each range
  int64_t per = 0;  // lines a step issues
  explicit Prefetcher(int64_t pieces) : pieces(pieces) {}
  // The ranges [a, a + na) and [b, b + nb), over `pieces` steps (what an earlier start left is issued first)
  void start(const void* a, int64_t na, const void* b, int64_t nb) {
    flush();
    p[0] = (const char*)a; left[0] = na; p[1] = (const char*)b; left[1] = nb;
    per = ((na + nb) / 64 + pieces - 1) / pieces + 1;
  }
  void step() { issue(per); }
  void issue(int64_t lines) {
    for (int r = 0; r < 2 && lines > 0; ++r)
      for (; left[r] > 0 && lines > 0; --lines, p[r] += 64, left[r] -= 64) __builtin_prefetch(p[r], 0, 2);
  }
  void flush() { issue(INT64_MAX); }
};

// Blocks read ahead: the first ones at a work item's start at once (a split's first blocks had been demand misses),
// then each one paced through the work on the block before it (Prefetcher). 64 rows x 330 tokens x 30 layers of
// float32 KV from DRAM, 2 threads: 57.5 ms with 2 blocks ahead at once, 56.3 paced, 45.7 with 1 ahead paced
// (20 GB/s, where the same calls on KV held in L2 take 35.7 ms: the kernel's own arithmetic).
constexpr int64_t PF_AHEAD = 1;


// The float32 store: token t of a block is [KVH, D] contiguous in k_cache / v_cache [NB, BS, KVH, D].
struct F32Src {
  const float *k, *v;
  int64_t blk, tok, D;
  const float *kb = nullptr, *vb = nullptr;
  void seq(int64_t) {}
  void block(int64_t id, int64_t) { kb = k + id * blk; vb = v + id * blk; }
  void prefetch(Prefetcher& pf, int64_t id) const { pf.start(k + id * blk, blk * 4, v + id * blk, blk * 4); }
  // KV head kh's keys (values) of the current block: token t's at p + t * stride
  const float* keys(int64_t kh, int64_t, int64_t, int64_t& stride) { stride = tok; return kb + kh * D; }
  const float* values(int64_t kh, int64_t, int64_t, int64_t& stride) { stride = tok; return vb + kh * D; }
};

// A float16 or bfloat16 store (BF16 false / true) in F32Src's layout: each block's keys (values) of one KV head are
// widened to float32 as they are read, into kbuf / vbuf (BS x D floats, one per thread): F16C's vcvtph2ps, or a
// bfloat16's bits shifted into a float's top half. Half the bytes of float32 (llama.cpp's default cache format).
template <bool BF16>
struct HalfSrc {
  const uint16_t *k, *v;
  int64_t blk, tok, D;
  const uint16_t *kb = nullptr, *vb = nullptr;
  std::vector<float> kbuf, vbuf;
  void init(int64_t block_size) { kbuf.resize(block_size * D); vbuf.resize(block_size * D); }
  void seq(int64_t) {}
  void block(int64_t id, int64_t) { kb = k + id * blk; vb = v + id * blk; }
  void prefetch(Prefetcher& pf, int64_t id) const { pf.start(k + id * blk, blk * 2, v + id * blk, blk * 2); }
  // out[0..D) = the D halves at h, widened
  void widen(float* out, const uint16_t* h) const {
    int64_t d = 0;
#if defined(KVCACHE_AVX512) || defined(KVCACHE_AVX2)
    for (; d + 8 <= D; d += 8) {
      const __m128i x = _mm_loadu_si128((const __m128i*)(h + d));
      if constexpr (BF16)
        _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
      else
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(x));
    }
#endif
    for (; d < D; ++d) {
      if constexpr (BF16) {
        const uint32_t bits = (uint32_t)h[d] << 16;
        std::memcpy(out + d, &bits, 4);
      } else {
        out[d] = (float)c10::Half(h[d], c10::Half::from_bits());
      }
    }
  }
  const float* widened(std::vector<float>& buf, const uint16_t* base, int64_t kh, int64_t t0, int64_t t1,
                       int64_t& stride) const {
    stride = D;
    for (int64_t t = t0; t < t1; ++t) widen(buf.data() + t * D, base + t * tok + kh * D);
    return buf.data();
  }
  // KV head kh's keys (values) of tokens t0..t1 of the current block: token t's at p + t * stride
  const float* keys(int64_t kh, int64_t t0, int64_t t1, int64_t& stride) {
    return widened(kbuf, kb, kh, t0, t1, stride);
  }
  const float* values(int64_t kh, int64_t t0, int64_t t1, int64_t& stride) {
    return widened(vbuf, vb, kh, t0, t1, stride);
  }
};

// An fp8 byte as float32, vectorizable (a table lookup is a gather), with no float32 denormal on the way (the
// engine runs with denormals flushed): a normal code's exponent is rebiased in the integer bits, a subnormal one is
// mantissa x 2^(1 - bias - mantissa bits), exact. Non-finite codes (e4m3fn: 0x7F/0xFF NaN; e5m2: exponent 31, inf
// or NaN) stay non-finite.
template <int EXP>
static inline float fp8_value(uint32_t c) {
  constexpr int MANT = 7 - EXP, BIAS = (1 << (EXP - 1)) - 1;
  constexpr uint32_t top = ((1u << EXP) - 1) << MANT;  // the all-ones exponent field
  constexpr float SUB = EXP == 4 ? 0x1p-9f : 0x1p-16f;  // 2^(1 - BIAS - MANT)
  const uint32_t mag = c & 0x7Fu, mant = mag & ((1u << MANT) - 1);
  const bool special = EXP == 4 ? mag == 0x7Fu : (mag & top) == top;
  uint32_t bits = (mag << (23 - MANT)) + ((uint32_t)(127 - BIAS) << 23);
  if (special) bits = EXP == 4 ? 0x7FC00000u : (0x7F800000u | (mant << 21));
  float f;
  std::memcpy(&f, &bits, 4);
  if ((mag & top) == 0) f = (float)mant * SUB;  // zero and the subnormals
  uint32_t out;
  std::memcpy(&out, &f, 4);
  out |= (c & 0x80u) << 24;
  std::memcpy(&f, &out, 4);
  return f;
}

// Codes decoded 16 at a time (vectors of one register each: an AVX-512 one, or two AVX2 halves; GCC lowers a
// 16-lane vector's selects and broadcasts on AVX2 through the stack), as fp8_value and QuantSrc::code decode one.
// The loops over code() stayed scalar for fp8 (its branches) and KIVI (its per-code shifts): an fp8 cache was read
// 1.3x, an int4 one 3x slower than float32.
#if defined(KVCACHE_AVX512)
typedef int32_t vireg __attribute__((vector_size(64), aligned(4)));
typedef v16 vfreg;
#else
typedef int32_t vireg __attribute__((vector_size(32), aligned(4)));
typedef v8 vfreg;
#endif
constexpr int LANES = sizeof(vfreg) / 4, PARTS = 16 / LANES;

template <int EXP>
static inline vfreg fp8_lanes(vireg c) {
  constexpr int MANT = 7 - EXP, BIAS = (1 << (EXP - 1)) - 1;
  constexpr int32_t top = ((1 << EXP) - 1) << MANT;
  const vireg mag = c & 0x7F, mant = mag & ((1 << MANT) - 1);
  vireg bits = (mag << (23 - MANT)) + ((127 - BIAS) << 23);
  const vfreg sub = __builtin_convertvector(mant, vfreg) * (EXP == 4 ? 0x1p-9f : 0x1p-16f);  // zero, subnormals
  bits = (mag & top) == 0 ? (vireg)sub : bits;
  if constexpr (EXP == 4) bits = mag == 0x7F ? vireg{} + 0x7FC00000 : bits;
  else bits = (mag & top) == top ? (0x7F800000 | (mant << 21)) : bits;
  return (vfreg)(bits | ((c & 0x80) << 24));
}

// One register of codes from their bytes widened to int32 (a KIVI byte repeated once per code it holds)
template <int CODE>
static inline vfreg code_lanes(vireg w) {
  if constexpr (CODE == 1) {
    return __builtin_convertvector(w, vfreg);
  } else if constexpr (CODE == 5 || CODE == 6) {
    return fp8_lanes<CODE == 5 ? 4 : 5>(w);
  } else {  // KIVI: lane i holds code i % PER of its byte, the lowest bits first
    constexpr int PER = 8 / CODE;
    vireg shift;
    for (int i = 0; i < LANES; ++i) shift[i] = (i % PER) * CODE;
    return __builtin_convertvector((w >> shift) & ((1 << CODE) - 1), vfreg);
  }
}

// Codes d0 .. d0 + 15 (d0 a multiple of 16) of the codes at c: PARTS registers of LANES
template <int CODE>
static inline void codes16(const uint8_t* c, int64_t d0, vfreg* out) {
#if defined(KVCACHE_AVX512) || defined(KVCACHE_AVX2)
  __m128i b;  // one byte per code
  if constexpr (CODE == 4) {
    const __m128i x = _mm_loadl_epi64((const __m128i*)(c + d0 / 2));
    b = _mm_unpacklo_epi8(x, x);
  } else if constexpr (CODE == 2) {
    int32_t four;
    std::memcpy(&four, c + d0 / 4, 4);
    const __m128i x = _mm_cvtsi32_si128(four), x2 = _mm_unpacklo_epi8(x, x);
    b = _mm_unpacklo_epi16(x2, x2);
  } else {
    b = _mm_loadu_si128((const __m128i*)(c + d0));
  }
#if defined(KVCACHE_AVX512)
  out[0] = code_lanes<CODE>((vireg)(CODE == 1 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b)));
#else
  const __m128i h = _mm_unpackhi_epi64(b, b);
  out[0] = code_lanes<CODE>((vireg)(CODE == 1 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b)));
  out[1] = code_lanes<CODE>((vireg)(CODE == 1 ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h)));
#endif
#else  // the same bytes, widened in C++
  uint8_t b[16];
  constexpr int PER = CODE == 4 ? 2 : CODE == 2 ? 4 : 1;  // codes a byte holds, each byte repeated that often
  for (int i = 0; i < 16; ++i) b[i] = c[d0 / PER + i / PER];
  for (int p = 0; p < PARTS; ++p) {
    vireg w;
    for (int i = 0; i < LANES; ++i) w[i] = CODE == 1 ? (int32_t)(int8_t)b[p * LANES + i] : (int32_t)b[p * LANES + i];
    out[p] = code_lanes<CODE>(w);
  }
#endif
}

// out[d] = code(d) * s + z, d < D (a multiple of 16)
template <int CODE>
static inline void decode_affine(float* out, const uint8_t* c, int64_t D, float s, float z) {
  for (int64_t d = 0; d < D; d += 16) {
    vfreg x[PARTS];
    codes16<CODE>(c, d, x);
    for (int p = 0; p < PARTS; ++p) *(vfreg*)(out + d + p * LANES) = x[p] * s + z;
  }
}

// out[d] = code(d) * s[d] + z[d], d < D (a multiple of 16)
template <int CODE>
static inline void decode_channels(float* out, const uint8_t* c, int64_t D, const float* s, const float* z) {
  for (int64_t d = 0; d < D; d += 16) {
    vfreg x[PARTS];
    codes16<CODE>(c, d, x);
    for (int p = 0; p < PARTS; ++p) {
      const int64_t at = d + p * LANES;
      *(vfreg*)(out + at) = x[p] * *(const vfreg*)(s + at) + *(const vfreg*)(z + at);
    }
  }
}

// Quantized stores (store/quantized_store.py): each block is one row of `raw` [NB, ROW] bytes holding
// codes, fp16 scales and zero points at byte offsets ko, vo, kso, vso, kzo, vzo. CODE 0: a byte format through
// lut[256], 1: int8, 5 / 6: fp8 e4m3fn / e5m2 decoded arithmetically (fp8_value), one byte per value and one scale
// per token and KV head. CODE 4 / 2: KIVI int4 / int2, PER = 8 / CODE codes a byte; keys scaled per channel over
// groups of GK tokens, values per token over groups of GV channels; keys of positions >= full_start[b] are read in
// full precision from full_src rows full_rows[b]. keys() / values() decode one KV head's tokens of the current block
// into kbuf / vbuf (BS x D floats); one per thread.
struct QuantLayout {
  const uint8_t* raw;
  int64_t ROW, ko, vo, kso, vso, kzo, vzo;
  const float* lut;
  int64_t GK, GV, KVH, D;
  const float* fsrc;
  const int64_t *frows, *fstart;
  int64_t FR;
};

template <int CODE>
struct QuantSrc : QuantLayout {
  static constexpr bool KIVI = CODE == 4 || CODE == 2;
  static constexpr int PER = KIVI ? 8 / CODE : 1;
  static constexpr uint8_t MASK = KIVI ? (1 << CODE) - 1 : 0xFF;
  std::vector<float> kbuf, vbuf, kscale, kzero;
  const uint8_t* row = nullptr;
  int64_t base = 0, fs = 0, BS = 0;
  const int64_t* fr = nullptr;
  static constexpr bool CODED = CODE != 0;  // a format codes16 decodes (not the lookup table's)
  bool VEC = false;  // decode 16 values at a time (codes16): a CODED format, D a multiple of 16
  void init(int64_t block_size) {
    BS = block_size; kbuf.resize(BS * D); vbuf.resize(BS * D); kscale.resize(D); kzero.resize(D);
    VEC = CODED && D % 16 == 0;
  }
  void seq(int64_t b) {
    fs = fstart ? fstart[b] : INT64_MAX;
    fr = frows ? frows + b * FR : nullptr;
  }
  void block(int64_t id, int64_t first) { row = raw + id * ROW; base = first; }
  void prefetch(Prefetcher& pf, int64_t id) const { pf.start(raw + id * ROW, ROW, nullptr, 0); }
  float code(const uint8_t* c, int64_t d) const {
    if constexpr (CODE == 0) return lut[c[d]];
    else if constexpr (CODE == 1) return (float)(int8_t)c[d];
    else if constexpr (CODE == 5) return fp8_value<4>(c[d]);
    else if constexpr (CODE == 6) return fp8_value<5>(c[d]);
    else return (float)((c[d / PER] >> ((d % PER) * CODE)) & MASK);
  }
  // KV head kh's keys of tokens t0..t1 of the current block, decoded: token t's at p + t * stride
  const float* keys(int64_t kh, int64_t t0, int64_t t1, int64_t& stride) {
    stride = D;
    int64_t group = -1;
    for (int64_t t = t0; t < t1; ++t) {
      float* out = kbuf.data() + t * D;
      const int64_t pos = base + t;
      if (pos >= fs) {
        const float* full = fsrc + (fr[pos - fs] * KVH + kh) * D;
        std::copy(full, full + D, out);
      } else if constexpr (!KIVI) {
        const uint8_t* c = row + ko + (t * KVH + kh) * D;
        const float ks = (float)((const at::Half*)(row + kso))[t * KVH + kh];
        if constexpr (CODED) if (VEC) {
          decode_affine<CODE>(out, c, D, ks, 0.f);
          continue;
        }
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] = code(c, d) * ks;
      } else {
        if (t / GK != group) {  // this group's per-channel scales of head kh, converted once
          group = t / GK;
          const at::Half* ks = (const at::Half*)(row + kso) + (group * KVH + kh) * D;
          const at::Half* kz = (const at::Half*)(row + kzo) + (group * KVH + kh) * D;
          for (int64_t d = 0; d < D; ++d) { kscale[d] = (float)ks[d]; kzero[d] = (float)kz[d]; }
        }
        const uint8_t* c = row + ko + (t * KVH + kh) * (D / PER);
        const float *ks = kscale.data(), *kz = kzero.data();
        if constexpr (CODED) if (VEC) {
          decode_channels<CODE>(out, c, D, ks, kz);
          continue;
        }
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] = code(c, d) * ks[d] + kz[d];
      }
    }
    return kbuf.data();
  }
  const float* values(int64_t kh, int64_t t0, int64_t t1, int64_t& stride) {
    stride = D;
    for (int64_t t = t0; t < t1; ++t) {
      float* out = vbuf.data() + t * D;
      if constexpr (!KIVI) {
        const uint8_t* c = row + vo + (t * KVH + kh) * D;
        const float vs = (float)((const at::Half*)(row + vso))[t * KVH + kh];
        if constexpr (CODED) if (VEC) {
          decode_affine<CODE>(out, c, D, vs, 0.f);
          continue;
        }
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] = code(c, d) * vs;
      } else {
        const uint8_t* c = row + vo + (t * KVH + kh) * (D / PER);
        const at::Half* vs = (const at::Half*)(row + vso) + (t * KVH + kh) * (D / GV);
        const at::Half* vz = (const at::Half*)(row + vzo) + (t * KVH + kh) * (D / GV);
        for (int64_t g = 0; g < D / GV; ++g) {
          const float sv = (float)vs[g], zv = (float)vz[g];
          if constexpr (CODED) if (VEC && GV % 16 == 0) {
            decode_affine<CODE>(out + g * GV, c + g * GV / PER, GV, sv, zv);
            continue;
          }
#pragma omp simd
          for (int64_t d = g * GV; d < (g + 1) * GV; ++d) out[d] = code(c, d) * sv + zv;
        }
      }
    }
    return vbuf.data();
  }
};

// The shape of one paged_decode call.
struct Decode {
  float* out;
  const float* q;
  const int64_t *bt, *cl, *runs;
  int64_t B, H, D, BS, KVH, MAXNB, window, split_blocks;
  float sc, cap;
  int64_t qs;  // q's row stride (heads packed by D): a view of the q/k/v product is read in place
  int64_t first_block(int64_t b) const { return window > 0 ? std::max<int64_t>(0, cl[b] - window) / BS : 0; }
  int64_t splits(int64_t b) const {  // by the sequence's own length only: a row's arithmetic is its batch's
    const int64_t blocks = (cl[b] - 1) / BS + 1 - first_block(b);
    return (blocks + split_blocks - 1) / split_blocks;
  }
};

// Token j of 16 goes to x[bitrev4(j)]: lane_sums' tree hands the lanes back in bit-reversed order.
static inline int bitrev4(int j) { return ((j & 1) << 3) | ((j & 2) << 1) | ((j & 4) >> 1) | ((j & 8) >> 3); }

// Lane t of the result = the sum of x[bitrev4(t)]'s 16 lanes: 16 horizontal sums in 15 adds and 30 shuffles.
static inline v16 lane_sums(const v16* x) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// s[i] = (q . k_{t0 + i}) * sc for the n = t1 - t0 keys at k + t * stride. With D a multiple of 16 known at compile
// time, q stays in registers and 16 keys' products are summed across lanes together.
#if defined(KVCACHE_AVX2)
// Lane j of the result = the sum of x[j]'s 8 lanes (AVX2: hadd within 128-bit halves, then the halves added).
static inline __m256 lane_sums8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

template <int64_t DC>
static inline void scores(float* s, const float* q, const float* k, int64_t stride, int64_t t0, int64_t t1,
                          float sc, int64_t Drt) {
#ifdef KVCACHE_AVX2
  // Without AVX-512 the 16-wide path below spills its 16 partial sums (32 ymm halves over 16 registers): here 8
  // keys at a time, the dimension outermost, so the 8 partials and one slice of q fit in registers.
  if constexpr (DC > 0 && DC % 8 == 0) {
    alignas(32) float qs[DC];
    for (int64_t d = 0; d < DC; ++d) qs[d] = q[d] * sc;
    for (int64_t c0 = t0; c0 < t1; c0 += 8) {
      const int64_t n = std::min<int64_t>(8, t1 - c0);
      const float* kt[8];
      for (int j = 0; j < 8; ++j) kt[j] = k + (c0 + std::min<int64_t>(j, n - 1)) * stride;  // past n: the last again
      __m256 x[8];
      const __m256 q0 = _mm256_load_ps(qs);
      for (int j = 0; j < 8; ++j) x[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(kt[j]));
#pragma GCC unroll 16
      for (int64_t d = 8; d < DC; d += 8) {
        const __m256 qd = _mm256_load_ps(qs + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) x[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt[j] + d), x[j]);
      }
      // all 8 stored: s has room for the block's scores rounded up to 16, and those past n are masked by the
      // softmax; 8 scalar stores, read back as one vector by it, had stalled on store forwarding
      _mm256_storeu_ps(s + c0 - t0, lane_sums8(x));
    }
    return;
  }
#endif
  if constexpr (DC > 0 && DC % 16 == 0) {
    constexpr int64_t NV = DC / 16;
    v16 qv[NV];
    for (int64_t u = 0; u < NV; ++u) qv[u] = *(const v16*)(q + 16 * u) * sc;
    for (int64_t c0 = t0; c0 < t1; c0 += 16) {
      const int64_t n = std::min<int64_t>(16, t1 - c0);
      v16 x[16];
      if (n == 16) {  // a whole block's keys: one pointer stepping by stride (GCC had kept 16 in vector registers)
        const float* kt = k + c0 * stride;
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j, kt += stride) {
          v16 p = qv[0] * *(const v16*)kt;
#pragma GCC unroll 8
          for (int64_t u = 1; u < NV; ++u) p += qv[u] * *(const v16*)(kt + 16 * u);
          x[bitrev4(j)] = p;
        }
        *(v16*)(s + c0 - t0) = lane_sums(x);
        continue;
      }
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {  // past n: the last key again (its sums are not stored), no branch
        const float* kt = k + (c0 + std::min<int64_t>(j, n - 1)) * stride;
        v16 p = qv[0] * *(const v16*)kt;
#pragma GCC unroll 8
        for (int64_t u = 1; u < NV; ++u) p += qv[u] * *(const v16*)(kt + 16 * u);
        x[bitrev4(j)] = p;
      }
      const v16 r = lane_sums(x);
      for (int64_t j = 0; j < n; ++j) s[c0 - t0 + j] = r[j];
    }
  } else {
    for (int64_t t = t0; t < t1; ++t) s[t - t0] = dot<DC>(q, k + t * stride, Drt) * sc;
  }
}

#ifdef KVCACHE_AVX2
// acc [8 NV] += sum over i of p[i] * v_{t0 + i} [8 NV], the NV accumulators in registers (NV <= 8: with the
// broadcast, 9 of AVX2's 16)
template <int64_t NV>
static inline void weighted_sum8(float* acc, const float* p, const float* v, int64_t stride, int64_t t0, int64_t t1) {
  __m256 av[NV];
  for (int64_t u = 0; u < NV; ++u) av[u] = _mm256_loadu_ps(acc + 8 * u);
  for (int64_t t = t0; t < t1; ++t) {
    const __m256 wv = _mm256_broadcast_ss(p + (t - t0));
    const float* vt = v + t * stride;
#pragma GCC unroll 8
    for (int64_t u = 0; u < NV; ++u) av[u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vt + 8 * u), av[u]);
  }
  for (int64_t u = 0; u < NV; ++u) _mm256_storeu_ps(acc + 8 * u, av[u]);
}
#endif

// acc [D] += sum over i of p[i] * v_{t0 + i} for the values at v + t * stride; acc in registers where D is known.
template <int64_t DC>
static inline void weighted_sum(float* acc, const float* p, const float* v, int64_t stride, int64_t t0, int64_t t1,
                                int64_t Drt) {
#ifdef KVCACHE_AVX2
  // AVX2: GCC builds a 16-wide broadcast through 16 stores to the stack and reloads (a store-forwarding stall per
  // value, most of this kernel's time): 8-wide accumulators and a real broadcast instead. Past 64 floats, in two
  // passes over the tokens: 16 accumulators and the broadcast do not fit in 16 registers, and D = 128's two spilled
  // accumulators went through the stack at every token (a store and a reload in their chains: docs/kernels.md).
  if constexpr (DC > 0 && DC % 8 == 0 && DC <= 128) {
    constexpr int64_t NV = DC / 8, FIRST = NV <= 8 ? NV : (NV + 1) / 2;
    weighted_sum8<FIRST>(acc, p, v, stride, t0, t1);
    if constexpr (NV > FIRST) weighted_sum8<NV - FIRST>(acc + 8 * FIRST, p, v + 8 * FIRST, stride, t0, t1);
    return;
  }
#endif
  if constexpr (DC > 0 && DC % 16 == 0) {
    constexpr int64_t NV = DC / 16;
    v16 av[NV];
    for (int64_t u = 0; u < NV; ++u) av[u] = *(const v16*)(acc + 16 * u);
    for (int64_t t = t0; t < t1; ++t) {
#ifdef KVCACHE_AVX512
      const v16 wv = (v16)_mm512_set1_ps(p[t - t0]);  // one vbroadcastss
#else
      const float w = p[t - t0];
      const v16 wv = {w, w, w, w, w, w, w, w, w, w, w, w, w, w, w, w};
#endif
      const float* vt = v + t * stride;
#pragma GCC unroll 8
      for (int64_t u = 0; u < NV; ++u) av[u] += wv * *(const v16*)(vt + 16 * u);
    }
    for (int64_t u = 0; u < NV; ++u) *(v16*)(acc + 16 * u) = av[u];
  } else {
    for (int64_t t = t0; t < t1; ++t) axpy<DC>(acc, p[t - t0], v + t * stride, Drt);
  }
}

// Attention of the R rows b..b+R-1 of one sequence (a run: its block table is row b's, row r attends to its first
// cl[b + r] tokens) over its tokens in blocks [bi0, bi1) of the table (within the window: R is 1 under one), one
// block at a time with an online softmax: m, l [R, H] are the running maxima and sums, acc [R, H, D] the
// unnormalised outputs. Each block's keys and values are read once for every row and head (the G = H / KVH query
// heads of a KV head, and the rows, use them while they are in L1); a row computes what it would alone.
// s: R * H * SB floats.
template <int64_t DC, class Src>
static void attend_blocks(const Decode& c, Src& src, int64_t b, int64_t R, int64_t bi0, int64_t bi1, float* s,
                          int64_t SB, float* m, float* l, float* acc, bool started, int64_t next_id) {
  const int64_t D = DC ? DC : c.D, H = c.H, KVH = c.KVH, G = H / KVH, BS = c.BS, Llast = c.cl[b + R - 1];
  const int64_t j0 = c.window > 0 ? std::max<int64_t>(0, c.cl[b] - c.window) : 0;
  const int64_t* table = c.bt + b * c.MAXNB;
  std::fill(m, m + R * H, NO_SCORE);
  std::fill(l, l + R * H, 0.f);
  std::fill(acc, acc + R * H * D, 0.f);
  src.seq(b);
  // a block's work is 2 R H calls (scores and weighted_sum per row and head): its successor's lines are issued over
  // all of them (issued over the scores alone, they came in bursts that stalled on the core's full miss buffers:
  // docs/kernels.md). The item's first block came in with the previous item's last where this thread ran one
  // (`started`); this item's last block brings in the next item's first (`next_id`, -1: none).
  Prefetcher pf(2 * R * H);
  for (int64_t bi = bi0 + (started ? 1 : 0); bi < std::min(bi0 + PF_AHEAD, bi1); ++bi) {
    src.prefetch(pf, table[bi]);
    pf.flush();
  }
  for (int64_t bi = bi0; bi < bi1; ++bi) {
    if (bi + PF_AHEAD < bi1) src.prefetch(pf, table[bi + PF_AHEAD]);
    else if (bi + 1 == bi1 && next_id >= 0) src.prefetch(pf, next_id);  // the next work item's first block
    src.block(table[bi], bi * BS);
    const int64_t t0 = std::max(j0 - bi * BS, (int64_t)0), tmax = std::min(Llast - bi * BS, BS);
    auto end_of = [&](int64_t r) { return std::min(c.cl[b + r] - bi * BS, BS); };  // row r's tokens: t0..end
    int64_t stride;
    for (int64_t kh = 0; kh < KVH; ++kh) {
      const float* k = src.keys(kh, t0, tmax, stride);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t1 = end_of(r);
        for (int64_t g = 0; g < G && t1 > t0; ++g) {
          const int64_t h = kh * G + g, i = r * H + h;
          scores<DC>(s + i * SB, c.q + (b + r) * c.qs + h * D, k, stride, t0, t1, c.sc, D);
          pf.step();
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = end_of(r) - t0;
      for (int64_t h = 0; h < H && n > 0; ++h) {
        const int64_t i = r * H + h;
        float* sh = s + i * SB;
        if (c.cap > 0.f) {
          const float inv_cap = 1.f / c.cap;
          for (int64_t j = 0; j < n; ++j) sh[j] = c.cap * tanhf(sh[j] * inv_cap);
        }
        online_softmax(sh, n, m[i], l[i], acc + i * D, D);
      }
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      const float* v = src.values(kh, t0, tmax, stride);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t t1 = end_of(r);
        for (int64_t g = 0; g < G && t1 > t0; ++g) {
          const int64_t i = r * H + kh * G + g;
          weighted_sum<DC>(acc + i * D, s + i * SB, v, stride, t0, t1, D);
          pf.step();
        }
      }
    }
  }
}

// Every sequence's context is cut into splits of split_blocks blocks (split-K, as flash-decoding does), so that
// one long sequence keeps every thread busy; the work items (run, split) run in parallel, each writing its rows' m,
// l and acc to partials [H, D + 2], and a second pass combines each row's partials in order (a split that holds none
// of a row's tokens adds exactly nothing). A run of one split writes its outputs directly. Runs: `runs[b]` rows
// starting at b are one sequence's consecutive positions (speculative verification), 0 for the rows inside a run;
// null (or a sliding window) makes every row its own run. The splits follow the run's longest row.
template <int64_t DC, class Src>
static void decode(const Decode& c, const Src& proto) {
  const int64_t D = DC ? DC : c.D, H = c.H, P = H * (D + 2);
  std::vector<int64_t> start, size;  // runs
  for (int64_t b = 0; b < c.B;) {
    const int64_t n = c.runs && c.window <= 0 ? c.runs[b] : 1;
    TORCH_CHECK(n >= 1 && b + n <= c.B, "paged_decode: runs[", b, "] = ", n, " with ", c.B, " rows");
    for (int64_t r = 1; r < n; ++r)
      TORCH_CHECK(c.runs[b + r] == 0 && c.cl[b + r] == c.cl[b] + r,
                  "paged_decode: the rows of a run are one sequence's consecutive positions (run at row ", b, ")");
    start.push_back(b);
    size.push_back(n);
    b += n;
  }
  const int64_t U = start.size();
  std::vector<int64_t> first(U + 1, 0), splits(c.B), prow(c.B + 1, 0);  // items of run u: first[u] .. first[u + 1]
  for (int64_t u = 0; u < U; ++u) {
    const int64_t n = c.splits(start[u] + size[u] - 1);
    first[u + 1] = first[u] + n;
    for (int64_t r = 0; r < size[u]; ++r) splits[start[u] + r] = n;
  }
  for (int64_t b = 0; b < c.B; ++b) prow[b + 1] = prow[b] + (splits[b] > 1 ? splits[b] : 0);
  const int64_t items = first[U];
  std::unique_ptr<float[]> partial(new float[prow[c.B] * P]);  // not zeroed: the combine reads only what items wrote
  int64_t most = 1;
  for (int64_t n : size) most = std::max(most, n);
  auto run_of = [&](int64_t it) { return std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1; };
  parallel_items(items, [&](WorkQueue& q) {  // items taken as threads free up: their lengths differ
    Src src = proto;
    if constexpr (!std::is_same_v<Src, F32Src>) src.init(c.BS);
    const int64_t SB = (c.BS + 15) / 16 * 16;  // a head's scores, padded for lane_sums' 16 at a time
    std::vector<float> s(most * H * SB), ml(2 * most * H), acc(most * H * D);
    bool started = false;  // this thread ran an item before, which read this one's first block in with its last
    q.each([&](int64_t it, int64_t nx) {
      const int64_t u = run_of(it);
      const int64_t b = start[u], R = size[u], n = first[u + 1] - first[u], sp = it - first[u];
      const int64_t b0 = c.first_block(b) + sp * c.split_blocks;
      const int64_t b1 = std::min(b0 + c.split_blocks, (c.cl[b + R - 1] - 1) / c.BS + 1);
      float *m = ml.data(), *l = ml.data() + R * H;
      int64_t next_id = -1;  // the block this thread reads next, after this item's last: paced in with the last
      if (nx >= 0) {
        const int64_t v = run_of(nx);
        next_id = c.bt[start[v] * c.MAXNB + c.first_block(start[v]) + (nx - first[v]) * c.split_blocks];
      }
      attend_blocks<DC>(c, src, b, R, b0, b1, s.data(), SB, m, l, acc.data(), started, next_id);
      for (int64_t r = 0; r < R; ++r) {
        if (n == 1) {
          normalise(c.out + (b + r) * H * D, acc.data() + r * H * D, l + r * H, H, D);
        } else {
          float* p = partial.get() + (prow[b + r] + sp) * P;
          std::copy(m + r * H, m + (r + 1) * H, p);
          std::copy(l + r * H, l + (r + 1) * H, p + H);
          std::copy(acc.data() + r * H * D, acc.data() + (r + 1) * H * D, p + 2 * H);
        }
      }
      started = true;
    });
  });
  if (prow[c.B] == 0) return;
  at::parallel_for(0, c.B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    for (int64_t b = begin; b < end; ++b) {
      if (splits[b] == 1) continue;
      // the row's own splits: those of its run past its length hold nothing, and leaving them out keeps its
      // arithmetic (the loop's trip count) what it is alone
      const int64_t n = c.splits(b);
      const float* p0 = partial.get() + prow[b] * P;
      float* o = c.out + b * H * D;
      if (n == 1) {
        normalise(o, p0 + 2 * H, p0 + H, H, D);
        continue;
      }
      w.resize(n);
      for (int64_t h = 0; h < H; ++h) {
        float mx = NO_SCORE, sum = 0.f;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p0[i * P + h]);
        for (int64_t i = 0; i < n; ++i) {
          const float li = p0[i * P + H + h];
          w[i] = li > 0.f ? expf(p0[i * P + h] - mx) : 0.f;
          sum += w[i] * li;
        }
        float* oh = o + h * D;
        std::fill(oh, oh + D, 0.f);
        for (int64_t i = 0; i < n; ++i)
          if (w[i] > 0.f) axpy<DC>(oh, w[i] / sum, p0 + i * P + 2 * H + h * D, D);
      }
    }
  });
}

template <class Src>
static void decode_dispatch(const Decode& c, const Src& src) {
  if (c.D == 64) decode<64>(c, src);
  else if (c.D == 128) decode<128>(c, src);
  else decode<0>(c, src);
}

// The shape of a call (checked) from its tensors
Decode decode_shape(Tensor out, Tensor q, Tensor block_tables, Tensor context_lens, int64_t block_size,
                    int64_t kv_heads, double scale, int64_t window, double softcap, int64_t split_tokens, Tensor runs);

// decode over a quantized store of format CODE (see QuantSrc)
template <int CODE>
void decode_quant(const Decode& c, const QuantLayout& layout) {
  QuantSrc<CODE> src;
  static_cast<QuantLayout&>(src) = layout;
  decode_dispatch(c, src);
}
extern template void decode_quant<0>(const Decode&, const QuantLayout&);
extern template void decode_quant<1>(const Decode&, const QuantLayout&);
extern template void decode_quant<5>(const Decode&, const QuantLayout&);
extern template void decode_quant<6>(const Decode&, const QuantLayout&);
extern template void decode_quant<4>(const Decode&, const QuantLayout&);
extern template void decode_quant<2>(const Decode&, const QuantLayout&);

}  // namespace kvcache
