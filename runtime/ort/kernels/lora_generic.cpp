// LoraAdd, portable path: GCC/Clang vector extensions (4 lanes), any architecture. The tiles: lora_impl.h.
#include <algorithm>
#include <cstring>

#include "lora.h"

namespace omf::generic {
namespace {

struct Vec {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int W = 4, kDotRows = 2, kRows = 2, kVecs = 2;
  static V zero() { return V{0, 0, 0, 0}; }
  static V set1(float x) { return V{x, x, x, x}; }
  static V load(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static V load_partial(const float* p, int64_t n) { V v = zero(); std::memcpy(&v, p, n * sizeof(float)); return v; }
  static void store_partial(float* p, V v, int64_t n) { std::memcpy(p, &v, n * sizeof(float)); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V reduce_rows(const V* v) {
    return V{(v[0][0] + v[0][1]) + (v[0][2] + v[0][3]), (v[1][0] + v[1][1]) + (v[1][2] + v[1][3]),
             (v[2][0] + v[2][1]) + (v[2][2] + v[2][3]), (v[3][0] + v[3][1]) + (v[3][2] + v[3][3])};
  }
};

#include "lora_impl.h"

}  // namespace

void lora_shrink(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count) { shrink(P, g, begin, count); }
void lora_expand(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count, int64_t o0, int64_t o1) {
  expand(P, g, begin, count, o0, o1);
}

}  // namespace omf::generic
