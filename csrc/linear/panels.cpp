// Linear layers on float32 weights in panels of 32 output channels (pack_panels, panel_linear), on the GGUF codes
// that decode to those floats (code_panel_linear), and the MLP's gate/up product with SiLU x up in its epilogue
// (gate_up_silu).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../isa.h"
#include "../layer/activation.h"
#include "../ops.h"
#include "../parallel.h"
#include "panels.h"

namespace kvcache {

// ---- float32 weights in panels (llama.py's Dense.pack) ----
// W [N, K] is held as panels [ceil(N / 32)][K][32] (the last one zero-padded): panel p is output channels
// 32p .. 32p + 31, and the 32 weights that one input k meets in it are one contiguous 128 bytes, so a panel is read
// as one sequential stream (the hardware prefetcher's best case) while the rows of x are multiplied against it. Each
// output is a chain of FMAs from zero over each PANEL_CHUNK inputs in turn, and those chunks' sums added in order
// (rounding error grows with K / 128 + 128 instead of K), whatever the instruction set and whatever rows share the
// call: a row's result is what it is alone (batch-invariant) and bit-identical across the builds.
// Measured on 2 Zen 4 cores, weights streamed from DRAM as in a decode step, against oneDNN's linear on its own
// packed weights: 150-205 GFLOP/s against 97-122 at 8 rows, 206-226 against 182-201 at 64, both 218-228 at 2,048
// (`kvcache bench linear`).

// Lines of the next panel read ahead while this one is multiplied: `lines` cache lines from `at`, spread evenly over
// a call's K inputs (tick once per input: K ticks issue exactly `lines`). With 3-8 row blocks a panel (17-64 rows in
// AVX-512's blocks of 8, 13-48 in AVX2's of 6), a panel's first row block had waited on DRAM while the others ran
// from cache; with the next panel's lines shared out among this panel's blocks, the weights stream in under the
// arithmetic. Measured with AVX-512 (the demo's layers from DRAM, 2 Zen 4 cores): 24-32 rows 1.06-1.09x, 48-64 rows
// 1.02-1.04x. At 1-16 rows (memory-bound; the hardware prefetcher keeps up) it was 0.88-0.96x, and into L2 only
// (_MM_HINT_T1) 0.94-0.98x: neither is done. Each block gets a share in proportion to its rows: with equal shares a
// last block of 1-2 rows issued a quarter of the lines in a tenth of the time (the MLP's GEMMs at 23 rows: 165 ->
// 204 GFLOP/s, 26 rows 187 -> 203, with the 7-row fix in panel_rows).
struct PanelAhead {
  const char* at = nullptr;
  int64_t lines = 0, K = 1, due = 0;
  inline void tick() {
    for (due += lines; due >= K; due -= K, at += 64) prefetch_l1(at);
  }
};

// out [ceil(N / 32), K, 32] = w [N, K] in panels, the last one's missing outputs zero; w may be strided (a
// transposed view of a [K, N] weight is read as it is, with no copy)
void pack_panels(Tensor w, Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_panels: w must be a float32 [N, K] matrix on the CPU");
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL, sn = w.stride(0), sk = w.stride(1);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 3 &&
              out.size(0) == P && out.size(1) == K && out.size(2) == PANEL,
              "pack_panels: out must be a contiguous float32 [", P, ", ", K, ", ", PANEL, "] tensor on the CPU");
  const float* s = w.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < PANEL; ++j)
          d[(p * K + k) * PANEL + j] = p * PANEL + j < N ? s[(p * PANEL + j) * sn + k * sk] : 0.f;
  });
}

#if defined(KVCACHE_AVX512)
// 8 rows x 2 vectors of accumulators, their chunks' sums, 2 of weights and a broadcast (12 rows: 1-3% slower at
// 2,048 rows, where the sums spill; 6: slower at 8)
constexpr int PANEL_ROWS = 8;
// A tile's pieces, which panel_rows and code_tile share (so both give the same floats): one input's FMAs into MR
// rows' accumulators, a chunk's chains added to the sums in order, and the sums' first cols <= 32 stored
template <int MR>
static inline void tile_fma(const float* x, int64_t ldx, int64_t k, __m512 w0, __m512 w1, __m512 (&acc)[MR][2]) {
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
    acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
  }
}

template <int MR>
static inline void tile_sum(bool first, __m512 (&acc)[MR][2], float (&sum)[MR][2][16]) {
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h)
      _mm512_store_ps(sum[r][h], first ? acc[r][h] : _mm512_add_ps(_mm512_load_ps(sum[r][h]), acc[r][h]));
}

// the lanes of a panel's two vectors that hold its first cols <= 32 outputs
static inline void tile_masks(int64_t cols, __mmask16& m0, __mmask16& m1) {
  m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
  m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
}

template <int MR>
static inline void tile_store(float (&sum)[MR][2][16], float* out, int64_t ldo, int64_t cols) {
  __mmask16 m0, m1;
  tile_masks(cols, m0, m1);
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, _mm512_load_ps(sum[r][0]));
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, _mm512_load_ps(sum[r][1]));
  }
}

