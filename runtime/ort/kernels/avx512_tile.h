// store_tile: a GEMM tile's MR × NP accumulators (NP panels of 16 columns) stored to y [.., N] at rows m0.. and
// columns n0.. — a partial last panel masked; a wide output (N ≥ kStreamColumns: an lm_head's logits, far beyond
// L2) with streaming stores where a whole panel's row is 64-byte aligned, since a plain store of a line not in
// cache reads it first (~2× slower measured at M 64, MatMulQ). The caller fences (_mm_sfence) before its work is
// seen. The one copy of that rule for MatMulQ's, MatMulBF16's and MatMulF32's AVX-512 tiles. Included inside a
// namespace after an AVX-512 target pragma (qgemm_avx512.cpp, bgemm_avx512.cpp, fgemm_avx512.cpp), so it includes
// nothing itself.
template <int MR, int NP>
inline void store_tile(const __m512 (&acc)[MR][NP], float* y, int64_t N, int64_t m0, int64_t n0) {
  const bool stream = N >= kStreamColumns;
  for (int q = 0; q < NP; ++q) {
    const int64_t n = n0 + q * kPanel, valid = std::min<int64_t>(kPanel, N - n);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < MR; ++r) {
      float* row = y + (m0 + r) * N + n;
      if (stream && valid == kPanel && (reinterpret_cast<uintptr_t>(row) & 63) == 0) _mm512_stream_ps(row, acc[r][q]);
      else _mm512_mask_storeu_ps(row, mask, acc[r][q]);
    }
  }
}
