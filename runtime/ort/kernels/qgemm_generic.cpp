// MatMulQ, portable path (any architecture): the same integer products and float order of operations per
// chunk as the vector paths, one column at a time. See qgemm.h for the layout and the formula.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "qgemm.h"

namespace omf::generic {

void quantize_rows(const float* x, int64_t K, int64_t Kp, int64_t block, bool want_xsum, const QuantizedRows& q,
                   int64_t row_begin, int64_t row_end) {
  const int64_t chunks = Kp / kChunk, kb = Kp / block;
  for (int64_t m = row_begin; m < row_end; ++m) {
    const float* xr = x + m * K;
    int8_t* ar = q.a + m * Kp;
    for (int64_t j = 0; j < chunks; ++j) {
      float amax = 0.0f;
      const int64_t k0 = j * kChunk, n = std::max<int64_t>(0, std::min<int64_t>(kChunk, K - k0));
      for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(xr[k0 + k]));
      const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t k = 0; k < kChunk; ++k) {
        const float v = k < n ? std::nearbyint(xr[k0 + k] * inv) : 0.0f;
        ar[k0 + k] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, v)));
        sum += ar[k0 + k];
      }
      record_chunk(q, m, chunks, j, d, sum);
    }
    if (want_xsum) block_sums(xr, K, block, kb, q.xsum + m * kb);
  }
}

void qgemm(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block, per_block = P.block / kChunk;
  const int64_t chunk_bytes = kPanel * kChunk * P.bits / 8;
  const int32_t z = 1 << (P.bits - 1);
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const uint8_t* panel = P.codes + p * chunks * chunk_bytes;
    const uint16_t* sp = P.scales + p * kb * kPanel;
    const float* op = P.offsets ? P.offsets + p * kb * kPanel : nullptr;
    for (int i = 0; i < kPanel; ++i) {
      const int64_t n = p * kPanel + i;
      if (n >= P.N) break;
      for (int64_t m = 0; m < P.M; ++m) {
        const int8_t* ar = P.x.a + m * P.Kp;
        float acc = 0.0f;
        for (int64_t b = 0; b < kb; ++b) {
          const float s = half_to_float(sp[b * kPanel + i]);
          for (int64_t j = b * per_block; j < (b + 1) * per_block; ++j) {
            const uint8_t* chunk = panel + j * chunk_bytes;
            int32_t dot = -z * P.x.asum[m * chunks + j];
            for (int t = 0; t < kChunk; ++t) dot += code_at(chunk, P.bits, i, t) * ar[j * kChunk + t];
            acc = std::fma(static_cast<float>(dot), s * P.x.d[m * chunks + j], acc);
          }
          if (op) acc = std::fma(op[b * kPanel + i], P.x.xsum[m * kb + b], acc);
        }
        P.y[m * P.N + n] = acc;
      }
    }
  }
}

}  // namespace omf::generic
