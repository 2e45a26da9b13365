// LoraAdd's ORT side (the contract: lora.h): checks, the tokens grouped by slot, then two passes of work items over
// ORT's intra-op threads — (1) each slot's H rows (shrink, 16 tokens an item) and, for a slot with many tokens, B_s
// transposed (256 columns an item); (2) y' rows: slot-0 rows copied, each slot's rows y + H · B_sᵀ (32 tokens × 256
// columns an item).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "lora.h"
#include "ort_tensor.h"

namespace omf {
namespace {

constexpr int64_t kShrinkTokens = 16, kExpandTokens = 32, kCopyTokens = 64;
constexpr int64_t kOutChunk = 256;  // columns an expand item covers: a multiple of every path's row tile width
// a slot with this many tokens or more has B_s transposed for the row tiles; fewer read B_s as it is (dot tiles).
// The transposition moves out · PR floats once; a dot tile pays a transposed reduction per W outputs. Measured at
// in 576, out 960, PR 48 on AVX2, one thread: 8 tokens a slot 36 µs (dot) vs 56 (transposed), 32 tokens 135 vs 117
// — even near 20.
constexpr int64_t kTransposeTokens = 20;

OrtStatus* fail(const ort::Api& api, const std::string& msg) {
  return api.CreateStatus(kOrtInvalidArgument, ("LoraAdd: " + msg).c_str());
}

std::string shape(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// [..., T, last] with every leading dim 1
bool token_rows(const Tensor& t, int64_t& tokens, int64_t& last) {
  if (t.dims.size() < 2) return false;
  for (size_t i = 0; i + 2 < t.dims.size(); ++i)
    if (t.dims[i] != 1) return false;
  tokens = t.dims[t.dims.size() - 2], last = t.dims.back();
  return true;
}

enum class ItemKind { kShrink, kTranspose, kExpand, kCopy };

struct Item {
  ItemKind kind;
  int32_t group;
  int64_t begin, count;  // positions in order[] (kTranspose: columns)
  int64_t o0, o1;        // kExpand's columns
};

struct LoraRun {
  LoraProblem P;
  const std::vector<LoraGroup>* groups;
  const std::vector<Item>* items;
};

void transpose(const LoraProblem& P, const LoraGroup& g, int64_t o0, int64_t o1) {
  const float* b = P.b + g.slot * P.out_dim * P.pr;
  constexpr int64_t kBlock = 16;  // 16 rows of B_s (one cache line of Bt per r)
  for (int64_t ob = o0; ob < o1; ob += kBlock) {
    const int64_t oe = std::min(ob + kBlock, o1);
    for (int64_t r = 0; r < P.pr; ++r) {
      float* dst = g.bt + r * g.ldbt;
      for (int64_t o = ob; o < oe; ++o) dst[o] = o < P.out_dim ? b[o * P.pr + r] : 0.0f;
    }
  }
}

void run_item(void* data, size_t i) {
  const LoraRun& run = *static_cast<const LoraRun*>(data);
  const Item& it = (*run.items)[i];
  const LoraProblem& P = run.P;
  switch (it.kind) {
    case ItemKind::kShrink: lora_isa().shrink(P, (*run.groups)[it.group], it.begin, it.count); break;
    case ItemKind::kTranspose: transpose(P, (*run.groups)[it.group], it.begin, it.begin + it.count); break;
    case ItemKind::kExpand: lora_isa().expand(P, (*run.groups)[it.group], it.begin, it.count, it.o0, it.o1); break;
    case ItemKind::kCopy:
      for (int64_t k = it.begin; k < it.begin + it.count; ++k) {
        const int64_t t = P.order[k];
        std::memcpy(P.out + t * P.out_dim, P.y + t * P.out_dim, P.out_dim * sizeof(float));
      }
      break;
  }
}

}  // namespace

// AVX-512F, AVX2 + FMA, portable; chosen at the first call
const LoraIsa& lora_isa() {
  using namespace isa;
  static const Candidate<LoraIsa> kPaths[] = {
#if OMF_ISA_X86
      {kAuto | kAvx512, [] { return cpu().avx512f; }, {"avx512", &avx512::lora_shrink, &avx512::lora_expand}},
      {kAuto | kAvx512 | kAvx2, [] { return cpu().avx2 && cpu().fma; },
       {"avx2", &avx2::lora_shrink, &avx2::lora_expand}},
#endif
      {kAny, always, {"generic", &generic::lora_shrink, &generic::lora_expand}}};
  static const LoraIsa chosen = choose(kPaths);
  return chosen;
}

OrtStatus* compute_lora_add(const ort::Api& api, OrtKernelContext* ctx) {
  Tensor in[5];
  bool have[5] = {};
  if (OrtStatus* s = read_inputs(api, ctx, 5, in, have)) return s;
  for (int i = 0; i < 5; ++i)
    if (!have[i]) return fail(api, "input " + std::to_string(i) + " is required (y, x, lora_a, lora_b, lora_slots)");
  const Tensor &y = in[0], &x = in[1], &a = in[2], &b = in[3], &slots = in[4];
  if (y.type != kFloat || x.type != kFloat || a.type != kFloat || b.type != kFloat)
    return fail(api, "y, x, lora_a and lora_b must be float32");
  if (slots.type != kInt64) return fail(api, "lora_slots must be int64");
  int64_t T = 0, N = 0, Tx = 0, K = 0;
  if (!token_rows(y, T, N)) return fail(api, "y must be [..., T, out] with leading dims 1, got " + shape(y.dims));
  if (!token_rows(x, Tx, K) || Tx != T)
    return fail(api, "x must be [..., T, in] with leading dims 1 and y's T = " + std::to_string(T) + ", got " +
                         shape(x.dims));
  if (a.dims.size() != 3 || a.dims[2] != K || a.dims[0] < 1)
    return fail(api, "lora_a must be [S, PR, in] with in = " + std::to_string(K) + ", got " + shape(a.dims));
  const int64_t S = a.dims[0], PR = a.dims[1];
  if (b.dims != std::vector<int64_t>{S, N, PR})
    return fail(api, "lora_b must be [S, out, PR] = " + shape({S, N, PR}) + " (lora_a's S and PR, y's out), got " +
                         shape(b.dims));
  if (!((slots.dims.size() == 1 && slots.dims[0] == T) ||
        (slots.dims.size() == 2 && slots.dims[0] == 1 && slots.dims[1] == T)))
    return fail(api, "lora_slots must be [1, T] or [T] with T = " + std::to_string(T) + ", got " + shape(slots.dims));
  const int64_t* slot = static_cast<const int64_t*>(slots.data);
  std::vector<int64_t> counts(S + 1, 0);  // counts[s + 1]: tokens of slot s, then prefix sums
  for (int64_t t = 0; t < T; ++t) {
    if (slot[t] < 0 || slot[t] >= S)
      return fail(api, "lora_slots[" + std::to_string(t) + "] = " + std::to_string(slot[t]) +
                           " is outside the pool's slots [0, " + std::to_string(S) + ")");
    ++counts[slot[t] + 1];
  }

  OrtValue* out_value = nullptr;
  void* out = nullptr;
  if (OrtStatus* s = api.KernelContext_GetOutput(ctx, 0, y.dims.data(), y.dims.size(), &out_value)) return s;
  if (OrtStatus* s = api.GetTensorMutableData(out_value, &out)) return s;
  const size_t bytes = static_cast<size_t>(T * N) * sizeof(float);
  if (counts[1] == T || PR == 0) {  // the base model only (or no rank): y as it is
    if (out != y.data && bytes) std::memcpy(out, y.data, bytes);
    return nullptr;
  }

  for (int64_t s = 0; s < S; ++s) counts[s + 1] += counts[s];  // counts[s]: where slot s starts in order[]
  std::vector<int32_t> order(T);
  std::vector<int64_t> next(counts.begin(), counts.end() - 1);
  for (int64_t t = 0; t < T; ++t) order[next[slot[t]]++] = static_cast<int32_t>(t);

  const int64_t ldbt = (N + 63) / 64 * 64;
  std::vector<LoraGroup> groups;
  int64_t transposed = 0;
  for (int64_t s = 1; s < S; ++s) {
    const int64_t n = counts[s + 1] - counts[s];
    if (n == 0) continue;
    groups.push_back({s, counts[s], n, nullptr, ldbt});
    if (n >= kTransposeTokens) ++transposed;
  }
  std::vector<float> h(static_cast<size_t>(T * PR));
  std::vector<float> bt(static_cast<size_t>(transposed * PR * ldbt));
  for (int64_t g = 0, k = 0; g < static_cast<int64_t>(groups.size()); ++g)
    if (groups[g].count >= kTransposeTokens) groups[g].bt = bt.data() + (k++) * PR * ldbt;

  std::vector<Item> pass1, pass2;
  for (int32_t g = 0; g < static_cast<int32_t>(groups.size()); ++g) {
    const LoraGroup& G = groups[g];
    for (int64_t i = 0; i < G.count; i += kShrinkTokens)
      pass1.push_back({ItemKind::kShrink, g, G.begin + i, std::min(kShrinkTokens, G.count - i), 0, 0});
    if (G.bt)
      for (int64_t o = 0; o < ldbt; o += kOutChunk)
        pass1.push_back({ItemKind::kTranspose, g, o, std::min(kOutChunk, ldbt - o), 0, 0});
    for (int64_t i = 0; i < G.count; i += kExpandTokens)
      for (int64_t o = 0; o < N; o += kOutChunk)
        pass2.push_back({ItemKind::kExpand, g, G.begin + i, std::min(kExpandTokens, G.count - i), o,
                         std::min(N, o + kOutChunk)});
  }
  for (int64_t i = 0; i < counts[1]; i += kCopyTokens)
    pass2.push_back({ItemKind::kCopy, -1, i, std::min(kCopyTokens, counts[1] - i), 0, 0});

  LoraRun run{{static_cast<const float*>(y.data), static_cast<const float*>(x.data),
               static_cast<const float*>(a.data), static_cast<const float*>(b.data), static_cast<float*>(out), K, N,
               PR, order.data(), h.data()},
              &groups, &pass1};
  if (OrtStatus* s = run_items(api, ctx, &run_item, pass1.size(), &run)) return s;
  run.items = &pass2;
  return run_items(api, ctx, &run_item, pass2.size(), &run);
}

}  // namespace omf