// out [MR, cols] (row stride ldo) = x [MR, K] (row stride ldx) times panel w [K][32]; cols <= 32 are stored
template <int MR>
static inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                              int64_t cols, const PanelAhead& ahead_) {
  // a local copy the compiler keeps in registers: a struct passed by value was stored field by field and read back
  // as one vector, a store-forwarding stall per call (half the samples of panels_linear's own code)
  PanelAhead ahead = ahead_;
  __m512 acc[MR][2];
  alignas(64) float sum[MR][2][16];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = k0; k < std::min(K, k0 + PANEL_CHUNK); ++k) {
      ahead.tick();
      tile_fma<MR>(x, ldx, k, _mm512_loadu_ps(w + k * PANEL), _mm512_loadu_ps(w + k * PANEL + 16), acc);
    }
    tile_sum<MR>(k0 == 0, acc, sum);  // the chunks' sums in order
    // At 7 rows GCC kept the 28 sums in registers and moved the two weight vectors to the stack instead, reloading
    // them for every FMA (105 GFLOP/s against 220 at 6 and 8 rows, from cache): the barrier keeps the sums in
    // memory. At 8 rows it cost 6% (the compiler's own choice, spilling sums, is better there), so 7 only.
    if constexpr (MR == 7) asm volatile("" : : "r"(&sum[0][0][0]) : "memory");
  }
  tile_store<MR>(sum, out, ldo, cols);
}
#elif defined(KVCACHE_AVX2)
// A half panel (16 outputs: 2 registers) against 6 rows: 12 accumulators, 2 of weights and a broadcast of the 16
// registers. The panels are run chunk by chunk (panel_pass below): each PANEL_CHUNK inputs of a panel (16 KiB) stay
// in L1 while every row block of the pass multiplies them, where a row block at a time had streamed the whole half
// panel from L2 (K = 576: 36 KiB; the demo's prefill GEMMs at ~50% of the FMA peak).
constexpr int PANEL_ROWS = 6;

// One input's FMAs into MR rows' accumulators (x[r * ldx + k] times the weights w0, w1), which half_chunk and
// code_tile share (so both give the same floats)
template <int MR>
static inline void tile_fma(const float* x, int64_t ldx, int64_t k, __m256 w0, __m256 w1, __m256 (&acc)[MR][2]) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
    acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
    acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
  }
}

// MR rows' sums (rows of 32 floats, this half's 16) over inputs [k0, k1) of half panel wh, the rows x packed by
// pass_rows ([K][PANEL_ROWS]): set on the first chunk, else added to, in order. AHEAD: tick *ahead once per input
// (in a register copy: through the reference, the count went to memory and back every input, a store-forwarding
// wait per group of FMAs)
template <int MR, bool AHEAD>
static inline void half_chunk(const float* x, const float* wh, int64_t k0, int64_t k1, float* sum, bool first,
                              PanelAhead* ahead_) {
  PanelAhead ahead;
  if constexpr (AHEAD) ahead = *ahead_;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (AHEAD) ahead.tick();
    tile_fma<MR>(x + k * PANEL_ROWS, 1, 0, _mm256_loadu_ps(wh + k * PANEL), _mm256_loadu_ps(wh + k * PANEL + 8), acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      float* at = sum + r * 32 + 8 * h;
      _mm256_storeu_ps(at, first ? acc[r][h] : _mm256_add_ps(_mm256_loadu_ps(at), acc[r][h]));
    }
  if constexpr (AHEAD) *ahead_ = ahead;
}

// half_chunk<m> for a run-time m <= MR, ticking `ahead` where it has lines to read ahead
template <int MR>
static inline void half_block(int64_t m, const float* x, const float* wh, int64_t k0, int64_t k1, float* sum,
                              bool first, PanelAhead* ahead) {
  if constexpr (MR > 1) {
    if (m < MR) return half_block<MR - 1>(m, x, wh, k0, k1, sum, first, ahead);
  }
  if (ahead != nullptr && ahead->lines > 0) half_chunk<MR, true>(x, wh, k0, k1, sum, first, ahead);
  else half_chunk<MR, false>(x, wh, k0, k1, sum, first, nullptr);
}

// x [rows][K] as panel_pass reads it: blocks of PANEL_ROWS rows, each [K][PANEL_ROWS] (the last one's missing rows
// zero), in a buffer of the thread's: a row block's broadcasts then read one stream, where six rows' had been six
// streams of 8 lines a chunk, too short for the hardware prefetcher (the prefill GEMMs at 2/3 of the FMA peak with
// the micro-kernel at the peak in L1)
static inline const float* pass_rows(const float* x, int64_t K, int64_t rows) {
  thread_local std::vector<float> packed;
  const int64_t blocks = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
  packed.resize(blocks * K * PANEL_ROWS);
  for (int64_t b = 0; b < blocks; ++b) {
    float* dst = packed.data() + b * K * PANEL_ROWS;
    for (int64_t r = 0; r < PANEL_ROWS; ++r) {
      const float* src = b * PANEL_ROWS + r < rows ? x + (b * PANEL_ROWS + r) * K : nullptr;
      for (int64_t k = 0; k < K; ++k) dst[k * PANEL_ROWS + r] = src ? src[k] : 0.f;
    }
  }
  return packed.data();
}
#else
constexpr int PANEL_ROWS = 4;
template <int MR>
static inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                              int64_t cols, const PanelAhead&) {
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float sum = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {  // the vector paths' chains and sums
        float s = 0.f;
        for (int64_t k = k0; k < std::min(K, k0 + PANEL_CHUNK); ++k) s = std::fma(x[r * ldx + k], w[k * PANEL + j], s);
        sum = k0 == 0 ? s : sum + s;
      }
      out[r * ldo + j] = sum;
    }
}
#endif

