// MatMulQ's ORT side: shapes checked, activations quantized once per call (rows spread over ORT's threads when
// there are many), then the weight's column panels spread over ORT's threads. MatMulQBF16 and MatMulBF16 the same
// way, activations rounded to bfloat16 instead; MatMulF32 reads its activations as they are. See qgemm.h and qgemm_op.h.
#include "qgemm_op.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "ort_tensor.h"

namespace omf {
namespace {

OrtStatus* fail(const ort::Api& api, const char* op, const std::string& msg) {
  return api.CreateStatus(kOrtInvalidArgument, (std::string(op) + ": " + msg).c_str());
}

// the attributes both weight GEMMs have: K, N and the layout version of their packed weights
OrtStatus* read_shape_attrs(const ort::Api& api, const OrtKernelInfo* info, const char* op, MatMulQAttrs& a) {
  OrtStatus* s = api.KernelInfoGetAttribute_int64(info, "K", &a.K);
  if (!s) s = api.KernelInfoGetAttribute_int64(info, "N", &a.N);
  if (!s) s = api.KernelInfoGetAttribute_int64(info, "layout", &a.layout);
  if (s) return s;
  if (a.layout != kPanelLayout)
    return fail(api, op, "weight layout version " + std::to_string(a.layout) + " is not known to this kernel "
                "library (it reads version " + std::to_string(kPanelLayout) + "); recompile the bundle");
  if (a.K <= 0 || a.N <= 0) return fail(api, op, "K and N must be positive");
  return nullptr;
}

// The panels input of a float weight GEMM (MatMulBF16, MatMulF32): its name, element type and layout, for the errors
struct PanelInput {
  const char* name;
  int type;
  const char* type_name;
  const char* layout;
  int same_bits_type = -1;  // another element type of the same bits accepted (MatMulBF16: bfloat16 beside uint16)
};

// x float32 [..., K] and the panels (`w`, of shape `dims`) read into in[0], in[1] and checked; y made
OrtStatus* float_weight_inputs(const ort::Api& api, OrtKernelContext* ctx, const char* op, const MatMulQAttrs& A,
                               const PanelInput& w, const std::vector<int64_t>& dims, Tensor* in, void** y) {
  bool have[2] = {false, false};
  if (OrtStatus* s = read_inputs(api, ctx, 2, in, have)) return s;
  if (!have[0] || !have[1]) return fail(api, op, std::string("x and ") + w.name + " are required");
  if (in[0].type != kFloat || in[0].dims.empty() || in[0].dims.back() != A.K)
    return fail(api, op, "x must be float32 [..., " + std::to_string(A.K) + "]");
  if ((in[1].type != w.type && in[1].type != w.same_bits_type) || in[1].dims != dims) {
    std::string shape;
    for (size_t i = 0; i < dims.size(); ++i) shape += (i ? ", " : "") + std::to_string(dims[i]);
    return fail(api, op, std::string(w.name) + " must be " + w.type_name + " [" + shape + "] (the " + w.layout +
                " layout)");
  }
  return last_dim_output(api, ctx, 0, in[0], A.N, y);
}

int64_t rows_per_item(int64_t K) { return std::max<int64_t>(1, 16384 / K); }  // ~64 KB of activations per item

struct QuantizeRun {
  const float* x;
  int64_t K, Kp, block, rows, rows_per_item;
  bool want_xsum;
  QuantizedRows q;
};

void quantize_item(void* data, size_t i) {
  const QuantizeRun* r = static_cast<const QuantizeRun*>(data);
  const int64_t first = static_cast<int64_t>(i) * r->rows_per_item;
  gemm_isa().quantize(r->x, r->K, r->Kp, r->block, r->want_xsum, r->q, first,
                      std::min(r->rows, first + r->rows_per_item));
}

constexpr int64_t kPanelsPerItem = 2;  // a pair: the vector path's two-panel tiles

// work item i of a GEMM over column panels: the i-th pair of panels (the last may be a single one), through `gemm`
template <typename Problem>
void run_pair(const Problem& P, size_t i, void (*gemm)(const Problem&, int64_t, int64_t)) {
  const int64_t first = static_cast<int64_t>(i) * kPanelsPerItem;
  gemm(P, first, std::min(panels_of(P.N), first + kPanelsPerItem));
}

void gemm_item(void* data, size_t i) {
  run_pair(*static_cast<const QGemmProblem*>(data), i, gemm_isa().qgemm);
}

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// this calling thread's scratch for M rows of bfloat16 activations with row stride lda (kept between calls): the rows
// past M up to the path's m_align are zero (to_bf16 writes the zeros past K itself)
uint16_t* bf16_rows(int64_t M, int64_t lda) {
  thread_local std::vector<uint16_t> xa;
  const int64_t Mp = round_up(M, bf16_isa().m_align);
  xa.resize(static_cast<size_t>(Mp * lda));
  std::memset(xa.data() + M * lda, 0, static_cast<size_t>((Mp - M) * lda) * sizeof(uint16_t));
  return xa.data();
}

struct Bf16Run {
  const float* x;
  BGemmProblem prob;
  int64_t rows_per_item;
};

void to_bf16_item(void* data, size_t i) {
  const Bf16Run* r = static_cast<const Bf16Run*>(data);
  const int64_t first = static_cast<int64_t>(i) * r->rows_per_item;
  bf16_isa().to_bf16(r->x, r->prob.K, r->prob.lda, const_cast<uint16_t*>(r->prob.a), first,
                     std::min(r->prob.M, first + r->rows_per_item));
}

void bgemm_item(void* data, size_t i) {
  run_pair(*static_cast<const BGemmProblem*>(data), i, bf16_isa().bgemm);
}

void fgemm_item(void* data, size_t i) {
  run_pair(*static_cast<const FGemmProblem*>(data), i, f32_isa().fgemm);
}

}  // namespace

// AMX tiles where the CPU and the kernel allow them, else AVX-512 BF16, else AVX2 (widening + FMA), else portable.
const Bf16Isa& bf16_isa() {
  using namespace isa;
  static const Candidate<Bf16Isa> kPaths[] = {
#if OMF_ISA_X86
      {kAuto | kAmx, [] { return cpu().avx512bf16 && cpu().avx512bw && amx_bf16(); },
       {"amx-bf16", &amx::bgemm, &avx512bf16::to_bf16_rows, &amx::qbgemm, 16, 32}},
      {kAuto | kAvx512, [] { return cpu().avx512bf16 && cpu().avx512bw; },
       {"avx512bf16", &avx512bf16::bgemm, &avx512bf16::to_bf16_rows, &avx512bf16::qbgemm}},
      {kAuto | kAvx2 | kAvxVnni, [] { return cpu().avx2 && cpu().fma; },
       {"avx2", &avx2::bgemm, &avx2::to_bf16_rows, &avx2::qbgemm}},
#endif
      {kAny, always, {"generic", &generic::bgemm, &generic::to_bf16_rows, &generic::qbgemm}}};
  static const Bf16Isa chosen = choose(kPaths);
  return chosen;
}

OrtStatus* read_matmul_bf16_attrs(const ort::Api& api, const OrtKernelInfo* info, MatMulQAttrs& a) {
  return read_shape_attrs(api, info, "MatMulBF16", a);
}

OrtStatus* compute_matmul_bf16(const ort::Api& api, const MatMulQAttrs& A, OrtKernelContext* ctx) {
  Tensor in[2];
  void* y = nullptr;
  const int64_t P = panels_of(A.N), Kp = (A.K + 1) / 2 * 2;
  const PanelInput codes_input{"codes", kUint16, "uint16 or bfloat16", "panel16-bf16", kBfloat16};
  if (OrtStatus* s = float_weight_inputs(api, ctx, "MatMulBF16", A, codes_input, {P, Kp / 2, 32}, in, &y))
    return s;
  const Tensor &x = in[0], &codes = in[1];
  const int64_t M = x.numel() / A.K;
  if (M == 0) return nullptr;
  const int64_t lda = round_up(Kp, bf16_isa().k_align);
  Bf16Run run{static_cast<const float*>(x.data),
              {bf16_rows(M, lda), static_cast<const uint16_t*>(codes.data), static_cast<float*>(y), M, A.N, A.K, Kp,
               lda},
              rows_per_item(A.K)};
  if (OrtStatus* s = run_items(api, ctx, &to_bf16_item, items_of(M, run.rows_per_item), &run)) return s;
  return run_items(api, ctx, &bgemm_item, items_of(P, kPanelsPerItem), &run.prob);
}

// AVX-512F where the CPU has it, else portable. The compile stage lowers float32 weights to MatMulF32 only where this
// is "avx512f" (on the portable path ORT's own MatMul is faster).
const F32Isa& f32_isa() {
  using namespace isa;
  static const Candidate<F32Isa> kPaths[] = {
#if OMF_ISA_X86
      {kAny & ~(kGeneric | kAvx2 | kAvxVnni), [] { return cpu().avx512f; }, {"avx512f", &avx512f::fgemm}},
#endif
      {kAny, always, {"generic", &generic::fgemm}}};
  static const F32Isa chosen = choose(kPaths);
  return chosen;
}

OrtStatus* read_matmul_f32_attrs(const ort::Api& api, const OrtKernelInfo* info, MatMulQAttrs& a) {
  return read_shape_attrs(api, info, "MatMulF32", a);
}

OrtStatus* compute_matmul_f32(const ort::Api& api, const MatMulQAttrs& A, OrtKernelContext* ctx) {
  Tensor in[2];
  void* y = nullptr;
  if (OrtStatus* s = float_weight_inputs(api, ctx, "MatMulF32", A, {"w", kFloat, "float32", "panel16-f32"},
                                         {panels_of(A.N), A.K, kPanel}, in, &y))
    return s;
  const Tensor &x = in[0], &w = in[1];
  FGemmProblem prob{static_cast<const float*>(x.data), static_cast<const float*>(w.data), static_cast<float*>(y),
                    x.numel() / A.K, A.N, A.K};
  if (prob.M == 0) return nullptr;
  return run_items(api, ctx, &fgemm_item, items_of(panels_of(A.N), kPanelsPerItem), &prob);
}

// The fastest path the CPU has: AMX int8 (its 16-row tiles; bit for bit AVX-512 VNNI's results), AVX-512 VNNI,
// AVX-VNNI (256-bit), AVX2, portable. The 256-bit paths widen the float16 scales with vcvtph2ps (F16C: every AVX2 CPU
// has it, but it is checked).
const GemmIsa& gemm_isa() {
  using namespace isa;
  static const Candidate<GemmIsa> kPaths[] = {
#if OMF_ISA_X86
      {kAuto | kAmx, amx_int8, {"amx-int8", &amx::qgemm, &avx512vnni::quantize_rows}},
      {kAuto | kAvx512, [] { return cpu().avx512vnni && cpu().avx512bw; },
       {"avx512vnni", &avx512vnni::qgemm, &avx512vnni::quantize_rows}},
      {kAuto | kAvx512 | kAvxVnni, [] { return cpu().avx2 && cpu().fma && cpu().f16c && cpu().avxvnni; },
       {"avxvnni", &avxvnni::qgemm, &generic::quantize_rows}},
      {kAny & ~kGeneric, [] { return cpu().avx2 && cpu().fma && cpu().f16c; },
       {"avx2", &avx2::qgemm, &generic::quantize_rows}},
#endif
      {kAny, always, {"generic", &generic::qgemm, &generic::quantize_rows}}};
  static const GemmIsa chosen = choose(kPaths);
  return chosen;
}

OrtStatus* read_matmul_q_attrs(const ort::Api& api, const OrtKernelInfo* info, const char* op, MatMulQAttrs& a) {
  OrtStatus* s = read_shape_attrs(api, info, op, a);
  if (!s) s = api.KernelInfoGetAttribute_int64(info, "bits", &a.bits);
  if (!s) s = api.KernelInfoGetAttribute_int64(info, "block_size", &a.block);
  if (s) return s;
  if (a.bits != 4 && a.bits != 8) return fail(api, op, "bits must be 4 or 8");
  if (a.block != 32 && a.block != 64 && a.block != 128) return fail(api, op, "block_size must be 32, 64 or 128");
  return nullptr;
}

namespace {

// MatMulQ's and MatMulQBF16's inputs read and checked (in[3], the offsets, present iff have[3]), y made; *M its rows
OrtStatus* panel16_inputs(const ort::Api& api, const char* op, const MatMulQAttrs& A, OrtKernelContext* ctx,
                          Tensor* in, bool* have, void** y, int64_t* M) {
  if (OrtStatus* s = read_inputs(api, ctx, 4, in, have)) return s;
  if (!have[0] || !have[1] || !have[2]) return fail(api, op, "x, codes and scales are required");
  const Tensor &x = in[0], &codes = in[1], &scales = in[2], &offsets = in[3];
  const int64_t P = panels_of(A.N), kb = (A.K + A.block - 1) / A.block, Kp = kb * A.block;
  const int64_t chunk_bytes = kPanel * kChunk * A.bits / 8;
  if (x.type != kFloat || x.dims.empty() || x.dims.back() != A.K)
    return fail(api, op, "x must be float32 [..., " + std::to_string(A.K) + "]");
  if (codes.type != kUint8 || codes.dims != std::vector<int64_t>{P, Kp / kChunk, chunk_bytes})
    return fail(api, op, "codes must be uint8 [" + std::to_string(P) + ", " + std::to_string(Kp / kChunk) +
                ", " + std::to_string(chunk_bytes) + "] (the panel16 layout)");
  const std::vector<int64_t> sdims{P, kb, kPanel};
  if (scales.type != kFloat16 || scales.dims != sdims) return fail(api, op, "scales must be float16 [P, kb, 16]");
  if (have[3] && (offsets.type != kFloat || offsets.dims != sdims))
    return fail(api, op, "offsets must be float32 [P, kb, 16]");
  if (OrtStatus* s = last_dim_output(api, ctx, 0, x, A.N, y)) return s;
  *M = x.numel() / A.K;
  return nullptr;
}

void qbgemm_item(void* data, size_t i) {
  run_pair(*static_cast<const QBGemmProblem*>(data), i, bf16_isa().qbgemm);
}

}  // namespace

OrtStatus* compute_matmul_qbf16(const ort::Api& api, const MatMulQAttrs& A, OrtKernelContext* ctx) {
  Tensor in[4];
  bool have[4] = {false, false, false, false};
  void* y = nullptr;
  int64_t M = 0;
  if (OrtStatus* s = panel16_inputs(api, "MatMulQBF16", A, ctx, in, have, &y, &M)) return s;
  if (M == 0) return nullptr;
  const int64_t P = panels_of(A.N), Kp = (A.K + A.block - 1) / A.block * A.block;
  const int64_t lda = round_up(Kp, bf16_isa().k_align);
  uint16_t* xa = bf16_rows(M, lda);
  Bf16Run run{static_cast<const float*>(in[0].data), {xa, nullptr, nullptr, M, A.N, A.K, Kp, lda},
              rows_per_item(A.K)};
  if (OrtStatus* s = run_items(api, ctx, &to_bf16_item, items_of(M, run.rows_per_item), &run)) return s;
  QBGemmProblem prob{xa, static_cast<const uint8_t*>(in[1].data), static_cast<const uint16_t*>(in[2].data),
                     have[3] ? static_cast<const float*>(in[3].data) : nullptr, static_cast<float*>(y),
                     M, A.N, A.K, Kp, A.bits, A.block, lda};
  return run_items(api, ctx, &qbgemm_item, items_of(P, kPanelsPerItem), &prob);
}

OrtStatus* compute_matmul_q(const ort::Api& api, const MatMulQAttrs& A, OrtKernelContext* ctx) {
  Tensor in[4];
  bool have[4] = {false, false, false, false};
  void* y = nullptr;
  int64_t M = 0;
  if (OrtStatus* s = panel16_inputs(api, "MatMulQ", A, ctx, in, have, &y, &M)) return s;
  if (M == 0) return nullptr;
  const Tensor& x = in[0];
  const int64_t P = panels_of(A.N), kb = (A.K + A.block - 1) / A.block, Kp = kb * A.block;

  // the activations, quantized once (scratch kept per calling thread between calls)
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> qf;
  thread_local std::vector<int32_t> qs;
  qa.resize(static_cast<size_t>(M * Kp));
  qf.resize(static_cast<size_t>(M * (Kp / kChunk + kb)));
  qs.resize(static_cast<size_t>(M * (Kp / kChunk)));
  QuantizedRows q{qa.data(), qf.data(), qs.data(), qf.data() + M * (Kp / kChunk)};
  QuantizeRun qr{static_cast<const float*>(x.data), A.K, Kp, A.block, M, rows_per_item(A.K), have[3], q};
  if (OrtStatus* s = run_items(api, ctx, &quantize_item, items_of(M, qr.rows_per_item), &qr)) return s;

  QGemmProblem prob{q, static_cast<const uint8_t*>(in[1].data), static_cast<const uint16_t*>(in[2].data),
                    have[3] ? static_cast<const float*>(in[3].data) : nullptr, static_cast<float*>(y),
                    M, A.N, A.K, Kp, A.bits, A.block};
  return run_items(api, ctx, &gemm_item, items_of(P, kPanelsPerItem), &prob);
}

}  // namespace omf
