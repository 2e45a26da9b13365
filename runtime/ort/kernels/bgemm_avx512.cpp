// MatMulBF16, AVX-512 BF16 path (chosen at run time when the CPU has avx512bf16; see qgemm_op.cpp): a tile of up to
// 8 rows × 2 panels, 16 float accumulators, one vdpbf16ps per k pair and row against a broadcast activation pair.
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
namespace {


template <int MR, int NP>
void tile(const BGemmProblem& P, int64_t m0, int64_t p) {
  const int64_t pairs = P.Kp / 2, panel_elems = pairs * 32;
  const uint16_t* panel = P.codes + p * panel_elems;
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const uint16_t* a = P.a + m0 * P.Kp;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[NP];
    for (int q = 0; q < NP; ++q) w[q] = (__m512bh)_mm512_loadu_si512(panel + q * panel_elems + i * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * P.Kp + 2 * i, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], x, w[q]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t n0 = (p + q) * kPanel, valid = std::min<int64_t>(kPanel, P.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(P.y + (m0 + r) * P.N + n0, mask, acc[r][q]);
  }
}

template <int NP>
void rows(const BGemmProblem& P, int64_t p) {
  for (int64_t m0 = 0; m0 < P.M; m0 += 8) {
    switch (std::min<int64_t>(8, P.M - m0)) {
      case 1: tile<1, NP>(P, m0, p); break;
      case 2: tile<2, NP>(P, m0, p); break;
      case 3: tile<3, NP>(P, m0, p); break;
      case 4: tile<4, NP>(P, m0, p); break;
      case 5: tile<5, NP>(P, m0, p); break;
      case 6: tile<6, NP>(P, m0, p); break;
      case 7: tile<7, NP>(P, m0, p); break;
      default: tile<8, NP>(P, m0, p); break;
    }
  }
}

}  // namespace

void bgemm(const BGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  int64_t p = panel_begin;
  for (; p + 1 < panel_end; p += 2) rows<2>(P, p);
  for (; p < panel_end; ++p) rows<1>(P, p);
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
