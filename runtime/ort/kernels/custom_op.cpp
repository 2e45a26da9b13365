// The omforge kernel library: registers the custom-op domain `omforge.kernels` with ONNX Runtime
// (entry point RegisterCustomOps) and implements its ops on the CPU EP: PagedAttention (three KV pool
// dtypes, below), SwiGLU (gate_up [..., 2F] -> silu(gate) * up [..., F]), AddRMSNorm (a + b and its RMSNorm, as
// ORT's SkipSimplifiedLayerNormalization without the broadcasting), MatMulQ (a block-quantized weight
// MatMul with int8 activations: qgemm.h, qgemm_op.h), MatMulQBF16 (the same weights, bfloat16 activations),
// MatMulBF16 (bfloat16 weights: bgemm_generic.cpp), MatMulF32 (float32 weights in panels: fgemm_generic.cpp) and
// LoraAdd (y + each token's LoRA term, tokens grouped by adapter slot: the contract in lora.h, since ABI 6) and
// MoEF32 / MoEBF16 / MoEQ (a mixture-of-experts block, tokens grouped by expert: the contract in moe.h, since ABI 9).
//
// PagedAttention (fp32 pools) / PagedAttentionBF16 (bf16 pools) / PagedAttentionInt8 (int8 pools, each
// head's row followed by its float32 scale: [S, Hkv, D + 4] int8), the ORT CPU lowering of the step ABI's
// paged attention (see passes/paged_kv.py for the ABI):
//   inputs   0 q [1, Hq, T, D] or [1, T, Hq*D] float    1 k, 2 v: [1, Hkv, T, D] or [1, T, Hkv*D] float
//            3 key_cache, 4 value_cache [S, Hkv, D]    5 slot_mapping [T]   6 block_tables [B, M]
//            7 query_index [B, Q]   8 token_index [T]   9 position_ids [1, T]
//            10 decode_block_tables [Bd, Md]   11 decode_query_index [Bd, 1]   (all index inputs int64)
//            12 cos_cache, 13 sin_cache [1, T, D/2] or [T, D/2] float (optional, both or neither)
//            k and v may both be omitted: q is then the packed projection [1, T, (Hq + 2*Hkv)*D] (q heads, k heads,
//            v heads: the QKV MatMul's output as it is). With cos/sin, q and k are rotated first (rotate-half RoPE,
//            non-interleaved, ONNX RotaryEmbedding's formula in float32: x1*c - x2*s, x2*c + x1*s), so the pools
//            hold rotated keys.
//   outputs  0 o: q's shape; [1, T, Hq*D] when q is packed   1 key_cache_out, 2 value_cache_out (the pools with
//            this step's rows written)
//   attrs    scale (float), q_heads, kv_heads, block_size, window (0: none)
// Contract: the step's new K/V rows are written at slot_mapping first (in place when the output is bound to
// the input's buffer; otherwise the pool is copied once, then written), then every referenced query row
// attends to the keys of its sequence at positions <= its own (and > position - window). A row (b, i) of the
// main group is referenced iff token_index[query_index[b, i]] == b * Q + i; a decode-group row d iff
// token_index[decode_query_index[d]] == B * Q + d (the ABI's padding rows are skipped).
#include <algorithm>
#include <atomic>
#include <iterator>
#include <new>
#include <string>
#include <vector>

#include "head_dims.h"
#include "isa.h"
#include "lora.h"
#include "moe.h"
#include "ort_abi.h"
#include "ort_tensor.h"
#include "paged_attention.h"
#include "qgemm_op.h"

#define OMF_EXPORT extern "C" __attribute__((visibility("default")))

