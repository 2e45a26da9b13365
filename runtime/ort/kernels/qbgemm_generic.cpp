// MatMulQBF16, portable path (the vector path: qbgemm_avx512.cpp; the contract: qgemm.h, QBGemmProblem): per pair of
// panels, the codes decompressed to bfloat16 one weight at a time, then MatMulBF16's portable tile loop.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "qgemm.h"

namespace omf::generic {

// panel p of the problem into out [Kp/2, 32] (panel16-bf16): out[i, 2c + e] = bf16(fma(c − z, s, m)) at k = 2i + e
// (the AVX2 path decompresses with it too)
void decompress_panel(const QBGemmProblem& P, int64_t p, uint16_t* out) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block, chunk_bytes = kPanel * kChunk * P.bits / 8;
  const uint8_t* panel = P.codes + p * chunks * chunk_bytes;
  const uint16_t* sp = P.scales + p * kb * kPanel;
  const float* op = P.offsets ? P.offsets + p * kb * kPanel : nullptr;
  const int z = 1 << (P.bits - 1);
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t b = j * kChunk / P.block;
    for (int c = 0; c < kPanel; ++c) {
      const float s = half_to_float(sp[b * kPanel + c]), m = op ? op[b * kPanel + c] : 0.0f;
      for (int t = 0; t < kChunk; ++t) {
        const int64_t k = j * kChunk + t;
        const float w = std::fma(static_cast<float>(code_at(panel + j * chunk_bytes, P.bits, c, t) - z), s, m);
        out[(k / 2) * 32 + 2 * c + k % 2] = bf16_round(w);
      }
    }
  }
}

void qbgemm(const QBGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  qbgemm_pairs(P, panel_begin, panel_end, [&P](int64_t p, uint16_t* out) { decompress_panel(P, p, out); },
               [](const Bf16Panels& T, int n) { bf16_panels(T, n); });
}

}  // namespace omf::generic
