// LoraAdd: the multi-LoRA term of one projection (docs/lora.md), the ORT CPU lowering of the neutral op
// omforge.LoraAdd. Contract (ABI 6):
//   inputs   0 y float32 [..., T, out] (the projection's output; leading dims all 1)
//            1 x float32 [..., T, in]  (the projection's input; leading dims all 1)
//            2 lora_a float32 [S, PR, in]   3 lora_b float32 [S, out, PR]   4 lora_slots int64 [1, T] or [T]
//   outputs  0 y' float32, y's shape: y'[t] = y[t] + lora_b[s_t] · (lora_a[s_t] · x[t])
//   attrs    none
// Slot 0 is the base model (its pool rows are zeros by contract): its tokens are copied through bit for bit, with
// no arithmetic. A slot outside [0, S) or mismatched shapes fail the run with one line naming the input.
// Tokens are grouped by slot (Punica's SGMV): per slot present, H = X_s · A_sᵀ [n_s, PR] ("shrink"), then
// Y_s += H · B_sᵀ ("expand"); each sum is float32, its order the ISA path's (lora_impl.h).
#pragma once
#include <cstdint>

#include "ort_abi.h"

namespace omf {

struct LoraProblem {
  const float *y, *x, *a, *b;  // the inputs (a: [S, PR, in], b: [S, out, PR])
  float* out;                  // y'
  int64_t in, out_dim, pr;
  const int32_t* order;  // the step's tokens grouped by slot (ascending), stable within a slot
  float* h;              // [T, PR]: row i is H of token order[i]
};

// the tokens order[begin, begin + count) of one slot; bt: B_s transposed [PR, ldbt] (zero columns past out) for
// the expand's row tiles, or nullptr: the expand reads B_s as it is (few tokens: transposing would cost more)
struct LoraGroup {
  int64_t slot, begin, count;
  float* bt;
  int64_t ldbt;
};

// H rows of order[begin, begin + count) (within g)
using LoraShrinkFn = void (*)(const LoraProblem&, const LoraGroup& g, int64_t begin, int64_t count);
// y' columns [o0, o1) of the rows order[begin, begin + count) (within g): y + H · B_sᵀ
using LoraExpandFn = void (*)(const LoraProblem&, const LoraGroup& g, int64_t begin, int64_t count, int64_t o0,
                              int64_t o1);

struct LoraIsa {
  const char* name;
  LoraShrinkFn shrink;
  LoraExpandFn expand;
};

namespace avx512 {
void lora_shrink(const LoraProblem&, const LoraGroup&, int64_t, int64_t);
void lora_expand(const LoraProblem&, const LoraGroup&, int64_t, int64_t, int64_t, int64_t);
}  // namespace avx512
namespace avx2 {
void lora_shrink(const LoraProblem&, const LoraGroup&, int64_t, int64_t);
void lora_expand(const LoraProblem&, const LoraGroup&, int64_t, int64_t, int64_t, int64_t);
}  // namespace avx2
namespace generic {
void lora_shrink(const LoraProblem&, const LoraGroup&, int64_t, int64_t);
void lora_expand(const LoraProblem&, const LoraGroup&, int64_t, int64_t, int64_t, int64_t);
}  // namespace generic

// the path chosen once per process (AVX-512F, AVX2 + FMA, portable; OMFORGE_KERNELS_ISA forces a slower one)
const LoraIsa& lora_isa();
OrtStatus* compute_lora_add(const ort::Api& api, OrtKernelContext* ctx);

}  // namespace omf