namespace omf {
namespace {

constexpr int kAbiVersion = 9;  // bump when an op's inputs, outputs or attributes change or an op is added (6: LoraAdd;
                                // 7: MatMulBF16's panels may be typed bfloat16 as well as uint16; 8: MatMulQ's and
                                // MatMulQBF16's scales are float16; 9: MoEF32, MoEBF16, MoEQ)
constexpr const char* kDomain = "omforge.kernels";
#define OMF_LIST_ITEM(d) d,
constexpr int64_t kHeadDims[] = {OMF_HEAD_DIMS(OMF_LIST_ITEM)};  // the instantiations in paged_attention_impl.h
#undef OMF_LIST_ITEM
constexpr int64_t kMaxHeadDim = *std::max_element(std::begin(kHeadDims), std::end(kHeadDims));

// "16, 32, …": kHeadDims for the error and "16,32,…" for omforge_kernels_info
std::string head_dims(const char* sep) {
  std::string s;
  for (int64_t d : kHeadDims) s += (s.empty() ? "" : sep) + std::to_string(d);
  return s;
}

ort::Api g_api;

struct PaIsa {  // PagedAttention's path and the small ops' (SwiGLU, the int8 pool write, AddRMSNorm)
  const char* name;
  AttendFn fn;
  SwiGluFn swiglu;
  QuantizeKvFn quantize_kv_int8;
  AddRmsNormFn add_rms_norm;
};

// AVX-512 with bfloat16 dot products (pa_avx512bf16.cpp), AVX-512F + BW (BW for the int8 dots), AVX2 + FMA, portable;
// chosen at the first call
const PaIsa& pa_isa() {
  using namespace isa;
  static const Candidate<PaIsa> kPaths[] = {
#if OMF_ISA_X86
      {kAuto | kAvx512Bf16, [] { return cpu().avx512f && cpu().avx512bw && cpu().avx512bf16; },
       {"avx512bf16", &avx512bf16::attend, &avx512::swiglu, &avx512::quantize_kv_int8, &avx512::add_rms_norm}},
      {kAuto | kAvx512Bf16 | kAvx512, [] { return cpu().avx512f && cpu().avx512bw; },
       {"avx512", &avx512::attend, &avx512::swiglu, &avx512::quantize_kv_int8, &avx512::add_rms_norm}},
      {kAuto | kAvx512Bf16 | kAvx512 | kAvx2, [] { return cpu().avx2 && cpu().fma; },
       {"avx2", &avx2::attend, &avx2::swiglu, &avx2::quantize_kv_int8, &avx2::add_rms_norm}},
#endif
      {kAny, always, {"generic", &generic::attend, &generic::swiglu, &generic::quantize_kv_int8,
                      &generic::add_rms_norm}}};
  static const PaIsa chosen = choose(kPaths);
  return chosen;
}

OrtStatus* fail(const std::string& msg) { return g_api.CreateStatus(kOrtInvalidArgument, ("PagedAttention: " + msg).c_str()); }

enum class OpKind {
  kPagedAttention, kSwiGlu, kMatMulQ, kMatMulQBF16, kMatMulBF16, kMatMulF32, kAddRmsNorm, kLoraAdd,
  kMoEF32, kMoEBF16, kMoEQ
};

bool is_moe(OpKind k) { return k == OpKind::kMoEF32 || k == OpKind::kMoEBF16 || k == OpKind::kMoEQ; }
MoEWeights moe_weights(OpKind k) {
  return k == OpKind::kMoEF32 ? MoEWeights::kF32 : k == OpKind::kMoEBF16 ? MoEWeights::kBF16 : MoEWeights::kQ;
}

struct Kernel {
  OpKind kind = OpKind::kPagedAttention;
  KvType kv_type;
  int64_t q_heads = 0, kv_heads = 0, block_size = 0, window = 0;
  float scale = 0.0f, epsilon = 0.0f;
  MatMulQAttrs gemm;
  MoEAttrs moe;
};

// Cascade attention for decodes that share a prefix (a system prompt, a shared document, parallel samples): the
// one-token items whose block tables begin with the same full blocks attend those blocks once, together, as a
// prefill chunk's rows do (query rows in vector lanes: every key element feeds up to 4 row vectors), instead of each
// reading them on its own at a decode row's arithmetic intensity; each member's own item then goes on from the
// state they leave (WorkItem::skip_blocks). Only without a sliding window (every key of a shared block is visible
// to every member). Groups are keyed by the first block id; their shared length is the longest run of leading blocks
// all members hold, each member keeping at least its own last block. A group needs kCascadeMinRows query rows per KV
// head (members × G): one node of SmolLM2's shape (G = 3), 512 shared tokens of ~600, fp32 / bf16 / int8 pools
// (bench_attention.py --shared 512, µs per call, two rounds): 16 sequences 487–541 → 358–399 / 363–402 → 325 /
// 247–360 → 236–268, 32 926–1063 → 634–920 / 688–799 → 478–486 / 474–546 → 397–521, 64 2012–2039 → 1180–1399 /
// 1426–1519 → 813–943 / 851–1021 → 756–864; 8 sequences (24 rows) no gain for fp32, int8 129–137 → 196–224.
constexpr size_t kCascadeMinRows = 48;
constexpr size_t kCascadeMaxRows = 64;  // per cascade item (and KV head): the items split a group's members

// Plans the cascade items of `items` (sets the members' skip_blocks; appends the members' token indices to `tokens`,
// which the cascade items index).
std::vector<WorkItem> plan_cascade(std::vector<WorkItem>& items, std::vector<int32_t>& tokens, const int64_t* positions,
                                   int64_t bs, int32_t q_heads, int32_t kv_heads) {
  std::vector<size_t> cand;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].count == 1 && items[i].table_len >= 1 && positions[tokens[items[i].first]] >= bs) cand.push_back(i);
  std::vector<WorkItem> cascade;
  const size_t G = static_cast<size_t>(q_heads / kv_heads);
  if (cand.size() * G < kCascadeMinRows) return cascade;
  std::stable_sort(cand.begin(), cand.end(), [&](size_t a, size_t b) { return items[a].table[0] < items[b].table[0]; });
  for (size_t g0 = 0, g1; g0 < cand.size(); g0 = g1) {
    for (g1 = g0 + 1; g1 < cand.size() && items[cand[g1]].table[0] == items[cand[g0]].table[0];) ++g1;
    const size_t members = g1 - g0;
    if (members * G < kCascadeMinRows) continue;
    const WorkItem& lead = items[cand[g0]];
    int64_t L = lead.table_len;
    for (size_t k = g0; k < g1; ++k) L = std::min(L, positions[tokens[items[cand[k]].first]] / bs);
    for (size_t k = g0 + 1; k < g1; ++k) {  // the run of leading blocks every member shares with the lead
      const WorkItem& m = items[cand[k]];
      int64_t b = 1;
      while (b < L && b < m.table_len && m.table[b] == lead.table[b]) ++b;
      L = b;
    }
    const size_t chunks = (members * G + kCascadeMaxRows - 1) / kCascadeMaxRows;
    const size_t per = (members + chunks - 1) / chunks;
    for (size_t c = g0; c < g1; c += per) {  // an item per chunk of members and KV head: work for every thread
      WorkItem ci{lead.table, lead.table_len, static_cast<int32_t>(tokens.size()), 0};
      ci.cascade_blocks = static_cast<int32_t>(L);
      for (size_t k = c; k < std::min(g1, c + per); ++k) {
        const int32_t t = tokens[items[cand[k]].first];
        tokens.push_back(t);
        items[cand[k]].skip_blocks = static_cast<int32_t>(L);
        ++ci.count;
      }
      for (int32_t g = 0; g < kv_heads; ++g) {
        ci.kv_head = g;
        cascade.push_back(ci);
      }
    }
  }
  return cascade;
}

