// MatMulBF16, AVX-512 BF16 path (chosen at run time when the CPU has avx512bf16; see qgemm_op.cpp): a tile of up to
// 8 rows × 2 panels, 16 float accumulators, one vdpbf16ps per k pair and row against a broadcast activation pair.
// bf16_panels is the tile loop MatMulQBF16 runs on its decompressed panels too (qgemm.h, Bf16Panels).
// MatMulBF16's weights stream from memory once per step (212 MB for SmolLM2, far beyond the caches): while a pair of
// panels is multiplied, the next pair is prefetched, a few lines per k pair spread over the pair's row tiles, so
// the memory reads overlap the vdpbf16ps instead of stalling the first tile of every pair. Into L1 when the pair
// has several row tiles, L2 when one: a C++ harness of a decode step's 121 bf16 matrices on the Zen 4 VM (2
// threads) read M 64 344–360 → 372–394 GOP/s, M 16 185–247 → 242–289, M 8 171–176 → 200–224; in decode steps
// (same process, switched step by step) 8 rows 16.0 → 13.0 ms, 4 rows 12.9 → 12.0.
// Layout and contract: bgemm_generic.cpp. Its own translation unit, as every vector path here.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

namespace omf::avx512bf16 {
#include "avx512_tile.h"
namespace {

// the next panels are prefetched up to kPrefetchRows rows (qgemm.h); below this many rows the hardware prefetcher
// streams the panels alone (one row: 9.3 → 10.1 ms a decode step with the prefetch, same process, alternated)
constexpr int64_t kPrefetchMinRows = 4;
// and only while a pair of panels (Kp × 64 bytes) is small beside L2: at Llama-3-8B's K 4,096 and 14,336 (pairs of
// 256 KB and 900 KB) the prefetched lines displaced the pair being read — the harness of two 8B layers read M 16
// 327–345 → 286–295 GOP/s with them, M 64 no better — while MatMulQ's 4-bit pairs (a quarter of the bytes) gained
// there too (M 64 468–532 → 559–577, M 16 405–424 → 449–481)
constexpr int64_t kPrefetchMaxK = 2048;

// PF: prefetches `lines` cache lines from `pf` on, evenly over the tile's k pairs (a separate instantiation: the
// bookkeeping in the loop cost large M 5% where it prefetches nothing)
template <int MR, int NP, bool PF>
void tile(const Bf16Panels& T, int64_t m0, const char* pf, int64_t lines) {
  const int64_t pairs = T.Kp / 2, panel_elems = pairs * 32;
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const uint16_t* a = T.a + m0 * T.lda;
  int64_t due = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    if constexpr (PF)
      for (due += lines; due >= pairs; due -= pairs, pf += 64) {
        if (MR > 1 && T.M > 8) __builtin_prefetch(pf, 0, 3);  // prefetcht0
        else __builtin_prefetch(pf, 0, 2);                    // prefetcht1
      }
    __m512bh w[NP];
    for (int q = 0; q < NP; ++q) w[q] = (__m512bh)_mm512_loadu_si512(T.w + q * panel_elems + i * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * T.lda + 2 * i, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], x, w[q]);
    }
  }
  store_tile(acc, T.y, T.N, m0, T.n0);  // a wide output (the lm_head's logits) with streaming stores, as MatMulQ's
}

// `next`, `next_bytes`: what to prefetch meanwhile (the thread's likely next panels; nullptr, 0 for nothing)
template <int NP, bool PF>
void rows(const Bf16Panels& T, const void* next, int64_t next_bytes) {
  const int64_t tiles = (T.M + 7) / 8, lines = next_bytes / 64;
  for (int64_t m0 = 0, t = 0; m0 < T.M; m0 += 8, ++t) {
    const char* pf = static_cast<const char*>(next) + t * lines / tiles * 64;
    const int64_t n = (t + 1) * lines / tiles - t * lines / tiles;
    switch (std::min<int64_t>(8, T.M - m0)) {
      case 1: tile<1, NP, PF>(T, m0, pf, n); break;
      case 2: tile<2, NP, PF>(T, m0, pf, n); break;
      case 3: tile<3, NP, PF>(T, m0, pf, n); break;
      case 4: tile<4, NP, PF>(T, m0, pf, n); break;
      case 5: tile<5, NP, PF>(T, m0, pf, n); break;
      case 6: tile<6, NP, PF>(T, m0, pf, n); break;
      case 7: tile<7, NP, PF>(T, m0, pf, n); break;
      default: tile<8, NP, PF>(T, m0, pf, n); break;
    }
  }
  if (T.N >= kStreamColumns) _mm_sfence();  // this pair's streaming stores visible before the call returns
}

}  // namespace

void bf16_panels(const Bf16Panels& T, int panels) {
  if (panels == 2) rows<2, false>(T, nullptr, 0);
  else rows<1, false>(T, nullptr, 0);
}

void bgemm(const BGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = P.Kp / 2 * 32, total = panels_of(P.N);
  const bool prefetch = P.M >= kPrefetchMinRows && P.M <= kPrefetchRows && P.Kp <= kPrefetchMaxK;
  for (int64_t p = panel_begin; p < panel_end; p += 2) {
    // the next pair: this thread's next work item as ORT's pool hands them out (contiguous runs per thread)
    const int64_t ahead = prefetch ? std::clamp<int64_t>(total - (p + 2), 0, 2) : 0;
    const uint16_t* next = ahead ? P.codes + (p + 2) * panel_elems : nullptr;
    const Bf16Panels T{P.a, P.codes + p * panel_elems, P.y, P.M, P.N, P.Kp, p * kPanel, P.lda};
    const int64_t bytes = ahead * panel_elems * 2;
    if (p + 1 < panel_end) bytes ? rows<2, true>(T, next, bytes) : rows<2, false>(T, nullptr, 0);
    else bytes ? rows<1, true>(T, next, bytes) : rows<1, false>(T, nullptr, 0);
  }
}

void to_bf16_rows(const float* x, int64_t K, int64_t Kp, uint16_t* out, int64_t row_begin, int64_t row_end) {
  for (int64_t m = row_begin; m < row_end; ++m) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * Kp + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + k)));
    for (; k < K; ++k) out[m * Kp + k] = bf16_round(x[m * K + k]);
    for (; k < Kp; ++k) out[m * Kp + k] = 0;
  }
}

}  // namespace omf::avx512bf16

#pragma GCC pop_options
#endif
