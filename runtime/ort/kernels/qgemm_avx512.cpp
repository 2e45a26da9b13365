// MatMulQ, AVX-512 VNNI path (chosen at run time when the CPU has avx512vnni + avx512bw; see custom_op.cpp).
// Register blocking: from kPairRows rows on, tiles of kRows2 rows × two 16-column panels (4 × 2: at 6 × 2 the
// float accumulators spill, measured ~30% slower), else up to 8 rows × one panel. Per 32-k chunk a panel's codes
// are loaded (and, for 4 bits, split into nibbles) once and shared by every row of the tile; each row then takes one
// vpdpbusd per 4 k with its activations broadcast from memory, accumulating exact int32 products per chunk, which
// are scaled into float accumulators (same order of float operations as the portable path: results agree bit for
// bit). See qgemm.h for the layout and the formula.
// From kPairRows to kPrefetchRows rows, while a pair of panels is multiplied the next pair's codes, scales and
// offsets are prefetched, spread over the pair's row tiles: the weights stream from memory once per step and the
// first tile of every pair otherwise waits for them. Decode steps of the int4 + int8 KV bundle, the same process
// switching it on and off step by step (context 200, medians of 20): 64 sequences 45.3–45.8 → 42.9–43.3 ms,
// 32: 33.8 → 31.8, 16: 15.7–15.9 → 13.5–13.8; a prefill step of 4 × 128 rows (no prefetch there) unchanged; one
// and two rows (single panels, no prefetch) were slower with it (5.9 → 6.6 ms), where the hardware prefetcher
// already streams the one panel.
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qgemm.h"

#ifndef OMF_ROWS2
#define OMF_ROWS2 4
#endif
#ifndef OMF_PAIR
#define OMF_PAIR 4
#endif

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")

namespace omf::avx512vnni {
#include "avx512_reduce.h"
#include "avx512_tile.h"
namespace {

constexpr int kRows2 = OMF_ROWS2;   // rows per tile of two panels
constexpr int kPairRows = OMF_PAIR;  // from this many rows on, tiles span two panels

// The cache lines of up to three regions (the next panels' codes, scales, offsets), prefetched one per call of
// next(), in order.
struct PanelPrefetch {
  const char* p[3] = {nullptr, nullptr, nullptr};
  int64_t lines[3] = {0, 0, 0};
  int r = 0;
  int64_t total() const { return lines[0] + lines[1] + lines[2]; }
  void next() {
    while (r < 3 && lines[r] == 0) ++r;
    if (r == 3) return;
    __builtin_prefetch(p[r], 0, 3);  // prefetcht0 (prefetcht1 and t2 measured the same or slower)
    p[r] += 64;
    --lines[r];
  }
};

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// PF: `lines` of `ahead` prefetched evenly over the tile's chunks (a separate instantiation without)
template <int BITS, int MR, int NP, bool PF>
void tile(const QGemmProblem& P, int64_t m0, int64_t p, PanelPrefetch& ahead, int64_t lines) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block, per_block = P.block / kChunk;
  constexpr int64_t chunk_bytes = kPanel * kChunk * BITS / 8;
  const int64_t panel_bytes = chunks * chunk_bytes;
  const uint8_t* panel = P.codes + p * panel_bytes;
  const uint16_t* sp = P.scales + p * kb * kPanel;
  const float* op = P.offsets ? P.offsets + p * kb * kPanel : nullptr;
  constexpr int32_t z = 1 << (BITS - 1);
  const int8_t* a[MR];
  for (int r = 0; r < MR; ++r) a[r] = P.x.a + (m0 + r) * P.Kp;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  int64_t due = 0;
  for (int64_t b = 0; b < kb; ++b) {
    __m512 s[NP];
    for (int q = 0; q < NP; ++q)
      s[q] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + (q * kb + b) * kPanel)));
    for (int64_t j = b * per_block; j < (b + 1) * per_block; ++j) {
      if constexpr (PF)
        for (due += lines; due >= chunks; due -= chunks) ahead.next();
      const uint8_t* c = panel + j * chunk_bytes;
      const int64_t k0 = j * kChunk;
      __m512i dot[MR][NP];  // started at −z·Σa: the products come out as Σ (c − z)·a
      for (int r = 0; r < MR; ++r) {
        const __m512i start = _mm512_set1_epi32(-z * P.x.asum[(m0 + r) * chunks + j]);
        for (int q = 0; q < NP; ++q) dot[r][q] = start;
      }
      if constexpr (BITS == 4) {
        for (int h = 0; h < 4; ++h) {
          __m512i lo[NP], hi[NP];
          for (int q = 0; q < NP; ++q) {
            const __m512i v = _mm512_loadu_si512(c + q * panel_bytes + h * 64);
            lo[q] = _mm512_and_si512(v, low4);
            hi[q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          }
          for (int r = 0; r < MR; ++r) {
            const __m512i al = broadcast4(a[r] + k0 + 8 * h), ah = broadcast4(a[r] + k0 + 8 * h + 4);
            for (int q = 0; q < NP; ++q) {
              dot[r][q] = _mm512_dpbusd_epi32(dot[r][q], lo[q], al);
              dot[r][q] = _mm512_dpbusd_epi32(dot[r][q], hi[q], ah);
            }
          }
        }
      } else {
        for (int g = 0; g < 8; ++g) {
          __m512i v[NP];
          for (int q = 0; q < NP; ++q) v[q] = _mm512_loadu_si512(c + q * panel_bytes + g * 64);
          for (int r = 0; r < MR; ++r) {
            const __m512i ag = broadcast4(a[r] + k0 + 4 * g);
            for (int q = 0; q < NP; ++q) dot[r][q] = _mm512_dpbusd_epi32(dot[r][q], v[q], ag);
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m512 d = _mm512_set1_ps(P.x.d[(m0 + r) * chunks + j]);
        for (int q = 0; q < NP; ++q)
          acc[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][q]), _mm512_mul_ps(s[q], d), acc[r][q]);
      }
    }
    if (op) {
      for (int q = 0; q < NP; ++q) {
        const __m512 o = _mm512_loadu_ps(op + (q * kb + b) * kPanel);
        for (int r = 0; r < MR; ++r)
          acc[r][q] = _mm512_fmadd_ps(o, _mm512_set1_ps(P.x.xsum[(m0 + r) * kb + b]), acc[r][q]);
      }
    }
  }
  store_tile(acc, P.y, P.N, m0, p * kPanel);  // a wide output (the lm_head's logits) with streaming stores
}

