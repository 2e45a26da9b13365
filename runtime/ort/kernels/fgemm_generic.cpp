// MatMulF32, portable path (the vector path: fgemm_avx512.cpp). The contract:
// MatMulF32: y [M, N] = x [M, K] · Wᵀ with W and x in float32, each output a float32 sum in k order, one fused
// multiply-add per k (acc = fma(x[m, k], W[n, k], acc) from acc = 0) — so every path gives the same bits (the
// ORT CPU lowering of float32 weights where the library's AVX-512 path runs; passes/gemm_pack.py writes the layout).
//
// Layout "panel16-f32" (version kPanelLayout): N padded to 16·P (zero columns);
//   w float32 [P, K, 16]: element [p, k, c] = W[16p + c, k]
// so one 64-byte load is the 16 columns of a panel at one k, the operand of one vfmadd231ps against a broadcast
// activation.
#include <cmath>
#include <cstdint>

#include "qgemm.h"

namespace omf::generic {

void fgemm(const FGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const float* panel = P.w + p * P.K * kPanel;
    for (int c = 0; c < kPanel && p * kPanel + c < P.N; ++c)
      for (int64_t m = 0; m < P.M; ++m) {
        const float* x = P.a + m * P.K;
        float acc = 0.0f;
        for (int64_t k = 0; k < P.K; ++k) acc = std::fma(x[k], panel[k * kPanel + c], acc);
        P.y[m * P.N + p * kPanel + c] = acc;
      }
  }
}

}  // namespace omf::generic