#if defined(KVCACHE_AVX2)
// rows [0, rows) of x (packed by pass_rows) times panel w into out (row stride ldo; cols <= 32 stored): chunk by
// chunk of PANEL_CHUNK inputs (16 KiB of the panel, in L1 while it lasts), each half panel against every row block of
// PANEL_ROWS (half_chunk), the sums kept in a buffer of the thread's until the last chunk. The chunk after this one
// (or the thread's next panel, `next`, after the last) is read ahead while the first row block multiplies this one.
// The same chains and sums, in the same order, as the other builds' panel_rows: the same floats.
static inline void panel_pass(const float* x, int64_t K, int64_t rows, const float* w, const float* next, float* out,
                              int64_t ldo, int64_t cols) {
  const int64_t blocks = (rows + PANEL_ROWS - 1) / PANEL_ROWS, halves = cols > 16 ? 2 : 1;
  thread_local std::vector<float> sums;
  sums.resize(rows * 32);
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    const int64_t k1 = std::min(K, k0 + PANEL_CHUNK);
    const float* after = k1 < K ? w + k1 * PANEL : next;
    const int64_t lines = k1 < K ? (std::min(K, k1 + PANEL_CHUNK) - k1) * PANEL * 4 / 64 :
                          next != nullptr ? std::min(K, PANEL_CHUNK) * PANEL * 4 / 64 : 0;
    PanelAhead ahead{(const char*)after, lines, k1 - k0, 0};
    for (int64_t half = 0; half < halves; ++half)
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t m0 = i * PANEL_ROWS;
        half_block<PANEL_ROWS>(std::min<int64_t>(PANEL_ROWS, rows - m0), x + i * K * PANEL_ROWS, w + half * 16, k0,
                               k1, sums.data() + m0 * 32 + half * 16, k0 == 0, half == 0 && i == 0 ? &ahead : nullptr);
      }
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * ldo, sums.data() + r * 32, cols * sizeof(float));
}
#else
// panel_rows<m> for a run-time m <= MR
template <int MR>
static inline void panel_block(int64_t m, const float* x, int64_t ldx, const float* w, int64_t K, float* out,
                               int64_t ldo, int64_t cols, const PanelAhead& ahead) {
  if constexpr (MR > 1) {
    if (m < MR) return panel_block<MR - 1>(m, x, ldx, w, K, out, ldo, cols, ahead);
  }
  panel_rows<MR>(x, ldx, w, K, out, ldo, cols, ahead);
}

// rows [0, rows) of x (row stride K) times panel w into out (row stride ldo; cols <= 32 stored), in row blocks of
// PANEL_ROWS, reading the panel `next` (the thread's next one, or nullptr) ahead: its lines shared out among the
// blocks in proportion to their rows (PanelAhead)
static inline void panel_pass(const float* x, int64_t K, int64_t rows, const float* w, const float* next, float* out,
                              int64_t ldo, int64_t cols) {
  const int64_t blocks = (rows + PANEL_ROWS - 1) / PANEL_ROWS, lines = K * PANEL * 4 / 64;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t m0 = i * PANEL_ROWS, l0 = lines * m0 / rows, l1 = lines * std::min(rows, m0 + PANEL_ROWS) / rows;
    PanelAhead ahead;
    if (next != nullptr && blocks >= 3 && blocks <= 8) ahead = {(const char*)next + l0 * 64, l1 - l0, K, 0};
    panel_block<PANEL_ROWS>(std::min<int64_t>(PANEL_ROWS, rows - m0), x + m0 * K, K, w, K, out + m0 * ldo, ldo, cols,
                            ahead);
  }
}

// x as panel_pass reads it: its rows as they are
static inline const float* pass_rows(const float* x, int64_t, int64_t) { return x; }
#endif

// Rows of x per pass over a thread's panels: about PANEL_X_BYTES of x, which stay in the core's cache while its
// panels pass (a multiple of PANEL_ROWS)
static inline int64_t panel_chunk(int64_t K) {
  return std::max<int64_t>(1, PANEL_X_BYTES / (K * 4) / PANEL_ROWS) * PANEL_ROWS;
}

static void check_panels(const Tensor& x, const Tensor& wp, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && wp.is_contiguous() && wp.dim() == 3 &&
              x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && wp.size(1) == x.size(1) &&
              wp.size(2) == PANEL, what, ": x [M, K] and panels [P, K, 32] must be contiguous float32; got x ",
              x.sizes(), " and panels ", wp.sizes());
}

