// PagedAttention, AVX-512F + BW + BF16 path (chosen at run time when the CPU has all three; see custom_op.cpp): the
// AVX-512 kernel, plus bfloat16 dot products (vdpbf16ps) for the tile path's scores and P·V over bfloat16 pools
// (paged_attention_impl.h, "bfloat16 pools on the tile path"). Decode rows and float32 / int8 pools run as on the
// AVX-512 path.
#if defined(__x86_64__) && defined(__GNUC__)
// Standard and project headers come before the target pragma (see pa_avx512.cpp).
#include <immintrin.h>

#include "paged_attention.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")

namespace omf::avx512bf16 {
#include "avx512_reduce.h"

#include "pa_avx512_vec.h"

struct Vec : Avx512Vec {
  // W pairs of bfloat16 in 32-bit lanes: the element of even index in the low half (vdpbf16ps's operand layout)
  using VB = __m512i;
  static VB load_pairs(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static VB broadcast_pair(const uint16_t* p) {  // p[0], p[1] in every lane
    int32_t pair;
    std::memcpy(&pair, p, 4);
    return _mm512_set1_epi32(pair);
  }
  static VB broadcast_pair(const uint32_t* p) { return _mm512_set1_epi32(static_cast<int32_t>(*p)); }
  static V dot_bf16(V acc, VB a, VB b) {  // lane += a.lo · b.lo + a.hi · b.hi (float32 sums, denormals as 0)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  // out[i] = (bf16(lo[i]), bf16(hi[i])), rounded to nearest even (vcvtne2ps2bf16), for the W lanes
  static void store_pairs(uint32_t* out, V lo, V hi) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // [bf16(lo) × 16, bf16(hi) × 16]
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(interleave, both));
  }
  // out[i] = (a[i], b[i]) for the W elements of two bfloat16 rows (b nullptr: zeros), exact
  static void store_row_pairs(uint32_t* out, const uint16_t* a, const uint16_t* b) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    const __m512i hi = b == nullptr ? _mm512_setzero_si512()
                                    : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    _mm512_storeu_si512(out, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
};

#include "paged_attention_impl.h"

}  // namespace omf::avx512bf16

#pragma GCC pop_options
#endif
