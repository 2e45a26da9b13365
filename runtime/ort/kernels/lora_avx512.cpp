// LoraAdd, AVX-512F path (chosen at run time when the CPU has it; see lora_op.cpp). The tiles: lora_impl.h.
#if defined(__x86_64__) && defined(__GNUC__)
// Standard and project headers come before the target pragma (see pa_avx512.cpp).
#include <immintrin.h>

#include <algorithm>

#include "lora.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")

namespace omf::avx512 {
namespace {
#include "avx512_reduce.h"

struct Vec {
  using V = __m512;
  static constexpr int W = 16, kDotRows = 4, kRows = 4, kVecs = 4;  // 16 accumulators of 32 registers either tile
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V load_partial(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static void store_partial(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V reduce_rows(const V* v) {  // 16 vectors -> their 16 sums (reduce16: pairs, 64-bit pairs, quarters)
    __m512i bits[16];
    for (int i = 0; i < 16; ++i) bits[i] = _mm512_castps_si512(v[i]);
    return _mm512_castsi512_ps(reduce16(bits, FloatAdd{}));
  }
};

#include "lora_impl.h"

}  // namespace

void lora_shrink(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count) { shrink(P, g, begin, count); }
void lora_expand(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count, int64_t o0, int64_t o1) {
  expand(P, g, begin, count, o0, o1);
}

}  // namespace omf::avx512

#pragma GCC pop_options
#endif
