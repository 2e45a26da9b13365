// MatMulQ on 256-bit vectors, included by qgemm_avx2.cpp twice: OMF_VNNI 1 (AVX-VNNI: vpdpbusd ymm) and 0 (plain
// AVX2: vpmaddubsw + vpmaddwd; 8-bit codes go through their signed form q = c - 128, |q| × sign(a, q), so no
// 16-bit sum saturates, and the zero point's term is then already out). A tile is up to 2 rows × one 16-column
// panel (two ymm halves): the 16 ymm registers hold its codes, broadcasts, products and accumulators.
// Either way the chunk's int32 sum is Σ (c − z)·a, as on every path (started at −z·Σa where the codes are unsigned),
// so the results are the other paths' bit for bit.

namespace {

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int BITS>
inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
#if OMF_VNNI
  return _mm256_dpbusd_avx_epi32(acc, w, a);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones));
  }
#endif
}

template <int BITS, int MR>
void tile(const QGemmProblem& P, int64_t m0, int64_t p) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block, per_block = P.block / kChunk;
  constexpr int64_t chunk_bytes = kPanel * kChunk * BITS / 8;
  constexpr bool kUnsignedCodes = !(BITS == 8 && !OMF_VNNI);  // else dot4 takes the zero point out itself
  const uint8_t* panel = P.codes + p * chunks * chunk_bytes;
  const uint16_t* sp = P.scales + p * kb * kPanel;
  const float* op = P.offsets ? P.offsets + p * kb * kPanel : nullptr;
  constexpr int32_t z = kUnsignedCodes ? 1 << (BITS - 1) : 0;
  const int8_t* a[MR];
  for (int r = 0; r < MR; ++r) a[r] = P.x.a + (m0 + r) * P.Kp;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    const __m256 s[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + b * kPanel))),
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + b * kPanel + 8)))};
    for (int64_t j = b * per_block; j < (b + 1) * per_block; ++j) {
      const uint8_t* c = panel + j * chunk_bytes;
      const int64_t k0 = j * kChunk;
      __m256i dot[MR][2];
      for (int r = 0; r < MR; ++r) dot[r][0] = dot[r][1] = _mm256_set1_epi32(-z * P.x.asum[(m0 + r) * chunks + j]);
      for (int half = 0; half < 2; ++half) {
        if constexpr (BITS == 4) {
          for (int h = 0; h < 4; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + h * 64 + half * 32));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int r = 0; r < MR; ++r) {
              dot[r][half] = dot4<4>(dot[r][half], lo, broadcast4(a[r] + k0 + 8 * h));
              dot[r][half] = dot4<4>(dot[r][half], hi, broadcast4(a[r] + k0 + 8 * h + 4));
            }
          }
        } else {
          for (int g = 0; g < 8; ++g) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + g * 64 + half * 32));
            for (int r = 0; r < MR; ++r) dot[r][half] = dot4<8>(dot[r][half], v, broadcast4(a[r] + k0 + 4 * g));
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 d = _mm256_set1_ps(P.x.d[(m0 + r) * chunks + j]);
        for (int q = 0; q < 2; ++q)
          acc[r][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][q]), _mm256_mul_ps(s[q], d), acc[r][q]);
      }
    }
    if (op)
      for (int q = 0; q < 2; ++q) {
        const __m256 o = _mm256_loadu_ps(op + b * kPanel + 8 * q);
        for (int r = 0; r < MR; ++r)
          acc[r][q] = _mm256_fmadd_ps(o, _mm256_set1_ps(P.x.xsum[(m0 + r) * kb + b]), acc[r][q]);
      }
  }
  const int64_t n0 = p * kPanel, valid = std::min<int64_t>(kPanel, P.N - n0);
  for (int r = 0; r < MR; ++r) {
    float* y = P.y + (m0 + r) * P.N + n0;
    if (valid == kPanel) {
      _mm256_storeu_ps(y, acc[r][0]);
      _mm256_storeu_ps(y + 8, acc[r][1]);
    } else {
      alignas(32) float tmp[kPanel];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(y, tmp, static_cast<size_t>(valid) * sizeof(float));
    }
  }
}

template <int BITS>
void panels(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    int64_t m0 = 0;
    for (; m0 + 2 <= P.M; m0 += 2) tile<BITS, 2>(P, m0, p);
    if (m0 < P.M) tile<BITS, 1>(P, m0, p);
  }
}

}  // namespace

void qgemm(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  if (P.bits == 4) panels<4>(P, panel_begin, panel_end);
  else panels<8>(P, panel_begin, panel_end);
}
