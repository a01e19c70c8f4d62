"""A C++ decode-attention kernel for CPU that reads K/V straight from the paged store.

The portable path gathers each sequence's blocks into a padded buffer before SDPA, which on CPU costs as much
memory traffic as the attention itself. This kernel walks the block table instead, one block at a time with an
online softmax (flash-decoding): each block's keys and values are read once for all heads (the query heads of a KV
head share each read), the next block is prefetched, and quantized blocks are decoded as they are read. Each
sequence's context is cut into splits of SPLIT_TOKENS, run in parallel and combined, so that one long sequence
keeps every core busy (one sequence on one core reads its KV at half the machine's bandwidth); the splits depend on
the sequence's own length only, so a row's arithmetic does not depend on what else is in the batch.

Compiled on first use with the system C++ compiler (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions); if that fails the engine keeps the portable path and says so once. It is built with
-fopenmp so that at::parallel_for runs on torch's own OpenMP pool: the loader resolves libgomp.so.1 to the copy torch
already loaded, so no second runtime competes for the cores.
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
#include <climits>
#include <cstring>
#include <immintrin.h>
#include <math.h>
#include <memory>
#include <type_traits>
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

template <int64_t DC>
static inline void axpy(float* a, float p, const float* v, int64_t Drt) {
  if constexpr (DC > 0 && DC % 16 == 0) {
#pragma GCC unroll 8
    for (int64_t d = 0; d < DC; d += 16) *(v16*)(a + d) += p * *(const v16*)(v + d);  // p broadcast
  } else {
#pragma omp simd
    for (int64_t d = 0; d < Drt; ++d) a[d] += p * v[d];
  }
}

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

// Running maxima start here, not at -inf: -ffast-math assumes finite floats.
constexpr float NO_SCORE = -1e30f;

// o [H, D] = acc [H, D] / l [H], the online softmax's output.
static inline void normalise(float* o, const float* acc, const float* l, int64_t H, int64_t D) {
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[h * D + d] * inv;
  }
}

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

static inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

static inline float hmax(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
           b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 c = a > b ? a : b;
  const v4 d = __builtin_shufflevector(c, c, 0, 1, 2, 3), e = __builtin_shufflevector(c, c, 4, 5, 6, 7);
  const v4 f = d > e ? d : e;
  return std::max(std::max(f[0], f[1]), std::max(f[2], f[3]));
}

// exp(x) on 16 lanes with x <= 0, exactly 0 below -87 (float32's normal range ends there): Cephes' expf, a
// Cody-Waite reduction by ln 2 and a degree-5 polynomial (within 2 ulp of exp), inline so that the rows of a tile
// overlap; libmvec's out-of-line expf took a fifth of a 2,000-token prefill attention.
// A non-finite x (a corrupt cache byte's score) comes back as itself, so that the row's output is not finite either:
// tested on the bits, since -ffast-math lets the compiler drop a NaN from comparisons (the clamp below is a max).
static inline v16 exp_le0(v16 x) {
  const v16 lo = (v16){} - 87.f, zero = {};
  const vi16 bad = ((vi16)x & 0x7fffffff) >= 0x7f800000, under = x < lo;
  const v16 arg = x;
  x = under ? lo : x;
  const v16 fx = x * 1.44269504088896341f + 0.5f;
  vi16 n = __builtin_convertvector(fx, vi16);  // toward 0; then floor: -1 (true) where that rounded up
  n += (vi16)(__builtin_convertvector(n, v16) > fx);
  const v16 fn = __builtin_convertvector(n, v16);
  x = x - fn * 0.693359375f;
  x = x - fn * -2.12194440e-4f;
  v16 y = ((((1.9875691500e-4f * x + 1.3981999507e-3f) * x + 8.3334519073e-3f) * x + 4.1665795894e-2f) * x +
           1.6666665459e-1f) * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  y *= (v16)((n + 127) << 23);  // 2^n
  return bad ? arg : under ? zero : y;
}

// The online softmax's step on a block, shared by decode and prefill: the scores s [nv vectors of 16], those at n
// and past it masked (weight 0), become exp(s - m') with m' the new running maximum (m becomes m'), and their sum is
// added to psum's lanes (psum starts at 0). Returns the factor the running sum and the unnormalised output must be
// scaled by to m' first: 1 where there is nothing to rescale (the maximum kept, or the first scores).
template <int NV>  // vectors of scores: NV, or nv at run time where NV is 0
static inline float softmax_step(float* s, int64_t nv, int64_t n, float& m, v16& psum) {
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, none = (v16){} + NO_SCORE;
  auto scores = [&](int64_t j) { const v16 x = *(const v16*)(s + j); return lane + (float)j < (float)n ? x : none; };
  if constexpr (NV > 0) nv = NV;
  v16 mv = none;
  for (int64_t v = 0; v < nv; ++v) mv = vmax(mv, scores(16 * v));
  const float mx = std::max(m, hmax(mv));
  // not libm's expf: a call spills every vector register (and expf(-1e30) takes its slow underflow path)
  const float corr = mx != m && m != NO_SCORE ? exp_le0((v16){} + (m - mx))[0] : 1.f;
  m = mx;
  psum = (v16){};
  for (int64_t v = 0; v < nv; ++v) {
    const v16 p = exp_le0(scores(16 * v) - mx);
    *(v16*)(s + 16 * v) = p;
    psum += p;
  }
  return corr;
}

// The online softmax over one block of n scores s (n >= 0; s has room for n rounded up to 16, and those past n
// become 0): s[j] becomes exp(s[j] - m') with m' the new running maximum, and the running sum l and the
// unnormalised output acc [D] are rescaled to m' before s's sum joins l.
static inline void online_softmax(float* s, int64_t n, float& m, float& l, float* acc, int64_t D) {
  v16 sum;
  const float corr = softmax_step<0>(s, (n + 15) / 16, n, m, sum);
  if (corr != 1.f) {
    l *= corr;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  }
  l += hsum(sum);
}

// online_softmax for a prefill tile's row of 32 scores, of which the first `valid` are the row's keys (the others
// become weight 0): the running sum stays 16 lanes wide (l16, summed once at the end) and the two vectors of
// scores never leave registers between the maximum and the exponentials.
static inline void online_softmax32(float* s, int64_t valid, float& m, v16& l16, float* acc, int64_t D) {
  v16 sum;
  const float corr = softmax_step<2>(s, 2, valid, m, sum);
  if (corr != 1.f) {
    l16 *= corr;
    for (int64_t d = 0; d < D; d += 16) *(v16*)(acc + d) *= corr;
  }
  l16 += sum;
}

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
#if defined(__AVX512F__)
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
#if defined(__AVX512F__)
  out[0] = code_lanes<CODE>((vireg)(CODE == 1 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b)));
#else
  const __m128i h = _mm_unpackhi_epi64(b, b);
  out[0] = code_lanes<CODE>((vireg)(CODE == 1 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b)));
  out[1] = code_lanes<CODE>((vireg)(CODE == 1 ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h)));
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
template <int CODE>
struct QuantSrc {
  static constexpr bool KIVI = CODE == 4 || CODE == 2;
  static constexpr int PER = KIVI ? 8 / CODE : 1;
  static constexpr uint8_t MASK = KIVI ? (1 << CODE) - 1 : 0xFF;
  const uint8_t* raw;
  int64_t ROW, ko, vo, kso, vso, kzo, vzo;
  const float* lut;
  int64_t GK, GV, KVH, D;
  const float* fsrc;
  const int64_t *frows, *fstart;
  int64_t FR;
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
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// Lane j of the result = the sum of x[j]'s 8 lanes (AVX2: hadd within 128-bit halves, then the halves added).
static inline __m256 lane_sums8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#define KVCACHE_AVX2 1
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
      alignas(32) float r[8];
      _mm256_store_ps(r, lane_sums8(x));
      for (int64_t j = 0; j < n; ++j) s[c0 - t0 + j] = r[j];
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

// acc [D] += sum over i of p[i] * v_{t0 + i} for the values at v + t * stride; acc in registers where D is known.
template <int64_t DC>
static inline void weighted_sum(float* acc, const float* p, const float* v, int64_t stride, int64_t t0, int64_t t1,
                                int64_t Drt) {
#ifdef KVCACHE_AVX2
  // AVX2: GCC builds a 16-wide broadcast through 16 stores to the stack and reloads (a store-forwarding stall per
  // value, most of this kernel's time): 8-wide accumulators and a real broadcast instead
  if constexpr (DC > 0 && DC % 8 == 0 && DC <= 128) {
    constexpr int64_t NV = DC / 8;
    __m256 av[NV];
    for (int64_t u = 0; u < NV; ++u) av[u] = _mm256_loadu_ps(acc + 8 * u);
    for (int64_t t = t0; t < t1; ++t) {
      const __m256 wv = _mm256_broadcast_ss(p + (t - t0));
      const float* vt = v + t * stride;
#pragma GCC unroll 16
      for (int64_t u = 0; u < NV; ++u) av[u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vt + 8 * u), av[u]);
    }
    for (int64_t u = 0; u < NV; ++u) _mm256_storeu_ps(acc + 8 * u, av[u]);
    return;
  }
#endif
  if constexpr (DC > 0 && DC % 16 == 0) {
    constexpr int64_t NV = DC / 16;
    v16 av[NV];
    for (int64_t u = 0; u < NV; ++u) av[u] = *(const v16*)(acc + 16 * u);
    for (int64_t t = t0; t < t1; ++t) {
#ifdef __AVX512F__
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
  // the first half of them. The item's first block came in with the previous item's last where this thread ran one
  // (`started`); this item's last block brings in the next item's first (`next_id`, -1: none).
  Prefetcher pf(R * H);
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
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Src src = proto;
    if constexpr (!std::is_same_v<Src, F32Src>) src.init(c.BS);
    const int64_t SB = (c.BS + 15) / 16 * 16;  // a head's scores, padded for lane_sums' 16 at a time
    std::vector<float> s(most * H * SB), ml(2 * most * H), acc(most * H * D);
    int64_t u = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t it = begin; it < end; ++it) {
      while (it >= first[u + 1]) ++u;
      const int64_t b = start[u], R = size[u], n = first[u + 1] - first[u], sp = it - first[u];
      const int64_t b0 = c.first_block(b) + sp * c.split_blocks;
      const int64_t b1 = std::min(b0 + c.split_blocks, (c.cl[b + R - 1] - 1) / c.BS + 1);
      float *m = ml.data(), *l = ml.data() + R * H;
      int64_t next_id = -1;  // the block this thread reads next, after this item's last: paced in with the last
      if (it + 1 < end) {
        const int64_t v = it + 1 >= first[u + 1] ? u + 1 : u;
        next_id = c.bt[start[v] * c.MAXNB + c.first_block(start[v]) + (it + 1 - first[v]) * c.split_blocks];
      }
      attend_blocks<DC>(c, src, b, R, b0, b1, s.data(), SB, m, l, acc.data(), it > begin, next_id);
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
    }
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

// ---- causal prefill attention (float32) ----
// out [n, H, D] = softmax(q k^T * sc + causal mask) v for the n queries at positions off .. off + n - 1 of a context
// of L = off + n keys: q [n, H, D], k, v [L, KVH, D] with any row stride (heads packed by D), G = H / KVH query heads
// per KV head, D a multiple of 32. Flash attention: per KV head and block of QB query positions (their QB x G rows
// share each key and value), blocks of KB keys with an online softmax, blocks wholly above the diagonal skipped.
// Both products run on a 32-column register tile (mm32), the keys transposed once per call into KB-wide panels.
// SDPA's CPU kernel runs these shapes (the demo's heads, 64-512 tokens) at 35-65 GFLOP/s on 2 cores.
constexpr int64_t PQB = 16, PKB = 32;  // online_softmax32: PKB is 32
#if defined(__AVX512F__)
constexpr int MM_ROWS = 12;  // 12 x 2 vectors of accumulators
#else
constexpr int MM_ROWS = 3;  // 3 x 2 x 2 halves of AVX2 registers
#endif

// out [MR, 32] (+= with ACC) x [MR, K] (row stride ldx) times w [K, 32] (row stride ldw)
template <int MR, bool ACC>
static inline void mm32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo) {
  v16 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = (v16){};
  for (int64_t k = 0; k < K; ++k) {
    const v16 w0 = *(const v16*)(w + k * ldw), w1 = *(const v16*)(w + k * ldw + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const float a = x[r * ldx + k];
      acc[r][0] += a * w0;
      acc[r][1] += a * w1;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      v16* o = (v16*)(out + r * ldo + 16 * h);
      if constexpr (ACC) *o += acc[r][h];
      else *o = acc[r][h];
    }
}

template <int MR, bool ACC>
static inline void mm32_rows(int64_t m, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
                             int64_t ldo) {
  if constexpr (MR > 1) {
    if (m < MR) return mm32_rows<MR - 1, ACC>(m, x, ldx, w, ldw, K, out, ldo);
  }
  mm32<MR, ACC>(x, ldx, w, ldw, K, out, ldo);
}

// out [M, cols] (+)= x [M, K] w [K, cols], cols a multiple of 32
template <bool ACC>
static void mm(int64_t M, int64_t cols, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
               int64_t ldo) {
  for (int64_t c = 0; c < cols; c += 32)
    for (int64_t r = 0; r < M; r += MM_ROWS)
      mm32_rows<MM_ROWS, ACC>(std::min<int64_t>(MM_ROWS, M - r), x + r * ldx, ldx, w + c, ldw, K, out + r * ldo + c, ldo);
}

void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1), off = L - n;
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q.sizes() &&
              v.sizes() == k.sizes() && k.size(2) == D && D % 32 == 0 && H % KVH == 0 && off >= 0 &&
              q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 &&
              v.stride(1) == D, "prefill_attention: q [n, H, D], k, v [L >= n, KVH, D] float32 with heads packed by D "
              "(D a multiple of 32), out contiguous like q");
  const int64_t G = H / KVH, NKB = (L + PKB - 1) / PKB, NQB = (n + PQB - 1) / PQB, R = PQB * G;
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = (float)scale;
  // keys transposed into panels kt [KVH][NKB][D][PKB] (past L: zero)
  std::vector<float> kt(KVH * NKB * D * PKB, 0.f);
  at::parallel_for(0, KVH * NKB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / NKB, jb = i % NKB;
      float* panel = kt.data() + i * D * PKB;
      for (int64_t j = jb * PKB; j < std::min(L, (jb + 1) * PKB); ++j)
        for (int64_t d = 0; d < D; ++d) panel[d * PKB + (j - jb * PKB)] = kp[j * ks + kh * D + d];
    }
  });
  // work items: a KV head and a pair of query blocks, one from each end, so that the items cost about the same
  const int64_t pairs = (NQB + 1) / 2;
  at::parallel_for(0, KVH * pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qb(R * D), s(R * PKB), o(R * D), m(R), l(R);
    std::vector<v16> l16(R);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kh = item / pairs, t = item % pairs;
      for (int64_t which = 0; which < (t == NQB - 1 - t ? 1 : 2); ++which) {
        const int64_t qi = which ? NQB - 1 - t : t;
        const int64_t i0 = qi * PQB, nq = std::min(PQB, n - i0), rows = nq * G;
        for (int64_t i = 0; i < nq; ++i)  // row i * G + g: query i0 + i of head kh * G + g, scaled
          for (int64_t g = 0; g < G; ++g) {
            const float* src = qp + (i0 + i) * qs + (kh * G + g) * D;
            float* dst = qb.data() + (i * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * sc;
          }
        std::fill(m.begin(), m.begin() + rows, NO_SCORE);
        std::fill(l16.begin(), l16.begin() + rows, (v16){});
        std::fill(o.begin(), o.begin() + rows * D, 0.f);
        const int64_t last = off + i0 + nq - 1;  // the last key any row of the block sees
        for (int64_t jb = 0; jb <= last / PKB; ++jb) {
          const int64_t j0 = jb * PKB, nk = std::min(PKB, L - j0);
          mm<false>(rows, PKB, qb.data(), D, kt.data() + (kh * NKB + jb) * D * PKB, PKB, D, s.data(), PKB);
          for (int64_t i = 0, r = 0; i < nq; ++i) {
            // keys j0 .. j0 + valid - 1 are query i's; the block's others weigh nothing in the product with v
            const int64_t valid = std::max<int64_t>(0, std::min(nk, off + i0 + i - j0 + 1));
            for (int64_t g = 0; g < G; ++g, ++r)
              online_softmax32(s.data() + r * PKB, valid, m[r], l16[r], o.data() + r * D, D);
          }
          mm<true>(rows, D, s.data(), PKB, vp + j0 * vs + kh * D, vs, nk, o.data(), D);
        }
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            l[r] = hsum(l16[r]);
            normalise(op + ((i0 + i) * H + kh * G + g) * D, o.data() + r * D, l.data() + r, 1, D);
          }
      }
    }
  });
}

static Decode decode_shape(torch::Tensor out, torch::Tensor q, torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, int64_t kv_heads, double scale, int64_t window, double softcap,
                           int64_t split_tokens, torch::Tensor runs) {
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

void paged_decode_quant(torch::Tensor out, torch::Tensor q, torch::Tensor raw, std::vector<int64_t> offsets,
                        int64_t code, torch::Tensor lut, int64_t gk, int64_t gv, int64_t block_size,
                        int64_t kv_heads, torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                        int64_t window, torch::Tensor full_src, torch::Tensor full_rows, torch::Tensor full_start,
                        double softcap, int64_t split_tokens, torch::Tensor runs) {
  TORCH_CHECK(raw.is_contiguous() && lut.is_contiguous() && offsets.size() == 6);
  TORCH_CHECK(lut.scalar_type() == at::kFloat && raw.scalar_type() == at::kByte);
  const Decode c = decode_shape(out, q, block_tables, context_lens, block_size, kv_heads, scale, window, softcap,
                                split_tokens, runs);
  const bool kivi = code == 4 || code == 2;
  TORCH_CHECK(!kivi || runs.numel() == 0, "KIVI rows attend one at a time (no runs)");
  if (kivi) TORCH_CHECK(full_src.is_contiguous() && full_rows.is_contiguous() && full_start.is_contiguous() &&
                        full_src.scalar_type() == at::kFloat);
  auto run = [&](auto src) {
    src.raw = raw.data_ptr<uint8_t>(); src.ROW = raw.size(1);
    src.ko = offsets[0]; src.vo = offsets[1]; src.kso = offsets[2]; src.vso = offsets[3]; src.kzo = offsets[4];
    src.vzo = offsets[5]; src.lut = lut.data_ptr<float>(); src.GK = gk; src.GV = gv; src.KVH = kv_heads;
    src.D = c.D;
    src.fsrc = kivi ? full_src.data_ptr<float>() : nullptr;
    src.frows = kivi ? full_rows.data_ptr<int64_t>() : nullptr;
    src.fstart = kivi ? full_start.data_ptr<int64_t>() : nullptr;
    src.FR = kivi ? full_rows.size(1) : 0;
    decode_dispatch(c, src);
  };
  switch (code) {
    case 0: run(QuantSrc<0>{}); break;
    case 1: run(QuantSrc<1>{}); break;
    case 5: run(QuantSrc<5>{}); break;
    case 6: run(QuantSrc<6>{}); break;
    case 4: run(QuantSrc<4>{}); break;
    case 2: run(QuantSrc<2>{}); break;
    default: TORCH_CHECK(false, "unknown code ", code);
  }
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window,
                  double softcap, int64_t split_tokens, torch::Tensor runs) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat && k_cache.size(3) == q.size(2));
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), D = q.size(2);
  const Decode c = decode_shape(out, q, block_tables, context_lens, BS, KVH, scale, window, softcap, split_tokens,
                                runs);
  decode_dispatch(c, F32Src{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), BS * KVH * D, KVH * D, D});
}

// paged_decode's address, for the model module's decode loop (cpu_kernels.decode_layers), which calls it between
// its layers' two halves: the two modules are built with the same compiler against the same libtorch.
int64_t paged_decode_address() { return reinterpret_cast<int64_t>(&paged_decode); }
"""

