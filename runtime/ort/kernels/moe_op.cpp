// The MoE ops' ORT side (the contract: moe.h): attributes and inputs checked, every token routed (softmax, top-k,
// normalize; tokens over ORT's threads), then per round of at most kMoERows (token, expert) rows: the rows grouped by
// expert (counting sort, each expert's rows by token; for the bfloat16 tile unit, an expert's rows beyond 16 padded
// to a multiple of 16 with zero rows, as its tiles read them) and five passes of work items over ORT's intra-op
// threads —
//   1. gather: each row's token copied (float32), rounded to bfloat16 or quantized to int8 (16 rows an item);
//   2. gate_up: per active expert and pair of W1 panels (a run of pairs for an expert of a few rows: gemm_items),
//      that GEMM over the expert's rows (MatMulF32's, MatMulBF16's or MatMulQ's path) and SwiGLU of the 16 columns
//      each pair gives;
//   3. (MoEQ) the SwiGLU rows quantized to int8 (16 rows an item);
//   4. down: the same over W2's panels;
//   5. combine: each token's weighted sum of its k rows, in top-k order (16 tokens an item).
// Experts no token chose cost nothing; their weights are never read.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bf16.h"
#include "isa.h"
#include "ort_tensor.h"
#include "paged_attention.h"
#include "qgemm.h"
#include "qgemm_op.h"