static Panels f32_panels(const Tensor& wp) {
  Panels c;
  c.w = wp.data_ptr<float>();
  c.P = wp.size(0);
  c.K = wp.size(1);
  return c;
}

static Panels code_panels(const Tensor& x, const Tensor& codes, const Tensor& scale,
                          const Tensor& minimum, const char* what) {
  const int64_t K = x.size(1), P = codes.size(0), G = K / PANEL;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && codes.is_contiguous() &&
              codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(1) == K && K % PANEL == 0 &&
              (codes.size(2) == 16 || codes.size(2) == PANEL) && scale.is_contiguous() && minimum.is_contiguous() &&
              scale.scalar_type() == at::kFloat && minimum.scalar_type() == at::kFloat &&
              scale.sizes() == minimum.sizes() && scale.dim() == 3 && scale.size(0) == P && scale.size(1) == G &&
              scale.size(2) == PANEL, what, ": x [M, K] float32 (K a multiple of 32), codes [P, K, 16 or 32] uint8, "
              "scale and minimum [P, K / 32, 32] float32, contiguous; got x ", x.sizes(), ", codes ", codes.sizes(),
              ", scale ", scale.sizes(), ", minimum ", minimum.sizes());
  Panels c;
  c.codes = codes.data_ptr<uint8_t>();
  c.scale = scale.data_ptr<float>();
  c.minimum = minimum.data_ptr<float>();
  c.P = P;
  c.K = K;
  c.bits = codes.size(2) == 16 ? 4 : 8;
  return c;
}

// out [M, N] = x [M, K] W^T for W in panels; the panels are split across torch's threads, and each thread runs all
// of x's rows against one panel (read once from memory, then from its cache) before the next.
#if defined(KVCACHE_AVX512)
// Code panel p's weights for input k, decoded in registers (Panels::decode's floats)
template <int BITS>
static inline void code_weights(const Panels& w, int64_t p, int64_t k, __m512 s0, __m512 s1, __m512 m0, __m512 m1,
                                __m512& w0, __m512& w1) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(w.codes + (p * w.K + k) * 16));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    w0 = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m0);
    w1 = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m1);
  } else {
    const uint8_t* c = w.codes + (p * w.K + k) * PANEL;
    w0 = _mm512_fmadd_ps(s0, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c))), m0);
    w1 = _mm512_fmadd_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c + 16)))), m1);
  }
}

// One row x [K] times code panels p[0] and p[1] (p[1] < 0: p[0] only) into out[i] (cols[i] <= 32 of them): the
// floats of panel_rows<1> on their decoded panels (the chunks' chains and sums in the same order), the weights decoded
// in registers. One row's one chain per output waits on each FMA's latency (~28 GFLOP/s on 2 cores, the codes' speed
// at one row through a decoded buffer); two panels' four chains side by side keep the FMA unit busy.
template <int BITS>
static void code_row(const Panels& w, const int64_t p[2], const float* x, float* const out[2], const int64_t cols[2]) {
  const bool two = p[1] >= 0;
  const int64_t K = w.K, G = K / PANEL;
  __m512 acc[2][2], sum[2][2];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int i = 0; i < 2; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t g = k0 / PANEL; g < std::min(K, k0 + PANEL_CHUNK) / PANEL; ++g) {
      __m512 sv[2][2], mv[2][2];
      for (int i = 0; i < 2; ++i) {
        const int64_t q = p[two ? i : 0];
        for (int h = 0; h < 2; ++h) {
          sv[i][h] = _mm512_loadu_ps(w.scale + (q * G + g) * PANEL + 16 * h);
          mv[i][h] = _mm512_loadu_ps(w.minimum + (q * G + g) * PANEL + 16 * h);
        }
      }
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        const __m512 a = _mm512_set1_ps(x[k]);
        for (int i = 0; i < 2; ++i) {
          __m512 w0, w1;
          code_weights<BITS>(w, p[two ? i : 0], k, sv[i][0], sv[i][1], mv[i][0], mv[i][1], w0, w1);
          acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
        }
      }
    }
    for (int i = 0; i < 2; ++i)
      for (int h = 0; h < 2; ++h) sum[i][h] = k0 == 0 ? acc[i][h] : _mm512_add_ps(sum[i][h], acc[i][h]);
  }
  for (int i = 0; i < (two ? 2 : 1); ++i) {
    __mmask16 m0, m1;
    tile_masks(cols[i], m0, m1);
    _mm512_mask_storeu_ps(out[i], m0, sum[i][0]);
    _mm512_mask_storeu_ps(out[i] + 16, m1, sum[i][1]);
  }
}