struct Run {
  const PagedProblem* problem;
  std::atomic<const char*> error{nullptr};
};

void run_item(void* data, size_t i) {
  Run* run = static_cast<Run*>(data);
  const char* err = nullptr;
  if (!pa_isa().fn(*run->problem, i, &err)) run->error.store(err);
}

// Per-token strides of a [1, H, T, D] or [1, T, H*D] activation; false when the shape is neither.
bool activation_layout(const Tensor& t, int64_t heads, int64_t& tokens, int64_t& head_dim, int64_t& tok_stride,
                       int64_t& head_stride) {
  if (t.dims.size() == 4 && t.dims[0] == 1 && t.dims[1] == heads) {
    tokens = t.dims[2], head_dim = t.dims[3], tok_stride = head_dim, head_stride = tokens * head_dim;
    return true;
  }
  if (t.dims.size() == 3 && t.dims[0] == 1 && heads > 0 && t.dims[2] % heads == 0) {
    tokens = t.dims[1], head_dim = t.dims[2] / heads, tok_stride = t.dims[2], head_stride = head_dim;
    return true;
  }
  return false;
}

// Rotate-half RoPE of one head's row (ONNX RotaryEmbedding, interleaved = 0): out[i] = x[i]·c[i] − x[i+h]·s[i],
// out[i+h] = x[i+h]·c[i] + x[i]·s[i] for i < h = D/2, each product and sum rounded to float32 (this file is built
// without FMA, so no contraction). `out` may not alias `x`.
void rotate_half(const float* x, const float* c, const float* s, int64_t h, float* out) {
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    out[i] = a * c[i] - b * s[i];
    out[i + h] = b * c[i] + a * s[i];
  }
}

// The step's rows written to the pools (keys rotated first when cos/sin are given) and, with cos/sin, the queries
// rotated into qrot: tokens [i·kRowsPerItem, …) per work item, items over ORT's threads (slots checked before).
struct RowWrite {
  const float *k, *v;
  int64_t kts, khs, vts, vhs;
  const float* q;
  int64_t qts, qhs;
  float* qrot;  // [T, Hq, D], or nullptr: no rotary
  const float *cos, *sin;
  const int64_t* slot;
  void *key_pool, *value_pool;
  KvType kv_type;
  int64_t q_heads, kv_heads, D, head_elems, T;
};
constexpr int64_t kRowsPerItem = 8;

void write_rows(void* data, size_t item) {
  const RowWrite& w = *static_cast<const RowWrite*>(data);
  const int64_t D = w.D, half = D / 2, t0 = static_cast<int64_t>(item) * kRowsPerItem;
  float krot[kMaxHeadDim];  // one rotated key row
  for (int64_t t = t0; t < std::min(w.T, t0 + kRowsPerItem); ++t) {
    const float* c = w.qrot ? w.cos + t * half : nullptr;
    const float* s = w.qrot ? w.sin + t * half : nullptr;
    for (int64_t g = 0; g < w.kv_heads; ++g) {
      const float* ks = w.k + t * w.kts + g * w.khs;
      const float* vs = w.v + t * w.vts + g * w.vhs;
      if (w.qrot) {
        rotate_half(ks, c, s, half, krot);
        ks = krot;
      }
      const int64_t at = (w.slot[t] * w.kv_heads + g) * w.head_elems;
      if (w.kv_type == KvType::kFloat32) {
        std::memcpy(static_cast<float*>(w.key_pool) + at, ks, D * sizeof(float));
        std::memcpy(static_cast<float*>(w.value_pool) + at, vs, D * sizeof(float));
      } else if (w.kv_type == KvType::kBfloat16) {
        uint16_t* kd = static_cast<uint16_t*>(w.key_pool) + at;
        uint16_t* vd = static_cast<uint16_t*>(w.value_pool) + at;
        for (int64_t d = 0; d < D; ++d) kd[d] = bf16_round(ks[d]), vd[d] = bf16_round(vs[d]);
      } else {
        pa_isa().quantize_kv_int8(ks, D, static_cast<int8_t*>(w.key_pool) + at);  // paged_attention_impl.h
        pa_isa().quantize_kv_int8(vs, D, static_cast<int8_t*>(w.value_pool) + at);
      }
    }
    if (w.qrot)
      for (int64_t h = 0; h < w.q_heads; ++h)
        rotate_half(w.q + t * w.qts + h * w.qhs, c, s, half, w.qrot + (t * w.q_heads + h) * D);
  }
}