namespace omf {
namespace {

constexpr int64_t kRowsPerItem = 16;    // gather and quantize items
constexpr int64_t kTokensPerItem = 16;  // routing and combine items
constexpr int64_t kComputeRows = 4;     // an expert with this many rows or more: one pair of panels a GEMM item
// weights a GEMM item of a few-row expert streams (at most; kMinItems splits them further): an int4 decode of
// Qwen3-30B-A3B's layer (3 layers beyond the LLC, rotating experts) read 14.0–15.4 GB/s with 256 KB, 14.4–16.1 with
// 1 MB, beside the dense MatMulQ's 17.4 at one row (the same minutes)
constexpr int64_t kItemBytes = 1 << 20;
constexpr int64_t kMinItems = 32;          // GEMM items at least, where pairs can be split that far

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

std::string shape(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

OrtStatus* fail(const ort::Api& api, MoEWeights w, const std::string& msg) {
  return api.CreateStatus(kOrtInvalidArgument, (std::string(moe_op_name(w)) + ": " + msg).c_str());
}

const char* const kF32Inputs[] = {"x", "router_logits", "gate_up", "down"};
const char* const kQInputs[] = {"x", "router_logits", "gate_up_codes", "gate_up_scales", "down_codes", "down_scales",
                                "gate_up_offsets", "down_offsets"};

const char* input_name(MoEWeights w, size_t i) { return w == MoEWeights::kQ ? kQInputs[i] : kF32Inputs[i]; }

// SwiGLU over rows of 16 (a pair of panels' gate and up columns): the SwiGLU op's paths (custom_op.cpp's table)
SwiGluFn swiglu_fn() {
  using namespace isa;
  struct Path {
    const char* name;
    SwiGluFn fn;
  };
  static const Candidate<Path> kPaths[] = {
#if OMF_ISA_X86
      {kAuto | kAvx512Bf16 | kAvx512, [] { return cpu().avx512f && cpu().avx512bw; }, {"avx512", &avx512::swiglu}},
      {kAuto | kAvx512Bf16 | kAvx512 | kAvx2, [] { return cpu().avx2 && cpu().fma; }, {"avx2", &avx2::swiglu}},
#endif
      {kAny, always, {"generic", &generic::swiglu}}};
  static const Path chosen = choose(kPaths);
  return chosen.fn;
}

// MoEF32's GEMM path (moe.h, moe_f32_path): MatMulF32's table with an AVX2 row
struct F32Gemm {
  const char* name;
  FGemmFn fn;
};

const F32Gemm& moe_f32() {
  using namespace isa;
  static const Candidate<F32Gemm> kPaths[] = {
#if OMF_ISA_X86
      {kAny & ~(kGeneric | kAvx2 | kAvxVnni), [] { return cpu().avx512f; }, {"avx512f", &avx512f::fgemm}},
      {kAny & ~kGeneric, [] { return cpu().avx2 && cpu().fma; }, {"avx2", &moe_avx2::fgemm}},
#endif
      {kAny, always, {"generic", &generic::fgemm}}};
  static const F32Gemm chosen = choose(kPaths);
  return chosen;
}

// One of the block's two matrices for every expert: one expert's W [N, K] and where its packed weights lie
struct Matrix {
  int64_t N = 0, K = 0, Kp = 0;  // Kp: K as the GEMM pads it (bfloat16: even; MoEQ: whole blocks)
  const void* w = nullptr;       // f32: float panels; bf16: uint16 panels; q: uint8 codes
  const uint16_t* scales = nullptr;
  const float* offsets = nullptr;
  int64_t bits = 0, block = 0;
  int64_t stride = 0, scale_stride = 0;  // one expert's elements of w, of scales (and offsets)
  int64_t panel_bytes = 0;               // one panel's bytes of weights, scales and offsets
};

// One GEMM's input rows in the precision's form: f [R, K] float32, b [R, lda] bfloat16, or q (int8 rows [R, Kp])
struct Rows {
  float* f = nullptr;
  uint16_t* b = nullptr;
  int64_t lda = 0;
  QuantizedRows q{};
  int64_t chunks = 0, kb = 0;
};

struct Group {
  int64_t expert, begin, count;  // rows [begin, begin + count)
};

struct Item {
  int32_t group, pair, pairs;  // the pairs of panels [pair, pair + pairs)
};

struct Run {
  MoEWeights kind;
  const float* x;
  float* y;
  int64_t H, Fp, k;
  int64_t t0;                 // the round's first token
  const int32_t* expert;      // [T·k] the experts chosen per token, in top-k order
  const float* weight;        // [T·k] their weights
  const int64_t* row;         // [T·k] (round-relative tokens) the row each choice has in the round
  const int32_t* token;       // [R] each row's round-relative token, -1: a padding row
  int64_t rows, tokens;       // R, the round's tokens
  std::vector<Group> groups;  // the active experts
  std::vector<Item> items;    // the pass's GEMM items
  Matrix w1, w2;
  Rows a1, a2;
  float *g, *h, *d;  // [R, 2Fp] gate_up products; [R, Fp] SwiGLU (f32, q); [R, H] down products
  bool xsum1 = false, xsum2 = false;
};

// one expert's rows × the panels [p0, p1) of `w` into out [R, w.N]
void gemm(const Run& r, const Matrix& w, const Rows& a, const Group& g, float* out, int64_t p0, int64_t p1) {
  const int64_t e = g.expert, b = g.begin, n = g.count;
  switch (r.kind) {
    case MoEWeights::kF32: {
      const FGemmProblem P{a.f + b * w.K, static_cast<const float*>(w.w) + e * w.stride, out + b * w.N, n, w.N, w.K};
      moe_f32().fn(P, p0, p1);
      break;
    }
    case MoEWeights::kBF16: {
      const BGemmProblem P{a.b + b * a.lda, static_cast<const uint16_t*>(w.w) + e * w.stride, out + b * w.N, n, w.N,
                           w.K, w.Kp, a.lda};
      bf16_isa().bgemm(P, p0, p1);
      break;
    }
    case MoEWeights::kQ: {
      const QuantizedRows q{a.q.a + b * w.Kp, a.q.d + b * a.chunks, a.q.asum + b * a.chunks,
                            a.q.xsum ? a.q.xsum + b * a.kb : nullptr};
      const QGemmProblem P{q, static_cast<const uint8_t*>(w.w) + e * w.stride, w.scales + e * w.scale_stride,
                           w.offsets ? w.offsets + e * w.scale_stride : nullptr, out + b * w.N, n, w.N, w.K, w.Kp,
                           w.bits, w.block};
      gemm_isa().qgemm(P, p0, p1);
      break;
    }
  }
}

// the round's rows [16i, 16i + 16): each row's token in the first GEMM's form (bfloat16: padding rows zero, and the
// down GEMM's rows zero past Fp, which the SwiGLU items do not write)
void gather_item(void* data, size_t item) {
  const Run& r = *static_cast<const Run*>(data);
  const int64_t i0 = static_cast<int64_t>(item) * kRowsPerItem, i1 = std::min(r.rows, i0 + kRowsPerItem);
  for (int64_t i = i0; i < i1; ++i) {
    const int32_t t = r.token[i];
    const float* xr = t < 0 ? nullptr : r.x + (r.t0 + t) * r.H;
    switch (r.kind) {
      case MoEWeights::kF32: std::memcpy(r.a1.f + i * r.H, xr, r.H * sizeof(float)); break;
      case MoEWeights::kBF16: {
        uint16_t* down_row = r.a2.b + i * r.a2.lda;
        if (xr == nullptr) {
          std::memset(r.a1.b + i * r.a1.lda, 0, r.a1.lda * sizeof(uint16_t));
          std::memset(down_row, 0, r.a2.lda * sizeof(uint16_t));
        } else {
          bf16_isa().to_bf16(xr, r.H, r.a1.lda, r.a1.b + i * r.a1.lda, 0, 1);
          std::memset(down_row + r.Fp, 0, (r.a2.lda - r.Fp) * sizeof(uint16_t));
        }
        break;
      }
      case MoEWeights::kQ: {
        const Rows& a = r.a1;
        const QuantizedRows q{a.q.a + i * r.w1.Kp, a.q.d + i * a.chunks, a.q.asum + i * a.chunks,
                              a.q.xsum ? a.q.xsum + i * a.kb : nullptr};
        gemm_isa().quantize(xr, r.H, r.w1.Kp, r.w1.block, r.xsum1, q, 0, 1);
        break;
      }
    }
  }
}

// expert group × pairs q of W1's panels: gate and up columns 16q … 16q + 15, then their SwiGLU
void gate_up_item(void* data, size_t i) {
  const Run& r = *static_cast<const Run*>(data);
  const Item it = r.items[i];
  const Group& g = r.groups[it.group];
  gemm(r, r.w1, r.a1, g, r.g, 2 * it.pair, 2 * (it.pair + static_cast<int64_t>(it.pairs)));
  const SwiGluFn swiglu = swiglu_fn();
  for (int64_t q = it.pair; q < it.pair + it.pairs; ++q) {
    const int64_t col = kPanel * q;
    for (int64_t row = g.begin; row < g.begin + g.count; ++row) {
      const float* in = r.g + row * 2 * r.Fp + 2 * col;  // 16 gate columns, then the same 16 up columns
      if (r.kind == MoEWeights::kBF16) {
        float out[kPanel];
        swiglu(in, out, 1, kPanel);
        uint16_t* dst = r.a2.b + row * r.a2.lda + col;
        for (int c = 0; c < kPanel; ++c) dst[c] = bf16_round(out[c]);
      } else {
        swiglu(in, r.h + row * r.Fp + col, 1, kPanel);
      }
    }
  }
}

void quantize_item(void* data, size_t item) {
  const Run& r = *static_cast<const Run*>(data);
  const int64_t i0 = static_cast<int64_t>(item) * kRowsPerItem;
  gemm_isa().quantize(r.h, r.Fp, r.w2.Kp, r.w2.block, r.xsum2, r.a2.q, i0, std::min(r.rows, i0 + kRowsPerItem));
}

void down_item(void* data, size_t i) {
  const Run& r = *static_cast<const Run*>(data);
  const Item it = r.items[i];
  gemm(r, r.w2, r.a2, r.groups[it.group], r.d, 2 * it.pair, std::min<int64_t>(2 * (it.pair + it.pairs), panels_of(r.H)));
}

// The GEMM items over `pairs` pairs of w's panels per active expert: one pair an item for an expert with
// kComputeRows rows or more (its tiles reuse each weight over the rows; the vector paths prefetch the next pair), else
// runs of pairs of ~kItemBytes of weights (a decode's few rows stream the weights: one long contiguous read per item,
// which the hardware prefetcher follows, instead of many short ones), and no fewer than kMinItems items in all
void gemm_items(Run& r, const Matrix& w, int64_t pairs) {
  const int64_t run = std::clamp<int64_t>(kItemBytes / (2 * w.panel_bytes), 1, pairs);
  const int64_t groups = static_cast<int64_t>(r.groups.size());
  int64_t small = 0;
  for (const Group& g : r.groups) small += g.count < kComputeRows;
  int64_t per = run;  // pairs an item for the few-row experts
  while (per > 1 && (groups - small) * pairs + small * ((pairs + per - 1) / per) < kMinItems) per = (per + 1) / 2;
  r.items.clear();
  for (int32_t g = 0; g < static_cast<int32_t>(r.groups.size()); ++g) {
    const int64_t step = r.groups[g].count < kComputeRows ? per : 1;
    for (int64_t q = 0; q < pairs; q += step)
      r.items.push_back({g, static_cast<int32_t>(q), static_cast<int32_t>(std::min(step, pairs - q))});
  }
}

void combine_item(void* data, size_t item) {
  const Run& r = *static_cast<const Run*>(data);
  const int64_t t0 = static_cast<int64_t>(item) * kTokensPerItem, t1 = std::min(r.tokens, t0 + kTokensPerItem);
  for (int64_t t = t0; t < t1; ++t) {
    float* y = r.y + (r.t0 + t) * r.H;
    const int64_t c0 = (r.t0 + t) * r.k;
    const float* d = r.d + r.row[t * r.k] * r.H;
    const float w = r.weight[c0];
    for (int64_t h = 0; h < r.H; ++h) y[h] = w * d[h];
    for (int64_t j = 1; j < r.k; ++j) {
      const float* dj = r.d + r.row[t * r.k + j] * r.H;
      const float wj = r.weight[c0 + j];
      for (int64_t h = 0; h < r.H; ++h) y[h] += wj * dj[h];
    }
  }
}

struct Route {
  const float* logits;
  int64_t T, E, k;
  bool normalize;
  int32_t* expert;
  float* weight;
};

// tokens [16i, 16i + 16): softmax in float32, the top k (strictly greater wins: ties go to the lower index), their
// weights normalized in top-k order
void route_item(void* data, size_t item) {
  const Route& r = *static_cast<const Route*>(data);
  thread_local std::vector<float> p;
  thread_local std::vector<char> taken;
  p.resize(static_cast<size_t>(r.E));
  taken.resize(static_cast<size_t>(r.E));
  const int64_t t0 = static_cast<int64_t>(item) * kTokensPerItem, t1 = std::min(r.T, t0 + kTokensPerItem);
  for (int64_t t = t0; t < t1; ++t) {
    const float* l = r.logits + t * r.E;
    float m = l[0];
    for (int64_t e = 1; e < r.E; ++e) m = std::max(m, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < r.E; ++e) sum += p[e] = std::exp(l[e] - m);
    for (int64_t e = 0; e < r.E; ++e) p[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    float total = 0.0f;
    for (int64_t j = 0; j < r.k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < r.E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      r.expert[t * r.k + j] = static_cast<int32_t>(best);
      r.weight[t * r.k + j] = p[best];
      total += p[best];
    }
    if (r.normalize)
      for (int64_t j = 0; j < r.k; ++j) r.weight[t * r.k + j] /= total;
  }
}

// Scratch per calling thread, kept between calls (a round's largest): the gate_up products G, the down products D,
// the SwiGLU rows h (float32; MoEQ's before quantizing), and each GEMM's input rows in its precision's form
struct Scratch {
  std::vector<float> g, d, h, x, d1, xsum1, d2, xsum2;
  std::vector<uint16_t> xb, hb;
  std::vector<int8_t> q1, q2;
  std::vector<int32_t> asum1, asum2;
};

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  return v.data();
}

// R rows of int8 activations for a GEMM over Kp (blocks of `block`; the block sums only when `xsum`)
Rows quantized_rows(std::vector<int8_t>& a, std::vector<float>& d, std::vector<int32_t>& asum, std::vector<float>& xs,
                    int64_t R, int64_t Kp, int64_t block, bool xsum) {
  Rows r;
  r.chunks = Kp / kChunk, r.kb = Kp / block;
  r.q = {grow(a, R * Kp), grow(d, R * r.chunks), grow(asum, R * r.chunks), xsum ? grow(xs, R * r.kb) : nullptr};
  return r;
}

// `t` is `type` (or `alt`) of `dims`; else one line naming the input, what it must be and what it is
OrtStatus* check_input(const ort::Api& api, MoEWeights w, size_t i, const Tensor& t, int type, int alt,
                       const char* type_name, const std::vector<int64_t>& dims, const char* layout) {
  if ((t.type == type || t.type == alt) && t.dims == dims) return nullptr;
  return fail(api, w, std::string(input_name(w, i)) + " must be " + type_name + " " + shape(dims) + " (" + layout +
                          " layout), got element type " + std::to_string(t.type) + " " + shape(t.dims));
}

}  // namespace

const char* moe_f32_path() { return moe_f32().name; }

const char* moe_op_name(MoEWeights w) {
  return w == MoEWeights::kF32 ? "MoEF32" : w == MoEWeights::kBF16 ? "MoEBF16" : "MoEQ";
}

size_t moe_input_count(MoEWeights w) { return w == MoEWeights::kQ ? 8 : 4; }

int moe_input_type(MoEWeights w, size_t i) {
  if (i < 2) return kFloat;
  switch (w) {
    case MoEWeights::kF32: return kFloat;
    case MoEWeights::kBF16: return kUndefined;  // uint16 or bfloat16 (the same bits), checked at run time
    default: return i == 2 || i == 4 ? kUint8 : i == 3 || i == 5 ? kFloat16 : kFloat;
  }
}

bool moe_input_optional(MoEWeights w, size_t i) { return w == MoEWeights::kQ && i >= 6; }

OrtStatus* read_moe_attrs(const ort::Api& api, const OrtKernelInfo* info, MoEWeights w, MoEAttrs& A) {
  A.weights = w;
  auto get = [&](const char* name, int64_t& v) { return api.KernelInfoGetAttribute_int64(info, name, &v); };
  int64_t layout = 0;
  OrtStatus* s = get("hidden_size", A.H);
  if (!s) s = get("inter_size", A.F);
  if (!s) s = get("top_k", A.top_k);
  if (!s) s = get("normalize", A.normalize);
  if (!s) s = get("layout", layout);
  if (!s && w == MoEWeights::kQ) {
    s = get("bits", A.bits);
    if (!s) s = get("block_size", A.block);
    if (!s) {
      if (OrtStatus* o = get("down_bits", A.down_bits)) api.ReleaseStatus(o), A.down_bits = A.bits;
      if (OrtStatus* o = get("down_block_size", A.down_block)) api.ReleaseStatus(o), A.down_block = A.block;
    }
  }
  if (s) return s;
  if (layout != kPanelLayout)
    return fail(api, w, "weight layout version " + std::to_string(layout) + " is not known to this kernel library (it "
                "reads version " + std::to_string(kPanelLayout) + "); recompile the bundle");
  if (A.H <= 0 || A.F <= 0) return fail(api, w, "hidden_size and inter_size must be positive");
  if (A.top_k < 1) return fail(api, w, "top_k must be at least 1, got " + std::to_string(A.top_k));
  if (A.normalize != 0 && A.normalize != 1) return fail(api, w, "normalize must be 0 or 1");
  if (w == MoEWeights::kQ) {
    for (int64_t b : {A.bits, A.down_bits})
      if (b != 4 && b != 8) return fail(api, w, "bits and down_bits must be 4 or 8");
    for (int64_t b : {A.block, A.down_block})
      if (b != 32 && b != 64 && b != 128) return fail(api, w, "block_size and down_block_size must be 32, 64 or 128");
  }
  return nullptr;
}

OrtStatus* compute_moe(const ort::Api& api, const MoEAttrs& A, OrtKernelContext* ctx) {
  const MoEWeights kind = A.weights;
  const size_t n_in = moe_input_count(kind);
  Tensor in[8];
  bool have[8] = {};
  if (OrtStatus* s = read_inputs(api, ctx, n_in, in, have)) return s;
  for (size_t i = 0; i < n_in; ++i)
    if (!have[i] && !moe_input_optional(kind, i))
      return fail(api, kind, std::string("input ") + std::to_string(i) + " (" + input_name(kind, i) + ") is required");
  const Tensor &x = in[0], &logits = in[1];
  const int64_t H = A.H, F = A.F, Fp = round_up(F, kPanel), P1 = 2 * Fp / kPanel, Ph = panels_of(H);
  if (x.type != kFloat || x.dims.empty() || x.dims.back() != H)
    return fail(api, kind, "x must be float32 [..., " + std::to_string(H) + "], got " + shape(x.dims));
  if (logits.type != kFloat || logits.dims.size() != x.dims.size() ||
      !std::equal(x.dims.begin(), x.dims.end() - 1, logits.dims.begin()) || logits.dims.back() < 1)
    return fail(api, kind, "router_logits must be float32 [..., E] with x's leading dims " + shape(x.dims) +
                               ", got " + shape(logits.dims));
  const int64_t E = logits.dims.back(), T = x.numel() / H, k = A.top_k;
  if (k > E)
    return fail(api, kind, "top_k = " + std::to_string(k) + " exceeds the router's " + std::to_string(E) + " experts");

  Run r{};
  r.kind = kind, r.H = H, r.Fp = Fp, r.k = k;
  Matrix &w1 = r.w1, &w2 = r.w2;
  w1.N = 2 * Fp, w1.K = H, w2.N = H, w2.K = Fp;
  switch (kind) {
    case MoEWeights::kF32:
      if (OrtStatus* s = check_input(api, kind, 2, in[2], kFloat, kFloat, "float32", {E, P1, H, kPanel},
                                     "panel16-f32"))
        return s;
      if (OrtStatus* s = check_input(api, kind, 3, in[3], kFloat, kFloat, "float32", {E, Ph, Fp, kPanel},
                                     "panel16-f32"))
        return s;
      w1.Kp = H, w2.Kp = Fp;
      w1.stride = P1 * H * kPanel, w2.stride = Ph * Fp * kPanel;
      w1.panel_bytes = H * kPanel * 4, w2.panel_bytes = Fp * kPanel * 4;
      break;
    case MoEWeights::kBF16: {
      const int64_t Hp = round_up(H, 2);
      if (OrtStatus* s = check_input(api, kind, 2, in[2], kUint16, kBfloat16, "uint16 or bfloat16",
                                     {E, P1, Hp / 2, 2 * kPanel}, "panel16-bf16"))
        return s;
      if (OrtStatus* s = check_input(api, kind, 3, in[3], kUint16, kBfloat16, "uint16 or bfloat16",
                                     {E, Ph, Fp / 2, 2 * kPanel}, "panel16-bf16"))
        return s;
      w1.Kp = Hp, w2.Kp = Fp;
      w1.stride = P1 * Hp * kPanel, w2.stride = Ph * Fp * kPanel;
      w1.panel_bytes = Hp * kPanel * 2, w2.panel_bytes = Fp * kPanel * 2;
      break;
    }
    case MoEWeights::kQ: {
      const int64_t kb1 = (H + A.block - 1) / A.block, kb2 = (Fp + A.down_block - 1) / A.down_block;
      w1.bits = A.bits, w1.block = A.block, w1.Kp = kb1 * A.block;
      w2.bits = A.down_bits, w2.block = A.down_block, w2.Kp = kb2 * A.down_block;
      const int64_t cb1 = kPanel * kChunk * w1.bits / 8, cb2 = kPanel * kChunk * w2.bits / 8;
      const std::vector<int64_t> s1{E, P1, kb1, kPanel}, s2{E, Ph, kb2, kPanel};
      if (OrtStatus* s = check_input(api, kind, 2, in[2], kUint8, kUint8, "uint8", {E, P1, w1.Kp / kChunk, cb1},
                                     "panel16"))
        return s;
      if (OrtStatus* s = check_input(api, kind, 3, in[3], kFloat16, kFloat16, "float16", s1, "panel16")) return s;
      if (OrtStatus* s = check_input(api, kind, 4, in[4], kUint8, kUint8, "uint8", {E, Ph, w2.Kp / kChunk, cb2},
                                     "panel16"))
        return s;
      if (OrtStatus* s = check_input(api, kind, 5, in[5], kFloat16, kFloat16, "float16", s2, "panel16")) return s;
      if (have[6])
        if (OrtStatus* s = check_input(api, kind, 6, in[6], kFloat, kFloat, "float32", s1, "panel16")) return s;
      if (have[7])
        if (OrtStatus* s = check_input(api, kind, 7, in[7], kFloat, kFloat, "float32", s2, "panel16")) return s;
      w1.scales = static_cast<const uint16_t*>(in[3].data), w2.scales = static_cast<const uint16_t*>(in[5].data);
      w1.offsets = have[6] ? static_cast<const float*>(in[6].data) : nullptr;
      w2.offsets = have[7] ? static_cast<const float*>(in[7].data) : nullptr;
      w1.stride = P1 * (w1.Kp / kChunk) * cb1, w2.stride = Ph * (w2.Kp / kChunk) * cb2;
      w1.scale_stride = P1 * kb1 * kPanel, w2.scale_stride = Ph * kb2 * kPanel;
      w1.panel_bytes = w1.stride / P1 + kb1 * kPanel * (w1.offsets ? 6 : 2);
      w2.panel_bytes = w2.stride / Ph + kb2 * kPanel * (w2.offsets ? 6 : 2);
      r.xsum1 = w1.offsets != nullptr, r.xsum2 = w2.offsets != nullptr;
      break;
    }
  }
  w1.w = in[2].data;
  w2.w = in[kind == MoEWeights::kQ ? 4 : 3].data;

  void* y = nullptr;
  if (OrtStatus* s = last_dim_output(api, ctx, 0, x, H, &y)) return s;
  if (T == 0) return nullptr;
  r.x = static_cast<const float*>(x.data), r.y = static_cast<float*>(y);

  // routing, every token
  thread_local std::vector<int32_t> expert;
  thread_local std::vector<float> weight;
  expert.resize(static_cast<size_t>(T * k));
  weight.resize(static_cast<size_t>(T * k));
  Route route{static_cast<const float*>(logits.data), T, E, k, A.normalize == 1, expert.data(), weight.data()};
  if (OrtStatus* s = run_items(api, ctx, &route_item, items_of(T, kTokensPerItem), &route)) return s;
  r.expert = expert.data(), r.weight = weight.data();

  const int64_t align = kind == MoEWeights::kBF16 ? bf16_isa().m_align : 1;
  const int64_t round_tokens = std::max<int64_t>(1, kMoERows / k);
  std::vector<int64_t> count(E), next(E), row;
  std::vector<int32_t> token;
  for (int64_t t0 = 0; t0 < T; t0 += round_tokens) {
    const int64_t n_tok = std::min(round_tokens, T - t0);
    const int32_t* ex = expert.data() + t0 * k;
    // 1. the rows grouped by expert
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n_tok * k; ++i) ++count[ex[i]];
    r.groups.clear();
    int64_t R = 0;
    for (int64_t e = 0; e < E; ++e) {
      next[e] = R;
      if (count[e] == 0) continue;
      r.groups.push_back({e, R, count[e]});
      R += count[e] > align ? round_up(count[e], align) : count[e];  // the tile unit reads up to 16 rows as they are
    }
    row.resize(static_cast<size_t>(n_tok * k));
    token.assign(static_cast<size_t>(R), -1);
    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t at = next[ex[t * k + j]]++;
        row[t * k + j] = at;
        token[at] = static_cast<int32_t>(t);
      }
    r.t0 = t0, r.tokens = n_tok, r.rows = R, r.row = row.data(), r.token = token.data();