// MR rows of x (row stride ldx) times code panel p into out (row stride ldo, cols <= 32 stored): panel_rows<MR>'s
// floats on the decoded panel, the weights decoded in registers once per input for all MR rows
template <int BITS, int MR>
static inline void code_tile(const Panels& w, int64_t p, const float* x, int64_t ldx, float* out, int64_t ldo,
                             int64_t cols) {
  const int64_t K = w.K, G = K / PANEL;
  __m512 acc[MR][2];
  alignas(64) float sum[MR][2][16];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = k0 / PANEL; g < std::min(K, k0 + PANEL_CHUNK) / PANEL; ++g) {
      const float *sp = w.scale + (p * G + g) * PANEL, *mp = w.minimum + (p * G + g) * PANEL;
      const __m512 s0 = _mm512_loadu_ps(sp), s1 = _mm512_loadu_ps(sp + 16);
      const __m512 m0 = _mm512_loadu_ps(mp), m1 = _mm512_loadu_ps(mp + 16);
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        __m512 w0, w1;
        code_weights<BITS>(w, p, k, s0, s1, m0, m1, w0, w1);
        tile_fma<MR>(x, ldx, k, w0, w1, acc);
      }
    }
    tile_sum<MR>(k0 == 0, acc, sum);
  }
  tile_store<MR>(sum, out, ldo, cols);
}

template <int BITS, int MR>
static inline void code_block(int64_t m, const Panels& w, int64_t p, const float* x, int64_t ldx, float* out,
                              int64_t ldo, int64_t cols) {
  if constexpr (MR > 1) {
    if (m < MR) return code_block<BITS, MR - 1>(m, w, p, x, ldx, out, ldo, cols);
  }
  code_tile<BITS, MR>(w, p, x, ldx, out, ldo, cols);
}

// rows [0, rows) of x (row stride K) times code panel p, in blocks of PANEL_ROWS rows
static void code_pass(const Panels& w, int64_t p, const float* x, int64_t rows, float* out, int64_t ldo, int64_t cols) {
  for (int64_t m0 = 0; m0 < rows; m0 += PANEL_ROWS) {
    const int64_t m = std::min<int64_t>(PANEL_ROWS, rows - m0);
    if (w.bits == 4) code_block<4, PANEL_ROWS>(m, w, p, x + m0 * w.K, w.K, out + m0 * ldo, ldo, cols);
    else code_block<8, PANEL_ROWS>(m, w, p, x + m0 * w.K, w.K, out + m0 * ldo, ldo, cols);
  }
}

// code_row<w.bits>
static void code_row(const Panels& w, const int64_t p[2], const float* x, float* const out[2], const int64_t cols[2]) {
  if (w.bits == 4) code_row<4>(w, p, x, out, cols);
  else code_row<8>(w, p, x, out, cols);
}

// code_row of panels p0 and p1 (-1: none) at their columns of a row of N outputs
static void code_row(const Panels& w, int64_t p0, int64_t p1, const float* x, float* row, int64_t N) {
  const int64_t p[2] = {p0, p1};
  const int64_t cols[2] = {std::min(PANEL, N - p0 * PANEL), p1 < 0 ? 0 : std::min(PANEL, N - p1 * PANEL)};
  float* const out[2] = {row + p0 * PANEL, row + std::max<int64_t>(p1, 0) * PANEL};
  code_row(w, p, x, out, cols);
}
#elif defined(KVCACHE_AVX2)
// A code panel's weights for one input (its codes at `codes`) and outputs 8j .. 8j + 7 (w0) and 16 + 8j .. 16 + 8j + 7
// (w1), decoded in registers: scale x code + minimum in one FMA (the product is exact: Panels), Panels::decode's
// floats. s0, s1: those outputs' scales in the input's group (4 bits: s1 divided by 16, exactly, a power of two);
// m0, m1: their minima. 4 bits: bytes 8j .. 8j + 7 widened to dwords hold outputs 8j.. in their low nibbles and 16 +
// 8j.. in their high ones; the high nibble is taken as the byte less its low nibble (16 x code: hence s1 / 16), with
// no shift: 5.2 cycles for 32 weights where a broadcast of the 16 bytes and four in-lane shuffles took 6.1, and
// vpmovzxbd after masking 10.7 (Zen 3).
template <int BITS>
static inline void code_pair(const uint8_t* codes, int j, __m256 s0, __m256 s1, const float* m0, const float* m1,
                             __m256& w0, __m256& w1) {
  __m256i c0, c1;
  if constexpr (BITS == 4) {
    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + 8 * j)));
    c0 = _mm256_and_si256(d, _mm256_set1_epi32(15));
    c1 = _mm256_sub_epi32(d, c0);
  } else {
    c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + 8 * j)));
    c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + 16 + 8 * j)));
  }
  w0 = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(c0), _mm256_loadu_ps(m0));
  w1 = _mm256_fmadd_ps(s1, _mm256_cvtepi32_ps(c1), _mm256_loadu_ps(m1));
}

// The scales of outputs 8j.. and 16 + 8j.. of a group (sp: its 32), as code_pair takes them
template <int BITS>
static inline void pair_scales(const float* sp, int j, __m256& s0, __m256& s1) {
  s0 = _mm256_loadu_ps(sp + 8 * j);
  s1 = _mm256_loadu_ps(sp + 16 + 8 * j);
  if constexpr (BITS == 4) s1 = _mm256_mul_ps(s1, _mm256_set1_ps(0.0625f));
}