# Tokens of a sequence's context per work item (rounded down to whole blocks, at least one). Measured on two cores,
# demo model heads: one sequence of 600 tokens, KV from memory, 148 us a layer in one piece against ~45 in splits.
SPLIT_TOKENS = 128

NO_RUNS = torch.empty(0, dtype=torch.int64)  # paged_decode's runs: none
FORMAT_CODES = {"int8": 1, "fp8_e4m3": 5, "fp8_e5m2": 6}  # the kernel's arithmetic decoders (KIVI: its bits)
# The compiled kernel module, or None if it cannot be built here (or KVCACHE_CPU_KERNEL=0)
load = native.Kernels("kvcache_cpu_attention", _SOURCE, ["paged_decode", "paged_decode_quant", "prefill_attention",
                                                         "paged_decode_address"],
                      ["-ffast-math"],
                      "using the portable PyTorch path")


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None = None, runs: torch.Tensor | None = None) -> None:
    """out[b] = attention of q[b] ([B, H, D], heads packed by D, rows of any stride: a view of the q/k/v product is
    read where it is) over the first context_lens[b] tokens of its block table; scores
    soft-capped (c * tanh(s / c)) with `softcap`. `runs` (int64 [B], DecodeGroup.runs): runs[b] rows from b on are
    consecutive positions of one sequence (0 inside a run), attended together: each block is read once for all of
    them, and each row's output is what it would be alone."""
    load().paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale, window or 0, softcap or 0.0,
                        SPLIT_TOKENS, NO_RUNS if runs is None else runs)