OrtStatus* compute(const Kernel& K, OrtKernelContext* ctx) {
  size_t nin = 0;
  if (OrtStatus* s = g_api.KernelContext_GetInputCount(ctx, &nin)) return s;
  if (nin < 12 || nin > 14) return fail("expected 12 to 14 inputs, got " + std::to_string(nin));
  Tensor in[14];
  bool have[14] = {};
  for (size_t i = 0; i < nin; ++i) {
    const OrtValue* v = nullptr;
    if (OrtStatus* s = g_api.KernelContext_GetInput(ctx, i, &v)) return s;
    if (v == nullptr) continue;  // an omitted optional input
    have[i] = true;
    if (OrtStatus* s = describe(g_api, v, in[i])) return s;
  }
  const Tensor &q = in[0], &k = in[1], &v = in[2], &kc = in[3], &vc = in[4], &slots = in[5], &tables = in[6],
               &qidx = in[7], &tidx = in[8], &pos = in[9], &dtables = in[10], &dqidx = in[11], &cosc = in[12],
               &sinc = in[13];
  for (int i : {0, 3, 4, 5, 6, 7, 8, 9, 10, 11})
    if (!have[i]) return fail("input " + std::to_string(i) + " is required");
  if (have[1] != have[2]) return fail("k and v must be given together (or both omitted: q is the packed qkv)");
  if (have[12] != have[13]) return fail("cos_cache and sin_cache must be given together");
  const bool packed = !have[1], rotary = have[12];
  const int want_kv = K.kv_type == KvType::kBfloat16 ? kBfloat16 : K.kv_type == KvType::kInt8 ? kInt8 : kFloat;
  if (q.type != kFloat || (!packed && (k.type != kFloat || v.type != kFloat))) return fail("q, k and v must be float32");
  if (kc.type != want_kv || vc.type != want_kv) return fail("the KV pools have the wrong element type");
  for (int i = 5; i < 12; ++i)
    if (in[i].type != kInt64) return fail("input " + std::to_string(i) + " must be int64");
  int64_t T = 0, D = 0, qts = 0, qhs = 0, Tk = 0, Dk = 0, kts = 0, khs = 0, Tv = 0, Dv = 0, vts = 0, vhs = 0;
  const float *qdata = static_cast<const float*>(q.data), *kdata = nullptr, *vdata = nullptr;
  if (packed) {
    const int64_t heads = K.q_heads + 2 * K.kv_heads;
    if (!activation_layout(q, heads, T, D, qts, qhs) || q.dims.size() != 3)
      return fail("a packed q must be [1, T, (q_heads + 2*kv_heads)*D]");
    kts = vts = qts, khs = vhs = qhs;
    kdata = qdata + K.q_heads * D, vdata = qdata + (K.q_heads + K.kv_heads) * D;
  } else {
    if (!activation_layout(q, K.q_heads, T, D, qts, qhs)) return fail("q must be [1, q_heads, T, D] or [1, T, q_heads*D]");
    if (!activation_layout(k, K.kv_heads, Tk, Dk, kts, khs) || !activation_layout(v, K.kv_heads, Tv, Dv, vts, vhs) ||
        Tk != T || Tv != T || Dk != D || Dv != D)
      return fail("k and v must be [1, kv_heads, T, D] or [1, T, kv_heads*D] matching q");
    kdata = static_cast<const float*>(k.data), vdata = static_cast<const float*>(v.data);
  }
  if (std::find(std::begin(kHeadDims), std::end(kHeadDims), D) == std::end(kHeadDims))
    return fail("head_dim must be one of " + head_dims(", ") + ", got " + std::to_string(D));
  if (rotary && (cosc.type != kFloat || sinc.type != kFloat || cosc.numel() != T * (D / 2) ||
                 sinc.numel() != T * (D / 2) || cosc.dims.empty() || cosc.dims.back() != D / 2))
    return fail("cos_cache and sin_cache must be float32 [1, T, head_dim/2]");
  const int64_t head_elems = K.kv_type == KvType::kInt8 ? D + 4 : D;  // int8: the row's scale follows it
  if (kc.dims.size() != 3 || kc.dims[1] != K.kv_heads || kc.dims[2] != head_elems || vc.dims != kc.dims)
    return fail(K.kv_type == KvType::kInt8 ? "the int8 KV pools must be [num_slots, kv_heads, head_dim + 4]"
                                           : "the KV pools must be [num_slots, kv_heads, head_dim]");
  const int64_t S = kc.dims[0];
  if (S % K.block_size != 0) return fail("the pool's slot count is not a multiple of block_size");
  if (slots.numel() != T || tidx.numel() != T || pos.numel() != T)
    return fail("slot_mapping, token_index and position_ids must have one entry per token");
  if (tables.dims.size() != 2 || qidx.dims.size() != 2 || qidx.dims[0] != tables.dims[0] || dtables.dims.size() != 2 ||
      dqidx.dims.size() != 2 || dqidx.dims[0] != dtables.dims[0])
    return fail("block_tables/query_index (and their decode-group twins) must be 2-D with one row per sequence");

  OrtValue* outs[3];
  // o: q's shape, or [1, T, Hq*D] for a packed q (then token-major like it)
  const std::vector<int64_t> o_dims = packed ? std::vector<int64_t>{1, T, K.q_heads * D} : q.dims;
  const int64_t ots = packed ? K.q_heads * D : qts, ohs = packed ? D : qhs;
  if (OrtStatus* s = g_api.KernelContext_GetOutput(ctx, 0, o_dims.data(), o_dims.size(), &outs[0])) return s;
  if (OrtStatus* s = g_api.KernelContext_GetOutput(ctx, 1, kc.dims.data(), kc.dims.size(), &outs[1])) return s;
  if (OrtStatus* s = g_api.KernelContext_GetOutput(ctx, 2, vc.dims.data(), vc.dims.size(), &outs[2])) return s;
  void* out_data[3];
  for (int i = 0; i < 3; ++i)
    if (OrtStatus* s = g_api.GetTensorMutableData(outs[i], &out_data[i])) return s;

  // 1. the step's rows into the pools (the output pools; copied from the inputs first unless aliased)
  const size_t elem = K.kv_type == KvType::kFloat32 ? 4 : K.kv_type == KvType::kBfloat16 ? 2 : 1;
  const size_t pool_bytes = static_cast<size_t>(S) * K.kv_heads * head_elems * elem;
  if (out_data[1] != kc.data) std::memcpy(out_data[1], kc.data, pool_bytes);
  if (out_data[2] != vc.data) std::memcpy(out_data[2], vc.data, pool_bytes);
  const int64_t* slot = static_cast<const int64_t*>(slots.data);
  for (int64_t t = 0; t < T; ++t)
    if (slot[t] < 0 || slot[t] >= S) return fail("slot_mapping holds a slot outside the pool");
  thread_local std::vector<float> qrot;  // the rotated queries, token-major [T, Hq, D]; kept between calls
  if (rotary) qrot.resize(static_cast<size_t>(T * K.q_heads * D));
  RowWrite rw{kdata, vdata, kts, khs, vts, vhs, qdata, qts, qhs, rotary ? qrot.data() : nullptr,
              rotary ? static_cast<const float*>(cosc.data) : nullptr,
              rotary ? static_cast<const float*>(sinc.data) : nullptr, slot, out_data[1], out_data[2], K.kv_type,
              K.q_heads, K.kv_heads, D, head_elems, T};
  if (OrtStatus* s = run_items(g_api, ctx, &write_rows, items_of(T, kRowsPerItem), &rw)) return s;

  // 2. work items: each referenced query row, grouped by sequence, chunks of <= kMaxItemTokens
  const int64_t B = tables.dims[0], M = tables.dims[1], Q = qidx.dims[1], Bd = dtables.dims[0], Md = dtables.dims[1];
  const int64_t* tix = static_cast<const int64_t*>(tidx.data);
  std::vector<int32_t> tokens;
  std::vector<WorkItem> items;
  tokens.reserve(T);
  // a sequence's chunk items are listed latest first: they see the most keys, and ORT's threads take items in order
  // (one at a time), so the longest run first and the short ones even the threads out at the end
  auto add_rows = [&](const int64_t* rows, int64_t n, int64_t first_row, const int64_t* table, int64_t width) -> bool {
    const auto first_item = static_cast<std::ptrdiff_t>(items.size());
    int32_t start = static_cast<int32_t>(tokens.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = rows[i];
      if (t < 0 || t >= T) return false;
      if (tix[t] != first_row + i) continue;  // a padding row
      tokens.push_back(static_cast<int32_t>(t));
      if (static_cast<int32_t>(tokens.size()) - start == kMaxItemTokens) {
        items.push_back({table, width, start, kMaxItemTokens});
        start = static_cast<int32_t>(tokens.size());
      }
    }
    if (static_cast<int32_t>(tokens.size()) > start)
      items.push_back({table, width, start, static_cast<int32_t>(tokens.size()) - start});
    std::reverse(items.begin() + first_item, items.end());
    return true;
  };
  const int64_t* tb = static_cast<const int64_t*>(tables.data);
  const int64_t* qi = static_cast<const int64_t*>(qidx.data);
  for (int64_t b = 0; b < B; ++b)
    if (!add_rows(qi + b * Q, Q, b * Q, tb + b * M, M)) return fail("query_index holds a token outside the step");
  const int64_t* dtb = static_cast<const int64_t*>(dtables.data);
  const int64_t* dqi = static_cast<const int64_t*>(dqidx.data);
  for (int64_t d = 0; d < Bd; ++d)
    if (!add_rows(dqi + d, 1, B * Q + d, dtb + d * Md, Md)) return fail("decode_query_index holds a token outside the step");

  // 3. attention, items spread over ORT's intra-op threads
  PagedProblem P{};
  P.q = qdata, P.q_tok_stride = qts, P.q_head_stride = qhs;
  if (rotary) P.q = qrot.data(), P.q_tok_stride = K.q_heads * D, P.q_head_stride = D;
  P.o = static_cast<float*>(out_data[0]), P.o_tok_stride = ots, P.o_head_stride = ohs;
  P.key_pool = out_data[1], P.value_pool = out_data[2], P.kv_type = K.kv_type, P.num_slots = S;
  P.q_heads = static_cast<int>(K.q_heads), P.kv_heads = static_cast<int>(K.kv_heads), P.head_dim = static_cast<int>(D);
  P.block_size = static_cast<int>(K.block_size), P.scale = K.scale, P.window = K.window;
  P.positions = static_cast<const int64_t*>(pos.data);
  const std::vector<WorkItem> cascade =
      K.window == 0 ? plan_cascade(items, tokens, P.positions, K.block_size, static_cast<int32_t>(K.q_heads),
                                   static_cast<int32_t>(K.kv_heads))
                    : std::vector<WorkItem>{};
  P.tokens = tokens.data();
  // rows no item references (there are none in a well-formed step) read as zeros, never as garbage
  std::memset(P.o, 0, static_cast<size_t>(T) * K.q_heads * D * sizeof(float));
  Run run;
  run.problem = &P;
  if (!cascade.empty()) {  // the shared blocks first: the members' items start from the state they leave
    thread_local std::vector<float> partial;
    partial.resize(static_cast<size_t>(T) * K.q_heads * (D + 2));
    P.partial = partial.data();
    P.items = cascade.data(), P.num_items = cascade.size();
    if (OrtStatus* s = run_items(g_api, ctx, &run_item, cascade.size(), &run)) return s;
    if (const char* err = run.error.load()) return g_api.CreateStatus(kOrtInvalidArgument, err);
  }
  P.items = items.data(), P.num_items = items.size();
  if (OrtStatus* s = run_items(g_api, ctx, &run_item, items.size(), &run)) return s;
  if (const char* err = run.error.load()) return g_api.CreateStatus(kOrtInvalidArgument, err);
  return nullptr;
}