    // scratch
    thread_local Scratch s;
    r.g = grow(s.g, R * 2 * Fp), r.d = grow(s.d, R * H);
    switch (kind) {
      case MoEWeights::kF32: r.a1.f = grow(s.x, R * H), r.h = r.a2.f = grow(s.h, R * Fp); break;
      case MoEWeights::kBF16:
        r.a1.lda = round_up(w1.Kp, bf16_isa().k_align), r.a2.lda = round_up(w2.Kp, bf16_isa().k_align);
        r.a1.b = grow(s.xb, R * r.a1.lda), r.a2.b = grow(s.hb, R * r.a2.lda);
        break;
      case MoEWeights::kQ:
        r.a1 = quantized_rows(s.q1, s.d1, s.asum1, s.xsum1, R, w1.Kp, w1.block, r.xsum1);
        r.a2 = quantized_rows(s.q2, s.d2, s.asum2, s.xsum2, R, w2.Kp, w2.block, r.xsum2);
        r.h = grow(s.h, R * Fp);
        break;
    }

    // 2. the passes
    if (OrtStatus* s = run_items(api, ctx, &gather_item, items_of(R, kRowsPerItem), &r)) return s;
    gemm_items(r, w1, P1 / 2);
    if (OrtStatus* s = run_items(api, ctx, &gate_up_item, r.items.size(), &r)) return s;
    if (kind == MoEWeights::kQ)
      if (OrtStatus* s = run_items(api, ctx, &quantize_item, items_of(R, kRowsPerItem), &r)) return s;
    gemm_items(r, w2, (Ph + 1) / 2);
    if (OrtStatus* s = run_items(api, ctx, &down_item, r.items.size(), &r)) return s;
    if (OrtStatus* s = run_items(api, ctx, &combine_item, items_of(n_tok, kTokensPerItem), &r)) return s;
  }
  return nullptr;
}

}  // namespace omf