// One row x [K] times code panel p into out (cols <= 32 stored): every output in one pass, four FMA chains (one
// row's two would each wait on the FMA's latency), the chunks' sums added in order: panel_pass's floats. Not
// inlined: inside the parallel region's lambda GCC kept decoded weights on the stack.
template <int BITS>
__attribute__((noinline)) static void code_row1(const Panels& w, int64_t p, const float* x, float* out, int64_t cols) {
  constexpr int64_t ROW = BITS == 4 ? 16 : PANEL;  // bytes of codes per input
  const int64_t K = w.K, G = K / PANEL;
  const uint8_t* codes = w.codes + p * K * ROW;
  __m256 acc[4], sum[4];  // outputs 0-7, 16-23, 8-15, 24-31
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t g = k0 / PANEL; g < std::min(K, k0 + PANEL_CHUNK) / PANEL; ++g) {
      const float *sp = w.scale + (p * G + g) * PANEL, *mp = w.minimum + (p * G + g) * PANEL;
      for (int i = 0; i < 2; ++i) {  // the group 2 ahead's scales and minima (in the next panel near the end)
        prefetch_l1(sp + 2 * PANEL + 16 * i);
        prefetch_l1(mp + 2 * PANEL + 16 * i);
      }
      // the codes 2 KiB ahead, a line per 64 bytes of this group's
      for (int64_t c = 0; c < PANEL * ROW; c += 64) prefetch_l1((const char*)codes + g * PANEL * ROW + 2048 + c);
      __m256 s[4];
      pair_scales<BITS>(sp, 0, s[0], s[1]);
      pair_scales<BITS>(sp, 1, s[2], s[3]);
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        const __m256 a = _mm256_broadcast_ss(x + k);
        for (int j = 0; j < 2; ++j) {  // a pair at a time: its weights go into their FMAs before the next pair's
          __m256 w0, w1;
          code_pair<BITS>(codes + k * ROW, j, s[2 * j], s[2 * j + 1], mp + 8 * j, mp + 16 + 8 * j, w0, w1);
          acc[2 * j] = _mm256_fmadd_ps(a, w0, acc[2 * j]);
          acc[2 * j + 1] = _mm256_fmadd_ps(a, w1, acc[2 * j + 1]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) sum[j] = k0 == 0 ? acc[j] : _mm256_add_ps(sum[j], acc[j]);
  }
  alignas(32) float t[32];
  for (int j = 0; j < 2; ++j) {
    _mm256_store_ps(t + 8 * j, sum[2 * j]);
    _mm256_store_ps(t + 16 + 8 * j, sum[2 * j + 1]);
  }
  std::memcpy(out, t, cols * sizeof(float));
}

// MR rows of x (row stride ldx) times outputs 8j.. and 16 + 8j.. of code panel p into sum (rows of 32 floats): the
// weights decoded once per input for all MR rows, panel_pass's chains and sums
template <int BITS, int MR>
static inline void code_tile(const Panels& w, int64_t p, int j, const float* x, int64_t ldx, float* sum) {
  constexpr int64_t ROW = BITS == 4 ? 16 : PANEL;
  const int64_t K = w.K, G = K / PANEL;
  const uint8_t* codes = w.codes + p * K * ROW;
  __m256 acc[MR][2];
  for (int64_t k0 = 0; k0 < K; k0 += PANEL_CHUNK) {
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = k0 / PANEL; g < std::min(K, k0 + PANEL_CHUNK) / PANEL; ++g) {
      const float *sp = w.scale + (p * G + g) * PANEL, *mp = w.minimum + (p * G + g) * PANEL;
      __m256 s0, s1;
      pair_scales<BITS>(sp, j, s0, s1);
      for (int64_t k = g * PANEL; k < (g + 1) * PANEL; ++k) {
        __m256 w0, w1;
        code_pair<BITS>(codes + k * ROW, j, s0, s1, mp + 8 * j, mp + 16 + 8 * j, w0, w1);
        tile_fma<MR>(x, ldx, k, w0, w1, acc);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) {
        float* at = sum + r * 32 + 16 * h + 8 * j;
        _mm256_storeu_ps(at, k0 == 0 ? acc[r][h] : _mm256_add_ps(_mm256_loadu_ps(at), acc[r][h]));
      }
  }
}

// code_tile<BITS, m> for a run-time m <= MR
template <int BITS, int MR>
static inline void code_block(int64_t m, const Panels& w, int64_t p, int j, const float* x, int64_t ldx, float* sum) {
  if constexpr (MR > 1) {
    if (m < MR) return code_block<BITS, MR - 1>(m, w, p, j, x, ldx, sum);
  }
  code_tile<BITS, MR>(w, p, j, x, ldx, sum);
}

