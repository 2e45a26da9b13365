// reduce16: 16 AVX-512 vectors → one whose lane c is `op` over the 16 lanes of v[c] (pairs, 64-bit pairs, then
// 128-bit quarters; op associative and commutative, and exact where callers need one answer on every path: an
// integer sum, a float max). Included inside a namespace after an AVX-512 target pragma (qgemm_avx512.cpp,
// pa_avx512.cpp), so it includes nothing itself.
template <typename Op>
inline __m512i reduce16(const __m512i* v, Op op) {
  __m512i u[8], w[4];
  for (int k = 0; k < 8; ++k)
    u[k] = op(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    w[k] = op(_mm512_unpacklo_epi64(u[2 * k], u[2 * k + 1]), _mm512_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
  const __m512i s0 = op(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));
  const __m512i s1 = op(_mm512_shuffle_i32x4(w[2], w[3], 0x88), _mm512_shuffle_i32x4(w[2], w[3], 0xDD));
  return op(_mm512_shuffle_i32x4(s0, s1, 0x88), _mm512_shuffle_i32x4(s0, s1, 0xDD));
}

// the ops, on float lanes carried in integer vectors where they are floats (the shuffles move bits either way)
struct IntAdd {
  __m512i operator()(__m512i a, __m512i b) const { return _mm512_add_epi32(a, b); }
};
struct FloatAdd {
  __m512i operator()(__m512i a, __m512i b) const {
    return _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
  }
};
struct FloatMax {
  __m512i operator()(__m512i a, __m512i b) const {
    return _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b)));
  }
};
