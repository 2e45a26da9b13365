// MoEF32 / MoEBF16 / MoEQ: a mixture-of-experts FFN block, the ORT CPU lowering of the neutral omforge.MoE (passes/
// moe_kernel.py packs the weights). Contract (since ABI 9):
//   inputs   0 x float32 [..., H]   1 router_logits float32 [..., E] (x's leading dims)
//            MoEF32:  2 gate_up float32 [E, 2·Fp/16, H, 16]   3 down float32 [E, ⌈H/16⌉, Fp, 16]   (panel16-f32)
//            MoEBF16: 2 gate_up uint16 or bfloat16 [E, 2·Fp/16, Hp/2, 32]   3 down [E, ⌈H/16⌉, Fp/2, 32]
//                     (panel16-bf16)
//            MoEQ:    2 gate_up_codes uint8 [E, 2·Fp/16, Kp/32, 16·32·bits/8]
//                     3 gate_up_scales float16 [E, 2·Fp/16, kb, 16]
//                     4 down_codes uint8 [E, ⌈H/16⌉, Kp'/32, 16·32·down_bits/8]
//                     5 down_scales float16 [E, ⌈H/16⌉, kb', 16]
//                     6 gate_up_offsets, 7 down_offsets float32, shaped as their scales (optional: affine blocks)
//                     (panel16, qgemm.h; Kp, kb: H in blocks of block_size; Kp', kb': Fp in blocks of down_block_size)
//   outputs  0 y float32, x's shape
//   attrs    hidden_size H, inter_size F, top_k (1 … E), normalize (0 or 1), layout (kPanelLayout);
//            MoEQ also bits, block_size (gate_up's) and down_bits, down_block_size (default: gate_up's)
// Fp is F rounded up to a multiple of 16 and Hp is H rounded up to even. Expert e's gate_up matrix is W1_e [2·Fp, H]
// (one row per output column) with gate and up interleaved by panel: panel 2q holds gate columns 16q … 16q + 15,
// panel 2q + 1 the same up columns (columns past F zero), so each pair of panels gives whole SwiGLU outputs; its down
// matrix is W2_e [H, Fp] (columns past F zero).
// Semantics (omforge.MoE): per token t, p = softmax(router_logits[t]) in float32; the top_k experts by p, ties to the
// lower index; w = their p (normalize: divided by their float32 sum); y[t] = Σ_j w_j · W2_e(silu(g) · u) with
// (g, u) = W1_e x[t], in the top-k order. Each product is the precision's weight MatMul op's (MatMulF32;
// MatMulBF16: activations rounded to bfloat16; MatMulQ: int8 activations per 32 k), run by its ISA path (MoEF32's
// with an AVX2 path of its own: moe_f32_path).
// Work: tokens grouped by expert (rows of one expert contiguous, by token); per active expert the gate_up GEMM over
// its rows only, pairs of panels per work item with SwiGLU on the item's columns, then the down GEMM the same way,
// then each token's weighted sum of its k rows; every pass over ORT's intra-op threads. At most kMoERows (token,
// expert) rows a round: a long prefill runs in rounds, its scratch bounded.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ort_abi.h"

namespace omf {

enum class MoEWeights { kF32, kBF16, kQ };

struct MoEAttrs {
  MoEWeights weights = MoEWeights::kF32;
  int64_t H = 0, F = 0, top_k = 0, normalize = 0;
  int64_t bits = 0, block = 0, down_bits = 0, down_block = 0;  // MoEQ
};

// (token, expert) rows per round: the scratch of a round is ~R·(3·Fp + 2·H)·4 bytes in float32 (G, SwiGLU, gathered
// x, down products), ~100 MB at Qwen3-30B-A3B's shape (fewer in bfloat16 and int8), held per calling thread
constexpr int64_t kMoERows = 4096;

// the op's name, inputs, their element types (kUndefined: any, checked at run time) and which are optional
const char* moe_op_name(MoEWeights w);
size_t moe_input_count(MoEWeights w);
int moe_input_type(MoEWeights w, size_t i);
bool moe_input_optional(MoEWeights w, size_t i);

struct FGemmProblem;
namespace moe_avx2 {
void fgemm(const FGemmProblem&, int64_t panel_begin, int64_t panel_end);  // moe_avx2.cpp
}  // namespace moe_avx2
// MoEF32's GEMM path: MatMulF32's AVX-512F one, else AVX2 + FMA (moe_avx2.cpp), else the portable one (MatMulF32's
// table and an AVX2 row for every OMFORGE_KERNELS_ISA value but generic)
const char* moe_f32_path();

OrtStatus* read_moe_attrs(const ort::Api& api, const OrtKernelInfo* info, MoEWeights w, MoEAttrs& attrs);
OrtStatus* compute_moe(const ort::Api& api, const MoEAttrs& attrs, OrtKernelContext* ctx);

}  // namespace omf