// rows [0, rows) of x (row stride K) times code panel p into out (row stride ldo, cols <= 32 stored)
constexpr int CODE_TILE = 4;  // rows a code tile: 8 accumulators, 2 weights, 2 scales, a broadcast and the decoding's
static void code_pass(const Panels& w, int64_t p, const float* x, int64_t rows, float* out, int64_t ldo, int64_t cols) {
  if (rows == 1) {
    if (w.bits == 4) code_row1<4>(w, p, x, out, cols);
    else code_row1<8>(w, p, x, out, cols);
    return;
  }
  thread_local std::vector<float> sums;
  sums.resize(rows * 32);
  for (int j = 0; j < 2; ++j)  // outputs 8j.. and 16 + 8j.. (a panel's unused columns computed too: zero codes)
    for (int64_t m0 = 0; m0 < rows; m0 += CODE_TILE) {
      const int64_t m = std::min<int64_t>(CODE_TILE, rows - m0);
      if (w.bits == 4) code_block<4, CODE_TILE>(m, w, p, j, x + m0 * w.K, w.K, sums.data() + m0 * 32);
      else code_block<8, CODE_TILE>(m, w, p, j, x + m0 * w.K, w.K, sums.data() + m0 * 32);
    }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * ldo, sums.data() + r * 32, cols * sizeof(float));
}
#endif

void panels_linear(Tensor out, const Tensor& x, const Panels& w, const char* what) {
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) &&
              out.size(1) <= w.P * PANEL && out.size(1) > (w.P - 1) * PANEL,
              what, ": out [M, N] must be contiguous float32 with 32 (P - 1) < N <= 32 P");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), chunk = panel_chunk(K);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(KVCACHE_AVX512)
  if (M == 1 && w.w == nullptr) {  // one row: the codes decoded in registers, two panels at a time
    parallel_each((w.P + 1) / 2, [&](int64_t i, int64_t) {
      code_row(w, 2 * i, 2 * i + 1 < w.P ? 2 * i + 1 : -1, xp, op, N);
    });
    return;
  }
#endif
  // work items: (chunk of rows, panel), chunk by chunk, taken by the threads as they free up (parallel.h)
  const int64_t items = (M + chunk - 1) / chunk * w.P;
#if defined(KVCACHE_AVX512) || defined(KVCACHE_AVX2)
  if (w.w == nullptr) {  // blocks of rows, the codes decoded in registers once per input and block
    parallel_each(items, [&](int64_t i, int64_t) {
      const int64_t c0 = i / w.P * chunk, p = i % w.P;
      code_pass(w, p, xp + c0 * K, std::min(M, c0 + chunk) - c0, op + c0 * N + p * PANEL, N,
                std::min(PANEL, N - p * PANEL));
    });
    return;
  }
#endif
  parallel_items(items, [&](WorkQueue& q) {
    std::vector<float> buf(w.buffer());
    const float* xr = nullptr;
    int64_t packed = -1;
    q.each([&](int64_t i, int64_t next) {
      const int64_t c0 = i / w.P * chunk, p = i % w.P, rows = std::min(M, c0 + chunk) - c0;
      if (c0 != packed) xr = pass_rows(xp + c0 * K, K, rows);  // the thread's rows, packed once a chunk
      packed = c0;
      panel_pass(xr, K, rows, w.get(p, buf.data()), w.ahead(next >= 0 ? next % w.P : -1), op + c0 * N + p * PANEL,
                 N, std::min(PANEL, N - p * PANEL));
    });
  });
}

void panel_linear(Tensor out, Tensor x, Tensor wp) {
  check_panels(x, wp, "panel_linear");
  panels_linear(out, x, f32_panels(wp), "panel_linear");
}

// panel_linear on code panels (Panels): the floats panel_linear gives on the float32 panels they decode to
void code_panel_linear(Tensor out, Tensor x, Tensor codes, Tensor scale,
                       Tensor minimum) {
  panels_linear(out, x, code_panels(x, codes, scale, minimum, "code_panel_linear"), "code_panel_linear");
}

// Steps of at most this many rows take a layer's code panels where it has them: with the codes decoded in registers
// (AVX-512), measured on a 576 x 1,536 layer from memory (2 Zen 4 cores), against the float32 panels in two runs:
// 2.97-2.99x at 1 row, 2.8-3.2x at 2, 1.8-2.0x at 4, 1.17-1.29x at 8, 0.93-1.09x at 16, 0.79-0.82x from 32 (where the
// arithmetic bounds both, and decoding adds to it; decoding a chunk of the panel into L1 once for every row block
// instead gave 0.85x at 32 rows, 0.91x at 64, 0.95x at 256). The AVX2 build decodes in registers too, with the same
// threshold. The plain build decodes a code panel into a buffer before multiplying it (Panels::get): it keeps no
// codes (0 rows).
#if defined(KVCACHE_AVX512) || defined(KVCACHE_AVX2)
constexpr int64_t CODE_ROWS = 8;
#else
constexpr int64_t CODE_ROWS = 0;
#endif
int64_t code_rows() { return CODE_ROWS; }