// `ahead`: what to prefetch over the row tiles (PF), its lines split evenly between them
template <int BITS, int NP, bool PF>
void rows(const QGemmProblem& P, int64_t p, PanelPrefetch& ahead) {
  constexpr int R = NP == 1 ? 8 : kRows2;
  const int64_t tiles = (P.M + R - 1) / R, total = ahead.total();
  for (int64_t m0 = 0, t = 0; m0 < P.M; m0 += R, ++t) {
    const int64_t lines = (t + 1) * total / tiles - t * total / tiles;
    switch (std::min<int64_t>(R, P.M - m0)) {
      case 1: tile<BITS, 1, NP, PF>(P, m0, p, ahead, lines); break;
      case 2: tile<BITS, 2, NP, PF>(P, m0, p, ahead, lines); break;
      case 3: tile<BITS, 3, NP, PF>(P, m0, p, ahead, lines); break;
      case 4: tile<BITS, 4, NP, PF>(P, m0, p, ahead, lines); break;
      case 5: if constexpr (R >= 5) tile<BITS, 5, NP, PF>(P, m0, p, ahead, lines); break;
      case 6: if constexpr (R >= 6) tile<BITS, 6, NP, PF>(P, m0, p, ahead, lines); break;
      case 7: if constexpr (R >= 7) tile<BITS, 7, NP, PF>(P, m0, p, ahead, lines); break;
      default: if constexpr (R >= 8) tile<BITS, 8, NP, PF>(P, m0, p, ahead, lines); break;
    }
  }
}

// panels [next, next + 2) of the weight (clipped to it): their codes, scales and offsets
template <int BITS>
PanelPrefetch pair_at(const QGemmProblem& P, int64_t next) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block, panels = panels_of(P.N);
  const int64_t n = std::clamp<int64_t>(panels - next, 0, 2), panel_bytes = chunks * kPanel * kChunk * BITS / 8;
  PanelPrefetch a;
  if (n == 0) return a;
  a.p[0] = reinterpret_cast<const char*>(P.codes + next * panel_bytes), a.lines[0] = n * panel_bytes / 64;
  a.p[1] = reinterpret_cast<const char*>(P.scales + next * kb * kPanel), a.lines[1] = (n * kb * kPanel * 2 + 63) / 64;
  if (P.offsets)
    a.p[2] = reinterpret_cast<const char*>(P.offsets + next * kb * kPanel), a.lines[2] = n * kb * kPanel * 4 / 64;
  return a;
}

template <int BITS>
void panels(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  int64_t p = panel_begin;
  PanelPrefetch none;
  if (P.M >= kPairRows)
    for (; p + 1 < panel_end; p += 2) {
      // the next pair: this thread's next work item as ORT's pool hands them out (contiguous runs per thread)
      PanelPrefetch ahead = P.M <= kPrefetchRows ? pair_at<BITS>(P, p + 2) : none;
      if (ahead.total() > 0) rows<BITS, 2, true>(P, p, ahead);
      else rows<BITS, 2, false>(P, p, none);
    }
  for (; p < panel_end; ++p) rows<BITS, 1, false>(P, p, none);
}

}  // namespace