struct SwiGluRun {
  const float* in;
  float* out;
  int64_t rows, F, rows_per_item;
};

void run_swiglu_item(void* data, size_t i) {
  const SwiGluRun* r = static_cast<const SwiGluRun*>(data);
  const int64_t first = static_cast<int64_t>(i) * r->rows_per_item;
  const int64_t n = std::min(r->rows_per_item, r->rows - first);
  pa_isa().swiglu(r->in + first * 2 * r->F, r->out + first * r->F, n, r->F);
}

// SwiGLU(gate_up [..., 2F]) -> [..., F]: silu(gate_up[..., :F]) * gate_up[..., F:], rows over ORT's threads.
OrtStatus* compute_swiglu(OrtKernelContext* ctx) {
  const OrtValue* v = nullptr;
  if (OrtStatus* s = g_api.KernelContext_GetInput(ctx, 0, &v)) return s;
  Tensor x;
  if (OrtStatus* s = describe(g_api, v, x)) return s;
  if (x.type != kFloat || x.dims.empty() || x.dims.back() % 2 != 0)
    return g_api.CreateStatus(kOrtInvalidArgument, "SwiGLU: input must be float32 with an even last dimension");
  const int64_t F = x.dims.back() / 2;
  void* out_data = nullptr;
  if (OrtStatus* s = last_dim_output(g_api, ctx, 0, x, F, &out_data)) return s;
  SwiGluRun run{static_cast<const float*>(x.data), static_cast<float*>(out_data), F ? x.numel() / (2 * F) : 0, F, 0};
  run.rows_per_item = std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));  // ~64 KB of output per item
  return run_items(g_api, ctx, &run_swiglu_item, items_of(run.rows, run.rows_per_item), &run);
}

