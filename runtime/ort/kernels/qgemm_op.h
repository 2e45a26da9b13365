// The MatMulQ op's ORT side (qgemm_op.cpp): attributes read at kernel creation, one call per run.
//   inputs   0 x [..., K] float32   1 codes uint8 [P, Kp/32, 16·32·bits/8]   2 scales float16 [P, kb, 16]
//            3 offsets float32 [P, kb, 16] (optional: absent for symmetric blocks)
//   outputs  0 y [..., N] float32
//   attrs    K, N, bits (4 or 8), block_size (32, 64 or 128), layout (must be kPanelLayout)
// MatMulBF16: inputs 0 x [..., K] float32, 1 codes uint16 [P, Kp/2, 32] (bgemm_generic.cpp); output y [..., N] float32;
//   attrs K, N, layout (must be kPanelLayout)
// MatMulF32: inputs 0 x [..., K] float32, 1 w float32 [P, K, 16] (fgemm_generic.cpp); output y [..., N] float32;
//   attrs K, N, layout (must be kPanelLayout)
// MatMulQBF16: MatMulQ's inputs, outputs and attributes (the same panel16 weights), activations in bfloat16 instead of
//   int8 (qgemm.h, QBGemmProblem)
#pragma once
#include <cstdint>

#include "ort_abi.h"
#include "qgemm.h"

namespace omf {

struct MatMulQAttrs {
  int64_t K = 0, N = 0, bits = 0, block = 0, layout = 0;
};

struct GemmIsa {
  const char* name;
  QGemmFn qgemm;
  QuantizeFn quantize;
};

struct Bf16Isa {
  const char* name;
  BGemmFn bgemm;
  ToBf16Fn to_bf16;
  QBGemmFn qbgemm;
  int64_t m_align = 1, k_align = 2;  // the activations' rows and row stride are padded (with zeros) to multiples
};

struct F32Isa {
  const char* name;
  FGemmFn fgemm;
};

const GemmIsa& gemm_isa();
const F32Isa& f32_isa();
OrtStatus* read_matmul_f32_attrs(const ort::Api& api, const OrtKernelInfo* info, MatMulQAttrs& attrs);
OrtStatus* compute_matmul_f32(const ort::Api& api, const MatMulQAttrs& attrs, OrtKernelContext* ctx);
const Bf16Isa& bf16_isa();
OrtStatus* read_matmul_bf16_attrs(const ort::Api& api, const OrtKernelInfo* info, MatMulQAttrs& attrs);
OrtStatus* compute_matmul_bf16(const ort::Api& api, const MatMulQAttrs& attrs, OrtKernelContext* ctx);
// MatMulQ's and MatMulQBF16's (`op`: the name their errors start with)
OrtStatus* read_matmul_q_attrs(const ort::Api& api, const OrtKernelInfo* info, const char* op, MatMulQAttrs& attrs);
OrtStatus* compute_matmul_q(const ort::Api& api, const MatMulQAttrs& attrs, OrtKernelContext* ctx);
OrtStatus* compute_matmul_qbf16(const ort::Api& api, const MatMulQAttrs& attrs, OrtKernelContext* ctx);

}  // namespace omf