void qgemm(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  if (P.bits == 4) panels<4>(P, panel_begin, panel_end);
  else panels<8>(P, panel_begin, panel_end);
  if (P.N >= kStreamColumns) _mm_sfence();  // streaming stores are visible before the op returns
}

// qgemm.h's block_sums order from the chunk's two halves already in registers: acc = x0 + x1 on a block's first
// chunk, (acc + x0) + x1 on the next, then the halving tree at the block's last chunk
inline float halving_sum(__m512 acc) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));  // AVX-512F only
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(acc), hi);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

void quantize_rows(const float* x, int64_t K, int64_t Kp, int64_t block, bool want_xsum, const QuantizedRows& q,
                   int64_t row_begin, int64_t row_end) {
  const int64_t chunks = Kp / kChunk, per_block = block / kChunk;
  for (int64_t m = row_begin; m < row_end; ++m) {
    const float* xr = x + m * K;
    int8_t* ar = q.a + m * Kp;
    __m512 bsum = _mm512_setzero_ps();
    float* xsum = q.xsum + m * (Kp / block);
    int64_t in_block = 0;  // the next chunk's place in its block (chunks come in order)
    auto block_sum = [&](__m512 x0, __m512 x1) {  // qgemm.h's block_sums order, one chunk's share
      bsum = in_block == 0 ? _mm512_add_ps(x0, x1) : _mm512_add_ps(_mm512_add_ps(bsum, x0), x1);
      if (++in_block == per_block) *xsum++ = halving_sum(bsum), in_block = 0;
    };
    int64_t j = 0;
    // 16 whole chunks at a time: their max |x|, scales and code sums reduced together (one transposing reduction
    // each instead of 16 horizontal ones), the same values as one chunk at a time below
    for (; j + 16 <= chunks && (j + 16) * kChunk <= K; j += 16) {
      const float* xg = xr + j * kChunk;
      __m512i mx[16], sums[16];
      for (int c = 0; c < 16; ++c)
        mx[c] = _mm512_castps_si512(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xg + c * kChunk)),
                                                  _mm512_abs_ps(_mm512_loadu_ps(xg + c * kChunk + 16))));
      const __m512 amax = _mm512_castsi512_ps(reduce16(mx, FloatMax{})), c127 = _mm512_set1_ps(127.0f);
      const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), c127, amax);
      alignas(64) float invs[16];
      _mm512_store_ps(invs, inv);
      // two chunks' 64 codes per store: saturating packs (the codes are within ±127 already, so the same bytes as
      // a plain narrowing) and one dword permute restoring k order — vpmovdb, twice per chunk, was this loop's
      // hot spot (perf, prefill steps)
      const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      for (int c = 0; c < 16; c += 2) {
        __m512i q[4];
        for (int h = 0; h < 2; ++h) {
          const __m512 x0 = _mm512_loadu_ps(xg + (c + h) * kChunk), x1 = _mm512_loadu_ps(xg + (c + h) * kChunk + 16);
          const __m512 vinv = _mm512_set1_ps(invs[c + h]);
          q[2 * h] = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv));
          q[2 * h + 1] = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
          sums[c + h] = _mm512_add_epi32(q[2 * h], q[2 * h + 1]);
          if (want_xsum) block_sum(x0, x1);
        }
        const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
        _mm512_storeu_si512(ar + (j + c) * kChunk, _mm512_permutexvar_epi32(order, bytes));
      }
      _mm512_storeu_ps(q.d + m * chunks + j, _mm512_div_ps(amax, c127));  // record_chunk's d and Σa, 16 at once
      _mm512_storeu_si512(q.asum + m * chunks + j, reduce16(sums, IntAdd{}));
    }
    for (; j < chunks; ++j) {
      const int64_t k0 = j * kChunk, n = std::max<int64_t>(0, std::min<int64_t>(kChunk, K - k0));
      const __mmask16 m0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1u);
      const __mmask16 m1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1u : 0u);
      const __m512 x0 = _mm512_maskz_loadu_ps(m0, xr + k0), x1 = _mm512_maskz_loadu_ps(m1, xr + k0 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ar + k0), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ar + k0 + 16), _mm512_cvtepi32_epi8(q1));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      record_chunk(q, m, chunks, j, d, sum);
      if (want_xsum) block_sum(x0, x1);
    }
  }
}

}  // namespace omf::avx512vnni

#pragma GCC pop_options
#endif
