// MatMulBF16, portable path (the vector path: bgemm_avx512.cpp). The contract:
// MatMulBF16: y [M, N] = x [M, K] · Wᵀ with W in bfloat16 and x rounded to bfloat16 once per call, products summed
// in float32 (the ORT CPU lowering of compile.weights: bfloat16; passes/gemm_pack.py writes the layout).
//
// Layout "panel16-bf16" (version kPanelLayout): N padded to 16·P (zero columns), K to an even Kp (zero);
//   codes uint16 or bfloat16 (the same bits; ABI 7) [P, Kp/2, 32]: element [p, i, 2c + e] = bf16(W[16p + c, 2i + e])
// so one 64-byte load is 16 float32 lanes of one k pair, the operand of one vdpbf16ps against a broadcast pair of a
// row's activations. Paths: AVX-512 BF16 (a tile of up to 8 rows × 2 panels, 16 float accumulators) and portable
// (the same two products per pair, added high element first as vdpbf16ps does; not bit-identical: the instruction
// flushes denormals).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "qgemm.h"

namespace omf {

namespace generic {

void to_bf16_rows(const float* x, int64_t K, int64_t Kp, uint16_t* out, int64_t row_begin, int64_t row_end) {
  for (int64_t m = row_begin; m < row_end; ++m) {
    for (int64_t k = 0; k < K; ++k) out[m * Kp + k] = bf16_round(x[m * K + k]);
    for (int64_t k = K; k < Kp; ++k) out[m * Kp + k] = 0;
  }
}

// Not auto-vectorized: GCC 12's -O3 vectorization of this loop nest gave wrong sums (exact small integers off by
// one; right at -O2 and with -fno-tree-vectorize). This is the fallback path; its speed does not matter.
__attribute__((optimize("no-tree-vectorize")))
void bf16_panels(const Bf16Panels& T, int panels) {
  const int64_t pairs = T.Kp / 2;
  for (int q = 0; q < panels; ++q) {
    const uint16_t* panel = T.w + q * pairs * 32;
    for (int c = 0; c < kPanel; ++c) {
      const int64_t n = T.n0 + q * kPanel + c;
      if (n >= T.N) break;
      for (int64_t m = 0; m < T.M; ++m) {
        const uint16_t* a = T.a + m * T.lda;
        float acc = 0.0f;
        for (int64_t i = 0; i < pairs; ++i) {
          acc += bf16_to_float(a[2 * i + 1]) * bf16_to_float(panel[i * 32 + 2 * c + 1]);
          acc += bf16_to_float(a[2 * i]) * bf16_to_float(panel[i * 32 + 2 * c]);
        }
        T.y[m * T.N + n] = acc;
      }
    }
  }
}

void bgemm(const BGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = P.Kp / 2 * 32;
  for (int64_t p = panel_begin; p < panel_end; ++p)
    bf16_panels({P.a, P.codes + p * panel_elems, P.y, P.M, P.N, P.Kp, p * kPanel, P.lda}, 1);
}

}  // namespace generic
}  // namespace omf

