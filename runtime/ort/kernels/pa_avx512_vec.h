// The AVX-512F + BW traits of the PagedAttention kernel (paged_attention_impl.h's `Vec`, described there), shared
// by pa_avx512.cpp and pa_avx512bf16.cpp (which adds bfloat16 dot products to them). Included inside a namespace
// after an AVX-512 target pragma and avx512_reduce.h, so it includes nothing itself.
struct Avx512Vec {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V select_positive(V x, V a, V b) {  // x >= 0 ? a : b, per lane
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
  }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static V reduce_rows(const V* v) {  // 16 vectors -> their 16 sums (reduce16: pairs, 64-bit pairs, quarters)
    __m512i bits[16];
    for (int i = 0; i < 16; ++i) bits[i] = _mm512_castps_si512(v[i]);
    return _mm512_castsi512_ps(reduce16(bits, FloatAdd{}));
  }
  static V round_nearest(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale_pow2(V y, V n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
  static void store_i8(int8_t* out, V x) {  // W integral values within ±127, narrowed
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
  }
  static V load_kv(const float* p) { return _mm512_loadu_ps(p); }
  static V load_kv(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static V load_kv(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  using VI = __m512i;
  static VI izero() { return _mm512_setzero_si512(); }
  using VK = __m512i;  // 2W keys widened to int16
  static VK widen_i8(const int8_t* k) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
  }
  static VI dot_i16_k(VI acc, const int16_t* q, VK k16) {  // vpmaddwd: AVX-512BW
    return _mm512_add_epi32(acc, _mm512_madd_epi16(k16, _mm512_loadu_si512(q)));
  }
  static V reduce_rows_i(const VI* v) {  // reduce_rows in int32 (exact), then float
    return _mm512_cvtepi32_ps(reduce16(v, IntAdd{}));
  }
  static void to_i16(const float* s, float inv, int16_t* out) {  // W probabilities in [0, 32767 / inv]
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(q));
  }
  // rows a, b (2W values each) widened and interleaved: lo holds the pairs (a[d], b[d]) of d in {0-3, 8-11, 16-19,
  // 24-27}, hi those of the other 16 (vpunpck*wd work within 128-bit quarters); add_pairs undoes the order
  static void interleave_pair(const int8_t* a, const int8_t* b, VK& lo, VK& hi) {
    const __m512i wa = widen_i8(a), wb = widen_i8(b);
    lo = _mm512_unpacklo_epi16(wa, wb);
    hi = _mm512_unpackhi_epi16(wa, wb);
  }
  static VI dot_pair(VI acc, VK v, int32_t pp) {  // lane += v.a * p0 + v.b * p1, pp = the int16 pair (p0, p1)
    return _mm512_add_epi32(acc, _mm512_madd_epi16(v, _mm512_set1_epi32(pp)));
  }
  static void add_pairs(float* out, VI lo, VI hi, float scale) {  // out[d] += float(sum of d) * scale, d < 2W
    const __m512i t0 = _mm512_shuffle_i32x4(lo, hi, 0x44), t1 = _mm512_shuffle_i32x4(lo, hi, 0xEE);
    const V s = _mm512_set1_ps(scale);
    const V v0 = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(t0, t0, 0xD8));  // quarters lo0 hi0 lo1 hi1
    const V v1 = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(t1, t1, 0xD8));  // lo2 hi2 lo3 hi3
    _mm512_storeu_ps(out, _mm512_fmadd_ps(v0, s, _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(v1, s, _mm512_loadu_ps(out + 16)));
  }
};