def paged_decode_quant(out: torch.Tensor, q: torch.Tensor, store, layer: int, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, window: int | None,
                       full: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, softcap: float | None = None,
                       runs: torch.Tensor | None = None, code: int | None = None) -> None:
    """paged_decode over a QuantizedKVStore layer, dequantizing each token as it is read. Under KIVI `full` is
    (full-precision key rows [R, KVH, D], row of each sequence's current-group position [B, group], the position
    that group starts at [B]), and there are no runs. `code`: how bytes decode (default: the store's format; 0, the
    store's lookup table, serves any byte format)."""
    empty = torch.empty(0)
    src, rows, start = full if full is not None else (empty, empty, empty)
    if store.kivi_group:
        code = store.bits
    elif code is None:
        code = FORMAT_CODES.get(store.dtype, 0)
    load().paged_decode_quant(out, q, store.raw[layer], store.offsets, code, store.lut,
                               store.kivi_group or 1, store.value_group, store.block_size,
                               store.num_kv_heads, block_tables, context_lens, scale, window or 0, src, rows, start,
                               softcap or 0.0, SPLIT_TOKENS, NO_RUNS if runs is None else runs)


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """out [n, H, D] = causal attention of the queries q [n, H, D], the last n positions of a context whose keys and
    values are k, v [L >= n, KVH, D] (float32; row strides free, heads packed by D; D a multiple of 32)."""
    load().prefill_attention(out, q, k, v, scale)
