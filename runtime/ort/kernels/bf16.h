// bfloat16 ⇄ float32, scalar: the one rounding every op of the library uses (KV pool writes, MatMulBF16's weights
// and activation tails) — round to nearest even, NaN stays NaN — and the exact widening.
#pragma once
#include <cstdint>
#include <cstring>

namespace omf {

inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace omf
