// LoraAdd, AVX2 + FMA path (chosen at run time when the CPU has it but not AVX-512F). The tiles: lora_impl.h.
#if defined(__x86_64__) && defined(__GNUC__)
// Standard and project headers come before the target pragma (see pa_avx512.cpp).
#include <immintrin.h>

#include <algorithm>

#include "lora.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace omf::avx2 {
namespace {

alignas(32) constexpr int32_t kLanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

struct Vec {
  using V = __m256;
  static constexpr int W = 8, kDotRows = 2, kRows = 4, kVecs = 2;  // 8 accumulators of 16 registers either tile
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256i first(int64_t n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLanes + 8 - n)); }
  static V load_partial(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
  static void store_partial(float* p, V v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V reduce_rows(const V* v) {  // 8 vectors -> their 8 sums: pairwise hadds, then the 128-bit halves
    const V u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const V u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};

#include "lora_impl.h"

}  // namespace

void lora_shrink(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count) { shrink(P, g, begin, count); }
void lora_expand(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count, int64_t o0, int64_t o1) {
  expand(P, g, begin, count, o0, o1);
}

}  // namespace omf::avx2

#pragma GCC pop_options
#endif
