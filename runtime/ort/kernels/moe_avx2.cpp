// MoEF32's expert GEMMs on AVX2 + FMA, for CPUs without AVX-512F (where MatMulF32 has only its portable path, a
// scalar loop: the compile stage keeps dense float32 weights on ORT's MatMul there, but an MoE block has no such
// fallback short of computing every expert). MatMulF32's contract and layout (fgemm_generic.cpp: panel16-f32, one
// fma per k in k order from 0, so the portable path's bits): a tile of up to 6 rows × 1 panel (12 accumulators, two
// 32-byte weight loads per k), or for 1–2 rows (a decode's tokens per expert) 2 panels at once (more independent
// chains per weight stream). moe_op.cpp's moe_f32 chooses it.
#include <algorithm>
#include <cstdint>

#include "moe.h"
#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace omf::moe_avx2 {
namespace {

// rows m0 … m0 + MR − 1 × the NP panels from p (columns past N not stored)
template <int MR, int NP>
void tile(const FGemmProblem& P, int64_t p, int64_t m0) {
  const int64_t K = P.K, panel_elems = K * kPanel;
  const float* w = P.w + p * panel_elems;
  const float* a = P.a + m0 * K;
  __m256 acc[MR][2 * NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 2 * NP; ++q) acc[r][q] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[2 * NP];
    for (int q = 0; q < 2 * NP; ++q) wv[q] = _mm256_loadu_ps(w + (q / 2) * panel_elems + k * kPanel + (q % 2) * 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * K + k);
      for (int q = 0; q < 2 * NP; ++q) acc[r][q] = _mm256_fmadd_ps(x, wv[q], acc[r][q]);
    }
  }
  for (int q = 0; q < 2 * NP; ++q) {
    const int64_t n = p * kPanel + (q / 2) * kPanel + (q % 2) * 8, valid = std::min<int64_t>(8, P.N - n);
    if (valid <= 0) continue;
    alignas(32) int32_t lanes[8];
    for (int i = 0; i < 8; ++i) lanes[i] = i < valid ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    for (int r = 0; r < MR; ++r) {
      float* y = P.y + (m0 + r) * P.N + n;
      if (valid == 8) _mm256_storeu_ps(y, acc[r][q]);
      else _mm256_maskstore_ps(y, mask, acc[r][q]);
    }
  }
}

template <int NP>
void rows(const FGemmProblem& P, int64_t p) {
  constexpr int kRows = NP == 2 ? 2 : 6;
  for (int64_t m0 = 0; m0 < P.M; m0 += kRows) {
    switch (std::min<int64_t>(kRows, P.M - m0)) {
      case 1: tile<1, NP>(P, p, m0); break;
      case 2: tile<2, NP>(P, p, m0); break;
      case 3: if constexpr (NP == 1) tile<3, 1>(P, p, m0); break;
      case 4: if constexpr (NP == 1) tile<4, 1>(P, p, m0); break;
      case 5: if constexpr (NP == 1) tile<5, 1>(P, p, m0); break;
      default: if constexpr (NP == 1) tile<6, 1>(P, p, m0); break;
    }
  }
}

}  // namespace

void fgemm(const FGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  for (int64_t p = panel_begin; p < panel_end;) {
    if (P.M <= 2 && p + 1 < panel_end) {
      rows<2>(P, p);
      p += 2;
    } else {
      rows<1>(P, p);
      p += 1;
    }
  }
}

}  // namespace omf::moe_avx2

#pragma GCC pop_options
#endif
