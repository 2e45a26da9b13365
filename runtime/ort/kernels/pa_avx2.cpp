// PagedAttention, AVX2 + FMA path (chosen at run time when the CPU has it but not AVX-512F).
#if defined(__x86_64__) && defined(__GNUC__)
// Standard and project headers come before the target pragma: template code they define (std::vector, ...)
// is then compiled for the baseline ISA, so no AVX instruction can leak into code shared with other paths.
#include <immintrin.h>

#include "paged_attention.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace omf::avx2 {

struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V select_positive(V x, V a, V b) {  // x >= 0 ? a : b, per lane
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V reduce_rows(const V* v) {  // 8 vectors -> their 8 sums
    const V u0 = _mm256_hadd_ps(v[0], v[1]), u1 = _mm256_hadd_ps(v[2], v[3]);
    const V u2 = _mm256_hadd_ps(v[4], v[5]), u3 = _mm256_hadd_ps(v[6], v[7]);
    const V w0 = _mm256_hadd_ps(u0, u1), w1 = _mm256_hadd_ps(u2, u3);
    return _mm256_add_ps(_mm256_permute2f128_ps(w0, w1, 0x20), _mm256_permute2f128_ps(w0, w1, 0x31));
  }
  static V round_nearest(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale_pow2(V y, V n) {  // y * 2^n, 2^n built in the exponent bits (n >= -126 where it is used)
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  static void store_i8(int8_t* out, V x) {  // W integral values within ±127, narrowed
    const __m256i q = _mm256_cvtps_epi32(x);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
  }
  static V load_kv(const float* p) { return _mm256_loadu_ps(p); }
  static V load_kv(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static V load_kv(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  using VI = __m256i;
  static VI izero() { return _mm256_setzero_si256(); }
  using VK = __m256i;  // 2W keys widened to int16
  static VK widen_i8(const int8_t* k) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
  }
  static VI dot_i16_k(VI acc, const int16_t* q, VK k16) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(k16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))));
  }
  static V reduce_rows_i(const VI* v) {  // 8 vectors -> their 8 exact sums, as float
    const VI u0 = _mm256_hadd_epi32(v[0], v[1]), u1 = _mm256_hadd_epi32(v[2], v[3]);
    const VI u2 = _mm256_hadd_epi32(v[4], v[5]), u3 = _mm256_hadd_epi32(v[6], v[7]);
    const VI w0 = _mm256_hadd_epi32(u0, u1), w1 = _mm256_hadd_epi32(u2, u3);
    return _mm256_cvtepi32_ps(
        _mm256_add_epi32(_mm256_permute2x128_si256(w0, w1, 0x20), _mm256_permute2x128_si256(w0, w1, 0x31)));
  }
  static void to_i16(const float* s, float inv, int16_t* out) {  // W probabilities in [0, 32767 / inv]
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(s), _mm256_set1_ps(inv)));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), w);
  }
  // rows a, b (2W values each) widened and interleaved: lo holds the pairs (a[d], b[d]) of d in {0-3, 8-11}, hi
  // those of {4-7, 12-15} (vpunpck*wd work within 128-bit halves); add_pairs undoes the order
  static void interleave_pair(const int8_t* a, const int8_t* b, VK& lo, VK& hi) {
    const __m256i wa = widen_i8(a), wb = widen_i8(b);
    lo = _mm256_unpacklo_epi16(wa, wb);
    hi = _mm256_unpackhi_epi16(wa, wb);
  }
  static VI dot_pair(VI acc, VK v, int32_t pp) {  // lane += v.a * p0 + v.b * p1, pp = the int16 pair (p0, p1)
    return _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi32(pp)));
  }
  static void add_pairs(float* out, VI lo, VI hi, float scale) {  // out[d] += float(sum of d) * scale, d < 2W
    const V s = _mm256_set1_ps(scale);
    const V v0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
    const V v1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(v0, s, _mm256_loadu_ps(out)));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(v1, s, _mm256_loadu_ps(out + 8)));
  }
};

#include "paged_attention_impl.h"

}  // namespace omf::avx2

#pragma GCC pop_options
#endif
