// MatMulBF16, AVX-512 BF16 path (chosen at run time when the CPU has avx512bf16; see qgemm_op.cpp): a tile of up to
// 8 rows × 2 panels, 16 float accumulators, one vdpbf16ps per k pair and row against a broadcast activation pair.
// bf16_panels is the tile loop MatMulQBF16 runs on its decompressed panels too (qgemm.h, Bf16Panels).
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
void tile(const Bf16Panels& T, int64_t m0) {
  const int64_t pairs = T.Kp / 2, panel_elems = pairs * 32;
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  const uint16_t* a = T.a + m0 * T.lda;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[NP];
    for (int q = 0; q < NP; ++q) w[q] = (__m512bh)_mm512_loadu_si512(T.w + q * panel_elems + i * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * T.lda + 2 * i, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], x, w[q]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t n0 = T.n0 + q * kPanel, valid = std::min<int64_t>(kPanel, T.N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(T.y + (m0 + r) * T.N + n0, mask, acc[r][q]);
  }
}

template <int NP>
void rows(const Bf16Panels& T) {
  for (int64_t m0 = 0; m0 < T.M; m0 += 8) {
    switch (std::min<int64_t>(8, T.M - m0)) {
      case 1: tile<1, NP>(T, m0); break;
      case 2: tile<2, NP>(T, m0); break;
      case 3: tile<3, NP>(T, m0); break;
      case 4: tile<4, NP>(T, m0); break;
      case 5: tile<5, NP>(T, m0); break;
      case 6: tile<6, NP>(T, m0); break;
      case 7: tile<7, NP>(T, m0); break;
      default: tile<8, NP>(T, m0); break;
    }
  }
}

}  // namespace

void bf16_panels(const Bf16Panels& T, int panels) {
  if (panels == 2) rows<2>(T);
  else rows<1>(T);
}

void bgemm(const BGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = P.Kp / 2 * 32;
  for (int64_t p = panel_begin; p < panel_end; p += 2)
    bf16_panels({P.a, P.codes + p * panel_elems, P.y, P.M, P.N, P.Kp, p * kPanel, P.lda}, p + 1 < panel_end ? 2 : 1);
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