struct AddRmsNormRun {
  const float *a, *b, *w;
  float eps;
  float *y, *sum;
  int64_t rows, H, rows_per_item;
};

void run_add_rms_norm_item(void* data, size_t i) {
  const AddRmsNormRun* r = static_cast<const AddRmsNormRun*>(data);
  const int64_t first = static_cast<int64_t>(i) * r->rows_per_item;
  const int64_t n = std::min(r->rows_per_item, r->rows - first);
  pa_isa().add_rms_norm(r->a + first * r->H, r->b + first * r->H, r->w, r->eps, r->y + first * r->H,
                        r->sum + first * r->H, n, r->H);
}

// AddRMSNorm(a, b, weight [H]; epsilon) -> (y, sum), a and b of one shape [..., H]: sum = a + b, y = RMSNorm(sum) ·
// weight (ORT's SkipSimplifiedLayerNormalization outputs 0 and 3, without its skip broadcasting); rows over ORT's
// threads.
OrtStatus* compute_add_rms_norm(const Kernel& K, OrtKernelContext* ctx) {
  Tensor in[3];
  bool have[3] = {false, false, false};
  if (OrtStatus* s = read_inputs(g_api, ctx, 3, in, have)) return s;
  if (!have[0] || !have[1] || !have[2])
    return g_api.CreateStatus(kOrtInvalidArgument, "AddRMSNorm: a, b and weight are required");
  const Tensor &a = in[0], &b = in[1], &w = in[2];
  if (a.type != kFloat || b.type != kFloat || w.type != kFloat)
    return g_api.CreateStatus(kOrtInvalidArgument, "AddRMSNorm: a, b and weight must be float32");
  if (a.dims.empty() || a.dims != b.dims)
    return g_api.CreateStatus(kOrtInvalidArgument, "AddRMSNorm: a and b must have one shape [..., H]");
  const int64_t H = a.dims.back();
  if (w.dims != std::vector<int64_t>{H})
    return g_api.CreateStatus(kOrtInvalidArgument, "AddRMSNorm: weight must be [H], H the last dimension of a");
  void *y = nullptr, *sum = nullptr;
  if (OrtStatus* s = last_dim_output(g_api, ctx, 0, a, H, &y)) return s;
  if (OrtStatus* s = last_dim_output(g_api, ctx, 1, a, H, &sum)) return s;
  AddRmsNormRun run{static_cast<const float*>(a.data), static_cast<const float*>(b.data),
                    static_cast<const float*>(w.data), K.epsilon, static_cast<float*>(y), static_cast<float*>(sum),
                    H ? a.numel() / H : 0, H, 0};
  run.rows_per_item = std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1));  // ~32 KB of a row block per item
  return run_items(g_api, ctx, &run_add_rms_norm_item, items_of(run.rows, run.rows_per_item), &run);
}

// ---- the OrtCustomOp tables ----

struct Op {
  OrtCustomOp base;  // first member: ORT's OrtCustomOp* is a pointer to this
  const char* name;
  OpKind kind;
  KvType kv_type;
};

const Op* as_op(const OrtCustomOp* op) { return reinterpret_cast<const Op*>(op); }

OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** out) {
  Kernel* k = new (std::nothrow) Kernel{};
  if (!k) return g_api.CreateStatus(kOrtFail, "PagedAttention: out of memory");
  k->kind = as_op(op)->kind;
  k->kv_type = as_op(op)->kv_type;
  if (k->kind == OpKind::kSwiGlu || k->kind == OpKind::kLoraAdd) {  // no attributes
    *out = k;
    return nullptr;
  }
  if (is_moe(k->kind)) {
    if (OrtStatus* s = read_moe_attrs(g_api, info, moe_weights(k->kind), k->moe)) {
      delete k;
      return s;
    }
    *out = k;
    return nullptr;
  }
  if (k->kind == OpKind::kAddRmsNorm) {
    OrtStatus* s = g_api.KernelInfoGetAttribute_float(info, "epsilon", &k->epsilon);
    if (!s && !(k->epsilon >= 0.0f)) s = g_api.CreateStatus(kOrtInvalidArgument, "AddRMSNorm: epsilon must be >= 0");
    if (s) {
      delete k;
      return s;
    }
    *out = k;
    return nullptr;
  }
  if (k->kind == OpKind::kMatMulQ || k->kind == OpKind::kMatMulQBF16 || k->kind == OpKind::kMatMulBF16 ||
      k->kind == OpKind::kMatMulF32) {
    OrtStatus* s = k->kind == OpKind::kMatMulBF16  ? read_matmul_bf16_attrs(g_api, info, k->gemm)
                   : k->kind == OpKind::kMatMulF32 ? read_matmul_f32_attrs(g_api, info, k->gemm)
                                                   : read_matmul_q_attrs(g_api, info, as_op(op)->name, k->gemm);
    if (s) {
      delete k;
      return s;
    }
    *out = k;
    return nullptr;
  }
  OrtStatus* s = g_api.KernelInfoGetAttribute_int64(info, "q_heads", &k->q_heads);
  if (!s) s = g_api.KernelInfoGetAttribute_int64(info, "kv_heads", &k->kv_heads);
  if (!s) s = g_api.KernelInfoGetAttribute_int64(info, "block_size", &k->block_size);
  if (!s) s = g_api.KernelInfoGetAttribute_float(info, "scale", &k->scale);
  if (!s) {
    OrtStatus* w = g_api.KernelInfoGetAttribute_int64(info, "window", &k->window);
    if (w) g_api.ReleaseStatus(w), k->window = 0;  // optional
  }
  if (!s && (k->q_heads <= 0 || k->kv_heads <= 0 || k->q_heads % k->kv_heads != 0))
    s = g_api.CreateStatus(kOrtInvalidArgument, "PagedAttention: q_heads must be a positive multiple of kv_heads");
  if (!s && k->block_size <= 0) s = g_api.CreateStatus(kOrtInvalidArgument, "PagedAttention: block_size must be positive");
  if (!s && k->window < 0) s = g_api.CreateStatus(kOrtInvalidArgument, "PagedAttention: window must be >= 0");
  if (s) {
    delete k;
    return s;
  }
  *out = k;
  return nullptr;
}

OrtStatus* kernel_compute(void* kernel, OrtKernelContext* ctx) {
  try {
    const Kernel& k = *static_cast<Kernel*>(kernel);
    if (k.kind == OpKind::kMatMulQ) return compute_matmul_q(g_api, k.gemm, ctx);
    if (k.kind == OpKind::kMatMulQBF16) return compute_matmul_qbf16(g_api, k.gemm, ctx);
    if (k.kind == OpKind::kMatMulBF16) return compute_matmul_bf16(g_api, k.gemm, ctx);
    if (k.kind == OpKind::kMatMulF32) return compute_matmul_f32(g_api, k.gemm, ctx);
    if (k.kind == OpKind::kAddRmsNorm) return compute_add_rms_norm(k, ctx);
    if (k.kind == OpKind::kLoraAdd) return compute_lora_add(g_api, ctx);
    if (is_moe(k.kind)) return compute_moe(g_api, k.moe, ctx);
    return k.kind == OpKind::kSwiGlu ? compute_swiglu(ctx) : compute(k, ctx);
  } catch (const std::bad_alloc&) {
    return g_api.CreateStatus(kOrtFail, "PagedAttention: out of memory");
  }
}

void kernel_destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }
const char* op_name(const OrtCustomOp* op) { return as_op(op)->name; }
const char* op_ep(const OrtCustomOp*) { return "CPUExecutionProvider"; }
size_t input_count(const OrtCustomOp* op) {
  const OpKind kind = as_op(op)->kind;
  if (is_moe(kind)) return moe_input_count(moe_weights(kind));
  if (kind == OpKind::kMatMulQ || kind == OpKind::kMatMulQBF16) return 4;
  if (kind == OpKind::kAddRmsNorm) return 3;
  if (kind == OpKind::kLoraAdd) return 5;
  return kind == OpKind::kSwiGlu ? 1 : kind == OpKind::kMatMulBF16 || kind == OpKind::kMatMulF32 ? 2 : 14;
}
size_t output_count(const OrtCustomOp* op) {
  const OpKind kind = as_op(op)->kind;
  return kind == OpKind::kPagedAttention ? 3 : kind == OpKind::kAddRmsNorm ? 2 : 1;
}
int input_type(const OrtCustomOp* op, size_t i) {
  if (is_moe(as_op(op)->kind)) return moe_input_type(moe_weights(as_op(op)->kind), i);
  if (as_op(op)->kind == OpKind::kMatMulQ || as_op(op)->kind == OpKind::kMatMulQBF16)
    return i == 1 ? kUint8 : i == 2 ? kFloat16 : kFloat;  // codes, float16 scales (panel16 layout 2)
  // MatMulBF16's panels: uint16 or bfloat16 (the same bits; compute_matmul_bf16 checks), so a graph may also
  // gather a tied embedding's rows from them with ONNX ops and Cast them to float
  if (as_op(op)->kind == OpKind::kMatMulBF16) return i == 1 ? kUndefined : kFloat;
  if (as_op(op)->kind == OpKind::kLoraAdd) return i == 4 ? kInt64 : kFloat;
  if (i <= 2 || i >= 12 || as_op(op)->kind == OpKind::kSwiGlu || as_op(op)->kind == OpKind::kAddRmsNorm ||
      as_op(op)->kind == OpKind::kMatMulF32)
    return kFloat;
  if (i <= 4) {
    switch (as_op(op)->kv_type) {
      case KvType::kBfloat16: return kBfloat16;
      case KvType::kInt8: return kInt8;
      default: return kFloat;
    }
  }
  return kInt64;
}
int output_type(const OrtCustomOp* op, size_t i) { return i == 0 ? kFloat : input_type(op, 3); }
int required(const OrtCustomOp*, size_t) { return 0; }
int input_required(const OrtCustomOp* op, size_t i) {  // 1: optional (MatMulQ's and MatMulQBF16's offsets;
  const OpKind kind = as_op(op)->kind;                   // PagedAttention's k, v and cos/sin caches)
  if (kind == OpKind::kMatMulQ || kind == OpKind::kMatMulQBF16) return i == 3 ? 1 : 0;
  if (is_moe(kind)) return moe_input_optional(moe_weights(kind), i) ? 1 : 0;  // MoEQ's offsets
  return kind == OpKind::kPagedAttention && (i == 1 || i == 2 || i >= 12) ? 1 : 0;
}
int mem_default(const OrtCustomOp*, size_t) { return 0; }
int one(const OrtCustomOp*) { return 1; }

