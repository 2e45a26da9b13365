// MatMulF32, AVX-512F path (chosen at run time when the CPU has avx512f; see qgemm_op.cpp): a tile of up to 8 rows ×
// 2 panels, 16 float accumulators, per k two 64-byte weight loads and one vfmadd231ps per row and panel against the
// row's broadcast activation — the tile of MatMulBF16 (bgemm_avx512.cpp) with one k per instruction instead of a
// pair. As there, the weights stream from memory once per step (SmolLM2: 538 MB), so the next pair of panels is
// prefetched while a pair is multiplied. Against ORT's MLAS float32 MatMul over a decode step's 121 matrices on the
// Zen 4 VM (2 threads, alternated; benchmarks/RESULTS.md 2026-12-05): M 8 86 → 93–96 GOP/s, 16 123 → 143, 32
// 159–169 → 185–195, 64 189 → 213–217, 128 203 → 212, 512 210 → 213; one row 14 both. Inside a step 512 rows run
// 4–8% slower than MLAS (cause not found; what was tried is in RESULTS), so recipes can keep MLAS (float_gemm).
// Layout and contract: fgemm_generic.cpp (the same fma per k in k order: bit for bit the portable path).
#include <algorithm>
#include <cstdint>

#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

namespace omf::avx512f {
#include "avx512_tile.h"
namespace {

constexpr int64_t kPrefetchMinRows = 4;  // as MatMulBF16's: fewer rows stream well from the hardware prefetcher
// a pair of panels is K × 128 bytes: prefetched while it stays small beside L2 (MatMulBF16's 256 KB bound)
constexpr int64_t kPrefetchMaxK = 2048;

template <int MR, int NP, bool PF>
void tile(const FGemmProblem& P, const float* w, int64_t n0, int64_t m0, const char* pf, int64_t lines) {
  const int64_t K = P.K, panel_elems = K * kPanel;
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const float* a = P.a + m0 * K;
  int64_t due = 0;
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PF)
      for (due += lines; due >= K; due -= K, pf += 64) {
        if (MR > 1 && P.M > 8) __builtin_prefetch(pf, 0, 3);  // prefetcht0: several tiles read the pair
        else __builtin_prefetch(pf, 0, 2);                    // prefetcht1
      }
    __m512 wv[NP];
    for (int q = 0; q < NP; ++q) wv[q] = _mm512_loadu_ps(w + q * panel_elems + k * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * K + k]);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_fmadd_ps(x, wv[q], acc[r][q]);
    }
  }
  store_tile(acc, P.y, P.N, m0, n0);  // a wide output (the lm_head's logits) with streaming stores
}

// the row tiles over a pair (NP = 2) or a last single panel at panel p; `next`, `next_bytes`: what to prefetch meanwhile
template <int NP, bool PF>
void rows(const FGemmProblem& P, int64_t p, const char* next, int64_t next_bytes) {
  const float* w = P.w + p * P.K * kPanel;
  const int64_t n0 = p * kPanel, tiles = (P.M + 7) / 8, lines = next_bytes / 64;
  for (int64_t m0 = 0, t = 0; m0 < P.M; m0 += 8, ++t) {
    const char* pf = next + t * lines / tiles * 64;
    const int64_t n = (t + 1) * lines / tiles - t * lines / tiles;
    switch (std::min<int64_t>(8, P.M - m0)) {
      case 1: tile<1, NP, PF>(P, w, n0, m0, pf, n); break;
      case 2: tile<2, NP, PF>(P, w, n0, m0, pf, n); break;
      case 3: tile<3, NP, PF>(P, w, n0, m0, pf, n); break;
      case 4: tile<4, NP, PF>(P, w, n0, m0, pf, n); break;
      case 5: tile<5, NP, PF>(P, w, n0, m0, pf, n); break;
      case 6: tile<6, NP, PF>(P, w, n0, m0, pf, n); break;
      case 7: tile<7, NP, PF>(P, w, n0, m0, pf, n); break;
      default: tile<8, NP, PF>(P, w, n0, m0, pf, n); break;
    }
  }
  if (P.N >= kStreamColumns) _mm_sfence();  // this pair's streaming stores visible before the call returns
}

}  // namespace

void fgemm(const FGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = P.K * kPanel, total = panels_of(P.N);
  const bool prefetch = P.M >= kPrefetchMinRows && P.M <= kPrefetchRows && P.K <= kPrefetchMaxK;
  for (int64_t p = panel_begin; p < panel_end; p += 2) {
    // the next pair: this thread's next work item as ORT's pool hands them out (contiguous runs per thread)
    const int64_t ahead = prefetch ? std::clamp<int64_t>(total - (p + 2), 0, 2) : 0;
    const char* next = ahead ? reinterpret_cast<const char*>(P.w + (p + 2) * panel_elems) : nullptr;
    const int64_t bytes = ahead * panel_elems * 4;
    if (p + 1 < panel_end) bytes ? rows<2, true>(P, p, next, bytes) : rows<2, false>(P, p, nullptr, 0);
    else bytes ? rows<1, true>(P, p, next, bytes) : rows<1, false>(P, p, nullptr, 0);
  }
}

}  // namespace omf::avx512f

#pragma GCC pop_options
#endif
