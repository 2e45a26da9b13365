// PagedAttention, portable path: GCC/Clang vector extensions (4 lanes), any architecture.
#include <cmath>
#include <cstring>

#include "paged_attention.h"

namespace omf::generic {

struct Vec {
  typedef float V __attribute__((vector_size(16)));
  static constexpr int W = 4;
  static V zero() { return V{0, 0, 0, 0}; }
  static V set1(float x) { return V{x, x, x, x}; }
  static V load(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V div(V a, V b) { return a / b; }
  static V select_positive(V x, V a, V b) {
    return V{x[0] >= 0 ? a[0] : b[0], x[1] >= 0 ? a[1] : b[1], x[2] >= 0 ? a[2] : b[2], x[3] >= 0 ? a[3] : b[3]};
  }
  static V mul(V a, V b) { return a * b; }
  static V min(V a, V b) { return V{std::fmin(a[0], b[0]), std::fmin(a[1], b[1]), std::fmin(a[2], b[2]), std::fmin(a[3], b[3])}; }
  static V max(V a, V b) { return V{std::fmax(a[0], b[0]), std::fmax(a[1], b[1]), std::fmax(a[2], b[2]), std::fmax(a[3], b[3])}; }
  static float hsum(V v) { return (v[0] + v[1]) + (v[2] + v[3]); }
  static float hmax(V v) { return std::fmax(std::fmax(v[0], v[1]), std::fmax(v[2], v[3])); }
  static V reduce_rows(const V* v) { return V{hsum(v[0]), hsum(v[1]), hsum(v[2]), hsum(v[3])}; }
  static V round_nearest(V x) {
    return V{std::nearbyint(x[0]), std::nearbyint(x[1]), std::nearbyint(x[2]), std::nearbyint(x[3])};
  }
  static V scale_pow2(V y, V n) {
    return V{std::ldexp(y[0], int(n[0])), std::ldexp(y[1], int(n[1])), std::ldexp(y[2], int(n[2])),
             std::ldexp(y[3], int(n[3]))};
  }
  static void store_i8(int8_t* out, V x) {  // W integral values within ±127, narrowed
    for (int i = 0; i < W; ++i) out[i] = static_cast<int8_t>(x[i]);
  }
  static V load_kv(const float* p) { return load(p); }
  static V load_kv(const uint16_t* p) {
    return V{kv_to_float(p[0]), kv_to_float(p[1]), kv_to_float(p[2]), kv_to_float(p[3])};
  }
  static V load_kv(const int8_t* p) { return V{float(p[0]), float(p[1]), float(p[2]), float(p[3])}; }
  typedef int32_t VI __attribute__((vector_size(16)));
  static VI izero() { return VI{0, 0, 0, 0}; }
  struct VK {  // 2W keys widened to int16
    int16_t k[2 * W];
  };
  static VK widen_i8(const int8_t* k) {
    VK w;
    for (int i = 0; i < 2 * W; ++i) w.k[i] = k[i];
    return w;
  }
  static VI dot_i16_k(VI acc, const int16_t* q, const VK& k) {
    for (int i = 0; i < W; ++i) acc[i] += int32_t{q[2 * i]} * k.k[2 * i] + int32_t{q[2 * i + 1]} * k.k[2 * i + 1];
    return acc;
  }
  static V reduce_rows_i(const VI* v) {
    V out;
    for (int i = 0; i < W; ++i) out[i] = static_cast<float>((v[i][0] + v[i][1]) + (v[i][2] + v[i][3]));
    return out;
  }
  static void to_i16(const float* s, float inv, int16_t* out) {  // W probabilities in [0, 32767 / inv]
    for (int i = 0; i < W; ++i) out[i] = static_cast<int16_t>(std::nearbyint(s[i] * inv));
  }
  // rows a, b (2W values each) widened and interleaved: lo holds the pairs (a[d], b[d]) of d < W, hi of the rest
  static void interleave_pair(const int8_t* a, const int8_t* b, VK& lo, VK& hi) {
    for (int i = 0; i < W; ++i) {
      lo.k[2 * i] = a[i], lo.k[2 * i + 1] = b[i];
      hi.k[2 * i] = a[W + i], hi.k[2 * i + 1] = b[W + i];
    }
  }
  static VI dot_pair(VI acc, const VK& v, int32_t pp) {  // lane += v.a * p0 + v.b * p1, pp = the int16 pair (p0, p1)
    int16_t p[2];
    std::memcpy(p, &pp, sizeof p);
    for (int i = 0; i < W; ++i) acc[i] += int32_t{v.k[2 * i]} * p[0] + int32_t{v.k[2 * i + 1]} * p[1];
    return acc;
  }
  static void add_pairs(float* out, VI lo, VI hi, float scale) {  // out[d] += float(sum of d) * scale, d < 2W
    for (int i = 0; i < W; ++i) {
      out[i] = std::fma(static_cast<float>(lo[i]), scale, out[i]);
      out[W + i] = std::fma(static_cast<float>(hi[i]), scale, out[W + i]);
    }
  }
};

#include "paged_attention_impl.h"

}  // namespace omf::generic