Op make_op(const char* name, OpKind kind, KvType kv) {
  Op op{};
  OrtCustomOp& b = op.base;
  b.version = ort::kApiVersion;
  b.CreateKernel = nullptr;  // the V2 entry points are used (ORT >= 1.16 prefers them when set)
  b.GetName = op_name;
  b.GetExecutionProviderType = op_ep;
  b.GetInputType = input_type;
  b.GetInputTypeCount = input_count;
  b.GetOutputType = output_type;
  b.GetOutputTypeCount = output_count;
  b.KernelCompute = nullptr;
  b.KernelDestroy = kernel_destroy;
  b.GetInputCharacteristic = input_required;
  b.GetOutputCharacteristic = required;
  b.GetInputMemoryType = mem_default;
  b.GetVariadicInputMinArity = one;
  b.GetVariadicInputHomogeneity = one;
  b.GetVariadicOutputMinArity = one;
  b.GetVariadicOutputHomogeneity = one;
  b.CreateKernelV2 = create_kernel;
  b.KernelComputeV2 = kernel_compute;
  b.InferOutputShapeFn = nullptr;
  b.GetStartVersion = one;
  b.GetEndVersion = nullptr;  // no upper bound
  op.name = name;
  op.kind = kind;
  op.kv_type = kv;
  return op;
}

Op g_ops[] = {make_op("PagedAttention", OpKind::kPagedAttention, KvType::kFloat32),
              make_op("PagedAttentionBF16", OpKind::kPagedAttention, KvType::kBfloat16),
              make_op("PagedAttentionInt8", OpKind::kPagedAttention, KvType::kInt8),
              make_op("SwiGLU", OpKind::kSwiGlu, KvType::kFloat32),
              make_op("AddRMSNorm", OpKind::kAddRmsNorm, KvType::kFloat32),
              make_op("MatMulQ", OpKind::kMatMulQ, KvType::kFloat32),
              make_op("MatMulQBF16", OpKind::kMatMulQBF16, KvType::kFloat32),
              make_op("MatMulBF16", OpKind::kMatMulBF16, KvType::kFloat32),
              make_op("MatMulF32", OpKind::kMatMulF32, KvType::kFloat32),
              make_op("LoraAdd", OpKind::kLoraAdd, KvType::kFloat32),
              make_op("MoEF32", OpKind::kMoEF32, KvType::kFloat32),
              make_op("MoEBF16", OpKind::kMoEBF16, KvType::kFloat32),
              make_op("MoEQ", OpKind::kMoEQ, KvType::kFloat32)};

}  // namespace
}  // namespace omf

OMF_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(omf::ort::kApiVersion);
  if (!api) return nullptr;  // ORT < 1.17: nothing registered; the loader reports it (see kernels/__init__.py)
  omf::g_api.table = reinterpret_cast<const void* const*>(api);
  OrtCustomOpDomain* domain = nullptr;  // intentionally never released: sessions may outlive any scope here
  if (OrtStatus* s = omf::g_api.CreateCustomOpDomain(omf::kDomain, &domain)) return s;
  for (auto& op : omf::g_ops)
    if (OrtStatus* s = omf::g_api.CustomOpDomain_Add(domain, &op.base)) return s;
  return omf::g_api.AddCustomOpDomain(options, domain);
}

// "abi=<n> isa=<path> gemm=<path> bf16=<path> qbf16=<path> f32=<path> lora=<path> moe_f32=<path> layout=<n>
// head_dims=<d>,<d>… domain=<domain>": what `omforge doctor` and the manifest report (qbf16: MatMulQBF16's path, the
// bf16 one; its presence says the library has the op; f32: MatMulF32's; lora: LoraAdd's; moe_f32: MoEF32's GEMMs,
// MoEBF16's and MoEQ's being bf16's and gemm's; head_dims: PagedAttention's kHeadDims).
OMF_EXPORT const char* omforge_kernels_info() {
  static std::string info = "abi=" + std::to_string(omf::kAbiVersion) + " isa=" + omf::pa_isa().name +
                            " gemm=" + omf::gemm_isa().name + " bf16=" + omf::bf16_isa().name +
                            " qbf16=" + omf::bf16_isa().name +
                            " f32=" + omf::f32_isa().name + " lora=" + omf::lora_isa().name +
                            " moe_f32=" + omf::moe_f32_path() +
                            " layout=" + std::to_string(omf::kPanelLayout) +
                            " head_dims=" + omf::head_dims(",") +
                            " domain=" + omf::kDomain;
  return info.c_str();
}
