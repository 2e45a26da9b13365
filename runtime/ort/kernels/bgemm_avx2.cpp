// MatMulBF16 and MatMulQBF16, AVX2 path (chosen at run time on a CPU with avx2 + fma and no avx512bf16; see
// qgemm_op.cpp): AVX2 has no bfloat16 dot product, so each 64-byte k pair of a panel (panel16-bf16: 16 columns ×
// 2 k, bgemm_generic.cpp) is widened in registers — the even k of a pair is a 32-bit lane shifted left by 16, the odd
// k the lane with its low half cleared — and multiplied by the row's activation pair widened the same way, two FMAs
// per 8 columns. A bfloat16 × bfloat16 product is exact in float32 (8 + 8 significant bits), so fma(hi, hi, acc)
// then fma(lo, lo, acc) is the portable path's `acc += hi·hi; acc += lo·lo` bit for bit (tests/test_matmul_bf16.py
// checks it). The point of the path: a decode step streams the weights once, and bfloat16 halves float32's bytes;
// before it, an AVX2 CPU ran bfloat16 bundles on the portable loop (1B shape: 0.9 tok/s against llama.cpp F16's 8.0,
// benchmarks/RESULTS.md 2026-12-06).
// Tile: up to 4 rows × 1 panel (8 float accumulators, 4 widened weight vectors, 2 activation vectors: 14 of the 16
// ymm registers). MatMulQBF16 decompresses its panels with the portable decompressor and runs these tiles.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace omf::avx2 {
namespace {

constexpr int kRows = 4;  // rows per tile

// the 16 columns of one panel's row r: 8 + 8 floats, a partial panel's columns past N not written; a wide output
// (N ≥ kStreamColumns: an lm_head's logits) with streaming stores where the row is 32-byte aligned
inline void store_row(float* row, __m256 lo, __m256 hi, int64_t valid, bool stream) {
  if (valid == kPanel) {
    if (stream && (reinterpret_cast<uintptr_t>(row) & 31) == 0) {
      _mm256_stream_ps(row, lo);
      _mm256_stream_ps(row + 8, hi);
    } else {
      _mm256_storeu_ps(row, lo);
      _mm256_storeu_ps(row + 8, hi);
    }
    return;
  }
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  std::memcpy(row, tmp, static_cast<size_t>(valid) * sizeof(float));
}

template <int MR>
void tile(const Bf16Panels& T, const uint16_t* panel, int64_t n0, int64_t m0) {
  const int64_t pairs = T.Kp / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint16_t* a = T.a + m0 * T.lda;
  for (int64_t i = 0; i < pairs; ++i) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * 32));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * 32 + 16));
    const __m256 we0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), wo0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
    const __m256 we1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), wo1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * T.lda + 2 * i, 4);
      const __m256i x = _mm256_set1_epi32(pair);
      const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), xo = _mm256_castsi256_ps(_mm256_and_si256(x, high));
      acc[r][0] = _mm256_fmadd_ps(xe, we0, _mm256_fmadd_ps(xo, wo0, acc[r][0]));  // high element first, as the
      acc[r][1] = _mm256_fmadd_ps(xe, we1, _mm256_fmadd_ps(xo, wo1, acc[r][1]));  // portable path adds them
    }
  }
  const int64_t valid = std::min<int64_t>(kPanel, T.N - n0);
  for (int r = 0; r < MR; ++r) store_row(T.y + (m0 + r) * T.N + n0, acc[r][0], acc[r][1], valid, T.N >= kStreamColumns);
}

}  // namespace

void bf16_panels(const Bf16Panels& T, int panels) {
  const int64_t panel_elems = T.Kp / 2 * 32;
  for (int q = 0; q < panels; ++q) {
    const int64_t n0 = T.n0 + q * kPanel;
    if (n0 >= T.N) break;
    const uint16_t* panel = T.w + q * panel_elems;
    for (int64_t m0 = 0; m0 < T.M; m0 += kRows) {
      switch (std::min<int64_t>(kRows, T.M - m0)) {
        case 1: tile<1>(T, panel, n0, m0); break;
        case 2: tile<2>(T, panel, n0, m0); break;
        case 3: tile<3>(T, panel, n0, m0); break;
        default: tile<4>(T, panel, n0, m0); break;
      }
    }
  }
  if (T.N >= kStreamColumns) _mm_sfence();  // the streaming stores visible before the work item returns
}

void bgemm(const BGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = P.Kp / 2 * 32;
  for (int64_t p = panel_begin; p < panel_end; p += 2) {
    const int n = p + 1 < panel_end ? 2 : 1;
    bf16_panels({P.a, P.codes + p * panel_elems, P.y, P.M, P.N, P.Kp, p * kPanel, P.lda}, n);
  }
}

void qbgemm(const QBGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  qbgemm_pairs(P, panel_begin, panel_end, [&P](int64_t p, uint16_t* out) { generic::decompress_panel(P, p, out); },
               [](const Bf16Panels& T, int n) { bf16_panels(T, n); });
}

// bf16_round (bf16.h) on 8 lanes: round to nearest even, a NaN stays a (quiet) NaN
inline __m256i round8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

void to_bf16_rows(const float* x, int64_t K, int64_t Kp, uint16_t* out, int64_t row_begin, int64_t row_end) {
  for (int64_t m = row_begin; m < row_end; ++m) {
    const float* xr = x + m * K;
    uint16_t* o = out + m * Kp;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {  // packus interleaves the 128-bit lanes: [a0-3 b0-3 a4-7 b4-7] → a, b in order
      const __m256i packed = _mm256_packus_epi32(round8(_mm256_loadu_ps(xr + k)), round8(_mm256_loadu_ps(xr + k + 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), _mm256_permute4x64_epi64(packed, 0xd8));
    }
    for (; k < K; ++k) o[k] = bf16_round(xr[k]);
    for (; k < Kp; ++k) o[k] = 0;
  }
}

}  // namespace omf::avx2

#pragma GCC pop_options
#endif