// A linear layer's tensors (see linear below) as panels, if they are: float32 panels [weight, (bias)], or with the
// same weights' code panels after them [weight, codes, scale, minimum, (bias)] (llama.py's Dense.pack), which steps
// of up to CODE_ROWS rows take; `n` becomes how many tensors the weight takes.
bool as_panels(const std::vector<Tensor>& L, const Tensor& x, Panels& w, size_t& n) {
  if (L[0].is_mkldnn() || L[0].dim() != 3 || L[0].scalar_type() != at::kFloat) return false;
  check_panels(x, L[0], "linear");
  n = L.size() >= 4 && L[1].dim() == 3 && L[1].scalar_type() == at::kByte ? 4 : 1;
  w = n == 4 && x.size(0) <= CODE_ROWS ? code_panels(x, L[1], L[2], L[3], "linear") : f32_panels(L[0]);
  TORCH_CHECK(w.P == L[0].size(0), "linear: ", w.P, " code panels for ", L[0].size(0), " float32 ones");
  return true;
}

// act [M, I] = silu_mul of x [M, K] times the gate/up weights [gate | up] packed by pack_panels (2I / 32 panels, I a
// multiple of 32), without [M, 2I] between them: each thread takes pairs of panels, gate panel j and up panel
// j + I / 32 (the same 32 channels of each), writes the gate's outputs in act and the up's in a buffer of its own,
// and combines them in place while both are in its cache. The floats of silu_mul(act, panel_linear(x, W)).
void panels_gate_up_silu(Tensor act, const Tensor& x, const Panels& w) {
  const int64_t M = x.size(0), K = x.size(1), I = act.size(1), half = w.P / 2, chunk = panel_chunk(K);
  TORCH_CHECK(act.dim() == 2 && act.is_contiguous() && act.scalar_type() == at::kFloat && act.size(0) == M &&
              I % PANEL == 0 && w.P == 2 * I / PANEL,
              "gate_up_silu: act [M, I] must be contiguous float32 with I a multiple of 32, for 2I / 32 panels; got I = ",
              I, " and ", w.P, " panels");
  const int64_t vec = silu_vec(PANEL);  // each 32 channels of a row: where silu_vec(I) puts them (I % 32 == 0)
  const float* xp = x.data_ptr<float>();
  float* ap = act.data_ptr<float>();
#if defined(KVCACHE_AVX512)
  if (M == 1 && w.w == nullptr) {  // one row: gate panel j and up panel j side by side, decoded in registers
    parallel_items(half, [&](WorkQueue& q) {
      alignas(64) float up[PANEL];
      for (int64_t j = q.take(); j >= 0; j = q.take()) {
        const int64_t p[2] = {j, j + half}, cols[2] = {PANEL, PANEL};
        float* const out[2] = {ap + j * PANEL, up};
        code_row(w, p, xp, out, cols);
        silu_mul_span(ap + j * PANEL, up, ap + j * PANEL, PANEL, vec);
      }
    });
    return;
  }
#endif
  // work items: (chunk of rows, pair of panels), chunk by chunk, taken by the threads as they free up (parallel.h)
  const int64_t items = (M + chunk - 1) / chunk * half;
#if defined(KVCACHE_AVX512) || defined(KVCACHE_AVX2)
  if (w.w == nullptr) {
    parallel_items(items, [&](WorkQueue& q) {
      std::vector<float> up(std::min(chunk, M) * PANEL);
      for (int64_t i = q.take(); i >= 0; i = q.take()) {
        const int64_t c0 = i / half * chunk, j = i % half, rows = std::min(M, c0 + chunk) - c0;
        float* a = ap + c0 * I + j * PANEL;
        code_pass(w, j, xp + c0 * K, rows, a, I, PANEL);
        code_pass(w, j + half, xp + c0 * K, rows, up.data(), PANEL, PANEL);
        for (int64_t r = 0; r < rows; ++r) silu_mul_span(a + r * I, up.data() + r * PANEL, a + r * I, PANEL, vec);
      }
    });
    return;
  }
#endif
  parallel_items(items, [&](WorkQueue& q) {
    std::vector<float> up(std::min(chunk, M) * PANEL), gbuf(w.buffer()), ubuf(w.buffer());
    const float* xr = nullptr;
    int64_t packed = -1;
    q.each([&](int64_t i, int64_t next) {
      const int64_t c0 = i / half * chunk, j = i % half, rows = std::min(M, c0 + chunk) - c0;
      if (c0 != packed) xr = pass_rows(xp + c0 * K, K, rows);  // the thread's rows, packed once a chunk
      packed = c0;
      const float *gate = w.get(j, gbuf.data()), *upw = w.get(j + half, ubuf.data());
      float* a = ap + c0 * I + j * PANEL;
      panel_pass(xr, K, rows, gate, w.w != nullptr ? upw : nullptr, a, I, PANEL);
      panel_pass(xr, K, rows, upw, w.ahead(next >= 0 ? next % half : -1), up.data(), PANEL, PANEL);
      for (int64_t r = 0; r < rows; ++r) silu_mul_span(a + r * I, up.data() + r * PANEL, a + r * I, PANEL, vec);
    });
  });
}

void gate_up_silu(Tensor act, Tensor x, Tensor wp) {
  check_panels(x, wp, "gate_up_silu");
  panels_gate_up_silu(act, x, f32_panels(wp));
}


}  // namespace kvcache
