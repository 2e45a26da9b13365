// The PagedAttention kernel, written once over an ISA traits struct `Vec` (defined by the including
// pa_<isa>.cpp inside namespace omf::<isa>, before this header is included there).
//
// Vec: W lanes; V zero(); V set1(float); V load(const float*); void store(float*, V); V fma(a, b, c) = a*b+c;
// V max(V, V); float hsum(V); float hmax(V); V round_nearest(V); V scale_pow2(V y, V n) (y * 2^n);
// V reduce_rows(const V v[W]) (lane i = the sum of the lanes of v[i]);
// V load_kv(const float* | const uint16_t* | const int8_t*) (fp32, bf16 widened, int8 converted, unscaled);
// VI: W int32 lanes; VI izero(); VK widen_i8(const int8_t* k) (2W keys as int16); VI dot_i16_k(VI acc, const
// int16_t* q, VK k) (lane i += q[2i]k[2i] + q[2i+1]k[2i+1] over 2W elements, exact); V reduce_rows_i(const VI v[W])
// (lane i = float of the exact int sum of v[i]); P·V in integers (pv_tile_i16): void to_i16(const float* s, float inv,
// int16_t* out) (W values rounded to nearest of s·inv); void interleave_pair(const int8_t* a, const int8_t* b, VK& lo,
// VK& hi) (2W values of rows a and b widened, pairs (a[d], b[d]) split over lo and hi in an order of the ISA's
// choosing); VI dot_pair(VI acc, VK v, int32_t pp) (lane += a·p0 + b·p1, pp the int16 pair, exact); void
// add_pairs(float* out, VI lo, VI hi, float s) (out[d] += float(sum of d)·s for the 2W d of one interleave_pair, in
// d order); (scalar conversions: omf::kv_to_float). Optional (a Vec with them scores bfloat16 pools' tile path in
// bfloat16 dot products, kBf16Dot): VB, W bfloat16 pairs in 32-bit lanes; VB load_pairs(const uint32_t*); VB
// broadcast_pair(const uint16_t* | const uint32_t*); V dot_bf16(V acc, VB a, VB b) (lane += a.lo·b.lo + a.hi·b.hi);
// void store_pairs(uint32_t* out, V lo, V hi) (W pairs (bf16(lo[i]), bf16(hi[i])), nearest even); void
// store_row_pairs(uint32_t* out, const uint16_t* a, const uint16_t* b) (W pairs (a[i], b[i]); b nullptr: 0). It is
// included inside a namespace, so it includes nothing itself (paged_attention.h brings the standard headers).
//
// Algorithm (one work item = one sequence's query tokens, <= kMaxItemTokens): online softmax over the
// sequence's blocks in order; a block no query of the item can see is never touched; within a block, keys
// hidden from a query (position after it, or outside the sliding window) score -inf. Two shapes:
//  - few query rows (decodes; with int8 pools also speculative verification and short chunks: kRowPathRows): "row"
//    path, every slot row of a block read whole (all KV heads at once):
//    dot products per (row, head), P·V accumulated per head; the next block's rows prefetched; int8 pools score
//    in integers (each query row rounded once to int16, exact int32 dots with the int8 keys: score_group_i8, each
//    key row widened once for all the query rows of its KV head), and P·V too (each row's probabilities, value
//    scales folded in, rounded to int16 per block: pv_tile_i16, two keys per vpmaddwd);
//  - many rows (prefill chunks): "tile" path (attend_lanes), per KV head with the query rows in vector lanes: scores
//    and P·V as broadcast-FMA register tiles, the online softmax vertical (no horizontal reduction per row and
//    block). It replaced a per-row layout (keys transposed per block, each row's softmax reduced horizontally) that
//    ran SmolLM2's 512-token prefill chunks at ~110 GFLOP/s on the Zen 4 VM (bench_attention.py --prefill).
//    bfloat16 pools on a CPU with bfloat16 dot products (kBf16Dot: pa_avx512bf16.cpp) score and sum P·V there in
//    vdpbf16ps, two products per lane and instruction: each query row (times the scale) and each block's
//    probabilities rounded to bfloat16 (nearest even), the keys and values as stored, float32 sums; the softmax
//    (maxima, exp, the sum l of the unrounded probabilities) stays float32. As flash attention rounds P for its P·V.
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Scratch {
  std::vector<float> q, s, acc, m, l, kt, scale, vscale, qscale, posf;
  std::vector<int16_t> q16, p16;
  std::vector<uint32_t> q2, v2, p2;  // the bfloat16 tile path's pairs: queries, a block's values, its probabilities
  std::vector<float> pscale;
  std::vector<int64_t> pos;
  std::vector<const float*> qrow;
};

static Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A head's row in the pool: D elements, and for int8 the row's float scale in the 4 bytes after them.
template <typename KV, int D>
constexpr int64_t head_elems() { return std::is_same<KV, int8_t>::value ? D + 4 : D; }

template <typename KV, int D>
static inline float row_scale(const KV* head_row) {
  if constexpr (std::is_same<KV, int8_t>::value) {
    float s;
    std::memcpy(&s, head_row + D, sizeof s);
    return s;
  } else {
    return 1.0f;
  }
}

// int8 pools: the scales of n consecutive slot rows, per head: out[g * ld + j] (resized as needed).
template <typename KV, int D>
static inline void gather_scales(const KV* rows, int64_t row_stride, int64_t n, int heads, int64_t HE, int64_t ld,
                                 std::vector<float>& out) {
  if (out.size() < static_cast<size_t>(heads * ld)) out.resize(heads * ld);
  for (int g = 0; g < heads; ++g)
    for (int64_t j = 0; j < n; ++j) out[g * ld + j] = row_scale<KV, D>(rows + j * row_stride + g * HE);
}

// exp of every lane (Cephes-style: 2^n * p(r), r = x - n ln2; |rel err| < 2e-7 on [-87, 0]); below -87.3, where
// exp underflows to ~1e-38, exactly 0 (a masked key's probability: ~1e-38 times an int8 value scale is a denormal,
// and every later product with it costs a microcode assist on Intel cores: int8 prefill attention ran 5× slower).
static inline typename Vec::V vexp(typename Vec::V x) {
  using V = typename Vec::V;
  const V keep = Vec::add(x, Vec::set1(87.3f));  // >= 0 where exp is a normal number
  x = Vec::max(x, Vec::set1(-87.3f));
  const V n = Vec::round_nearest(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  V r = Vec::fma(n, Vec::set1(-0.693359375f), x);
  r = Vec::fma(n, Vec::set1(2.12194440e-4f), r);
  V y = Vec::set1(1.9875691500e-4f);
  y = Vec::fma(y, r, Vec::set1(1.3981999507e-3f));
  y = Vec::fma(y, r, Vec::set1(8.3334519073e-3f));
  y = Vec::fma(y, r, Vec::set1(4.1665795894e-2f));
  y = Vec::fma(y, r, Vec::set1(1.6666665459e-1f));
  y = Vec::fma(y, r, Vec::set1(5.0000001201e-1f));
  y = Vec::fma(y, Vec::mul(r, r), Vec::add(r, Vec::set1(1.0f)));
  return Vec::select_positive(keep, Vec::scale_pow2(y, n), Vec::zero());
}

// The cache lines of one contiguous region, prefetched a few per call of pump() so that the loads overlap the
// compute issued between the calls (a burst of prefetches stalls on the core's few line-fill buffers). Into L2
// (prefetcht2), not L1: on the Zen 4 VM the int8 decode benchmark read 15–25% faster so (bench_attention.py, 30
// layers: b64 c192 474–496 -> 362–372 µs, b16 c2048 1030–1135 -> 762–811 µs), the L1 left to the rows in use.
struct PrefetchPump {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per_call = 0;
  // the region [base, base + bytes), spread over `calls` calls of pump()
  void start(const void* base, int64_t bytes, int64_t calls) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(base);
    p = reinterpret_cast<const char*>(a & ~uintptr_t{63});
    end = static_cast<const char*>(base) + std::max<int64_t>(bytes, 0);
    const int64_t lines = (end - p + 63) / 64;
    per_call = calls > 0 ? (lines + calls - 1) / calls : lines;
  }
  void pump() {
    for (int64_t i = 0; i < per_call && p < end; ++i, p += 64) __builtin_prefetch(p, 0, 1);
  }
  void drain() {
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 1);
  }
};

// Scores of one query row (q scaled, D floats) against m <= W key rows of one head (kbase + j * row_stride):
// one FMA chain per key row, then the W partial vectors reduced together (Vec::reduce_rows: lane i = the sum
// of vector i), far fewer shuffles than a horizontal sum per key. Writes s[0 .. W).
template <int D, typename KV>
static inline void score_chunk(const float* q, const KV* kbase, int64_t row_stride, int64_t m, float* s) {
  constexpr int NV = D / Vec::W;
  typename Vec::V part[Vec::W];
  for (int jj = 0; jj < Vec::W; ++jj) {
    if (jj >= m) {
      part[jj] = Vec::zero();
      continue;
    }
    const KV* k = kbase + jj * row_stride;
    typename Vec::V a = Vec::mul(Vec::load(q), Vec::load_kv(k));
    for (int i = 1; i < NV; ++i) a = Vec::fma(Vec::load(q + i * Vec::W), Vec::load_kv(k + i * Vec::W), a);
    part[jj] = a;
  }
  Vec::store(s, Vec::reduce_rows(part));
}

// int8 pools, decode rows: scores in integers. Each query row is rounded once to int16 with its own scale (its
// largest |element| -> 32767); a key row's dot product is summed exactly in int32 (|sum| <= 32767 * 127 * D < 2^31
// for D <= 256) and only then made float and scaled by the query's and the key's scales. The sums are exact, so
// every ISA path computes the same scores; one key row is widened once per query row instead of converted to float.
template <int D>
constexpr bool kIntScores = D % 32 == 0;  // the same head sizes on every path (2W divides 32 for W = 4, 8, 16)

// The G query rows of one KV head (q: G rows D apart, qscale their scales; s: G rows lds apart) against m <= W of
// its key rows: each key row is widened to int16 once and used by all G rows (GQA), not once per query row; each
// score is float(exact dot) · (key scale · query scale), the key scales read from the rows just loaded.
constexpr int kMaxGroupRows = 8;  // a KV head's query rows per token (G) on the integer row path

// An item takes the row path up to this many query rows (tokens × q heads per KV head), the tile path beyond. int8
// pools' integer row path wins further: a step of 8 sequences × k tokens at context 500 (int4 + int8 KV, Zen 4)
// took, row path up to 8 rows → up to 24: k = 5 41.8 / 42.1 → 35.2 / 34.5 ms, k = 8 69.2 / 58.5 → 49.4 / 49.9;
// k = 16 and 32 gained nothing from the row path (the tile path's register blocking pays there).
constexpr int kRowPathRows = 8;
constexpr int kRowPathRowsInt = 24;

template <int D>
static inline void score_group_i8(const int16_t* q, const float* qscale, int G, const int8_t* kbase,
                                  int64_t row_stride, int64_t m, float* s, int64_t lds) {
  constexpr int NV = D / (2 * Vec::W);
  typename Vec::VI part[kMaxGroupRows][Vec::W];
  alignas(64) float kscale[Vec::W];
  for (int jj = 0; jj < Vec::W; ++jj) {
    if (jj >= m) {
      for (int r = 0; r < G; ++r) part[r][jj] = Vec::izero();
      kscale[jj] = 0.0f;
      continue;
    }
    const int8_t* k = kbase + jj * row_stride;
    kscale[jj] = row_scale<int8_t, D>(k);
    typename Vec::VK kw[NV];
    for (int i = 0; i < NV; ++i) kw[i] = Vec::widen_i8(k + i * 2 * Vec::W);
    for (int r = 0; r < G; ++r) {
      const int16_t* qr = q + r * D;
      typename Vec::VI a = Vec::dot_i16_k(Vec::izero(), qr, kw[0]);
      for (int i = 1; i < NV; ++i) a = Vec::dot_i16_k(a, qr + i * 2 * Vec::W, kw[i]);
      part[r][jj] = a;
    }
  }
  const typename Vec::V ks = Vec::load(kscale);
  for (int r = 0; r < G; ++r)
    Vec::store(s + r * lds, Vec::mul(Vec::reduce_rows_i(part[r]), Vec::mul(ks, Vec::set1(qscale[r]))));
}

// max |x[d]| over d < n (exact, so the same on every path).
static inline float abs_max(const float* x, int64_t n) {
  const typename Vec::V zero = Vec::zero();
  typename Vec::V vmax = zero;
  int64_t d = 0;
  for (; d + Vec::W <= n; d += Vec::W) {
    const typename Vec::V v = Vec::load(x + d);
    vmax = Vec::max(vmax, Vec::max(v, Vec::sub(zero, v)));
  }
  float amax = Vec::hmax(vmax);
  for (; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  return amax;
}

// A query row as int16 (q16[d] = round(q[d] / scale), |q16| <= 32767); returns the scale (0 for a zero row).
template <int D>
static inline float quantize_row_i16(const float* q, int16_t* q16) {
  const float amax = abs_max(q, D);
  if (!(amax > 0.0f)) {
    std::fill(q16, q16 + D, int16_t{0});
    return 0.0f;
  }
  const float inv = 32767.0f / amax;
  for (int d = 0; d < D; ++d) {
    const float x = std::nearbyint(q[d] * inv);
    q16[d] = static_cast<int16_t>(std::max(-32767.0f, std::min(32767.0f, x)));
  }
  return amax / 32767.0f;
}

// Online-softmax update of one row over scores s[0..np) (np a multiple of W, -inf where hidden):
// s becomes the probabilities relative to the new running max; returns the factor the row's
// accumulator must be multiplied by (0 when the row had seen nothing yet).
static inline float softmax_update(float* s, int64_t np, float& m, float& l) {
  typename Vec::V vm = Vec::set1(kNegInf);
  for (int64_t j = 0; j < np; j += Vec::W) vm = Vec::max(vm, Vec::load(s + j));
  const float bm = Vec::hmax(vm);
  if (bm == kNegInf) {  // nothing visible to this row in this block
    std::fill(s, s + np, 0.0f);
    return 1.0f;
  }
  const float mn = std::max(m, bm);
  const float corr = (m == kNegInf) ? 0.0f : (m == mn) ? 1.0f : std::exp(m - mn);  // exp(0) = 1: no call
  const typename Vec::V vmn = Vec::set1(mn);
  typename Vec::V sum = Vec::zero();
  for (int64_t j = 0; j < np; j += Vec::W) {
    typename Vec::V p = vexp(Vec::sub(Vec::load(s + j), vmn));
    Vec::store(s + j, p);
    sum = Vec::add(sum, p);
  }
  l = l * corr + Vec::hsum(sum);
  m = mn;
  return corr;
}

static inline bool visible(int64_t key, int64_t query, int64_t window) {
  return key <= query && (window <= 0 || key > query - window);
}

template <int D>
static inline void scale_row(float* acc, float c) {
  const typename Vec::V vc = Vec::set1(c);
  for (int i = 0; i < D; i += Vec::W) Vec::store(acc + i, Vec::mul(Vec::load(acc + i), vc));
}

template <int D>
constexpr int kPvRows = D > 128 ? 1 : D > 64 ? 2 : 4;  // register tile rows of the float P·V tiles

// P·V tile: Acc[r][:] += sum_j P[r][j] * V[j][:] for RT rows; V rows of head g at vbase + slot * row_stride.
template <int D, int RT, typename KV>
static inline void pv_tile(const float* P, int64_t ldp, const KV* const* vrows, int64_t n, float* Acc) {
  constexpr int NV = D / Vec::W;
  typename Vec::V acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = Vec::load(Acc + r * D + i * Vec::W);
  for (int64_t j = 0; j < n; ++j) {
    typename Vec::V v[NV];
    for (int i = 0; i < NV; ++i) v[i] = Vec::load_kv(vrows[j] + i * Vec::W);
    for (int r = 0; r < RT; ++r) {
      const typename Vec::V pb = Vec::set1(P[r * ldp + j]);
      for (int i = 0; i < NV; ++i) acc[r][i] = Vec::fma(pb, v[i], acc[r][i]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < NV; ++i) Vec::store(Acc + r * D + i * Vec::W, acc[r][i]);
}

// `rows` consecutive rows in register tiles of RP rows (RP <= 4), the rest in one smaller tile: tile(rt, r) runs a
// tile of decltype(rt)::value rows from row r (rt a std::integral_constant, so the tile's size is a template argument).
template <int RP, typename Tile>
static inline void row_tiles(int rows, Tile&& tile) {
  int r = 0;
  for (; r + RP <= rows; r += RP) tile(std::integral_constant<int, RP>{}, r);
  switch (rows - r) {  // the rest in one tile (< RP rows)
    case 3: if constexpr (RP > 3) tile(std::integral_constant<int, 3>{}, r); break;
    case 2: if constexpr (RP > 2) tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// P·V for `rows` consecutive rows (P rows ldp apart, accumulators D apart), register tiles of up to kPvRows rows.
template <int D, typename KV>
static inline void pv_rows(const float* P, int64_t ldp, const KV* const* vrows, int64_t n, float* Acc, int rows) {
  row_tiles<kPvRows<D>>(rows, [&](auto rt, int r) {
    pv_tile<D, decltype(rt)::value, KV>(P + r * ldp, ldp, vrows, n, Acc + r * D);
  });
}

// int8 pools, decode rows: P·V in integers. Each row's probabilities over a block (each already multiplied by its
// value row's scale) are rounded once to int16 with the row's own scale (its largest -> 32767: relative error
// <= 2^-16 of the largest, against the int8 values' 2^-8); the sums over up to kPairsPerFlush key pairs are exact in
// int32 (|sum| <= 2 * 32767 * 127 * kPairsPerFlush < 2^31), then made float, scaled and added. vpmaddwd takes two
// keys per product, so the multiplies are half the float path's FMAs and the int8 values are never converted.
constexpr int64_t kPairsPerFlush = 256;

// Acc[r][:] += pscale[r] * sum_j P16[r][j] * V[j][:] for RT rows (P16 rows ldp apart, the n keys padded to whole
// pairs with probability 0; vrows[j] the value rows, vrows[n] valid when n is odd).
template <int D, int RT>
static inline void pv_tile_i16(const int16_t* P16, int64_t ldp, const int8_t* const* vrows, int64_t n,
                               const float* pscale, float* Acc, PrefetchPump& pump) {
  constexpr int NP = D / (2 * Vec::W);  // interleaved vector pairs per pair of value rows
  const int64_t pairs = (n + 1) / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairsPerFlush) {
    const int64_t p1 = std::min(pairs, p0 + kPairsPerFlush);
    typename Vec::VI lo[RT][NP], hi[RT][NP];
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < NP; ++i) lo[r][i] = hi[r][i] = Vec::izero();
    for (int64_t jp = p0; jp < p1; ++jp) {
      if ((jp & 3) == 0) pump.pump();
      const int8_t* a = vrows[2 * jp];
      const int8_t* b = vrows[2 * jp + 1];
      int32_t pp[RT];  // each row's two probabilities, (p[2jp], p[2jp + 1]) as one 32-bit pair
      for (int r = 0; r < RT; ++r) std::memcpy(&pp[r], P16 + r * ldp + 2 * jp, sizeof pp[r]);
      for (int i = 0; i < NP; ++i) {
        typename Vec::VK vl, vh;
        Vec::interleave_pair(a + i * 2 * Vec::W, b + i * 2 * Vec::W, vl, vh);
        for (int r = 0; r < RT; ++r) {
          lo[r][i] = Vec::dot_pair(lo[r][i], vl, pp[r]);
          hi[r][i] = Vec::dot_pair(hi[r][i], vh, pp[r]);
        }
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < NP; ++i) Vec::add_pairs(Acc + r * D + i * 2 * Vec::W, lo[r][i], hi[r][i], pscale[r]);
  }
}

// register tile rows of pv_tile_i16: 2 · D / (2W) int32 accumulators per row within ~3/4 of the vector registers
template <int D>
constexpr int kPvRowsI16 = std::max(1, std::min(kPvRows<D>, (Vec::W == 16 ? 24 : 12) / (D / Vec::W)));

// pv_tile_i16 over `rows` consecutive rows, register tiles of up to kPvRowsI16 rows; pv_tiles(rows) tiles run,
// each with a pump.pump() every 4 key pairs.
template <int D>
static inline int pv_tiles(int rows) { return (rows + kPvRowsI16<D> - 1) / kPvRowsI16<D>; }

template <int D>
static inline void pv_rows_i16(const int16_t* P16, int64_t ldp, const int8_t* const* vrows, int64_t n,
                               const float* pscale, float* Acc, int rows, PrefetchPump& pump) {
  row_tiles<kPvRowsI16<D>>(rows, [&](auto rt, int r) {
    pv_tile_i16<D, decltype(rt)::value>(P16 + r * ldp, ldp, vrows, n, pscale + r, Acc + r * D, pump);
  });
}

// A token's cascade state for q head h in PagedProblem::partial: m, l, then the D-float accumulator.
template <int D>
static inline float* cascade_state(const omf::PagedProblem& P, int32_t token, int h) {
  return P.partial + (static_cast<int64_t>(token) * P.q_heads + h) * (D + 2);
}

// The smallest and largest position of the item's queries ({max int64, -1} for an empty item).
static inline std::pair<int64_t, int64_t> position_range(const omf::PagedProblem& P, const omf::WorkItem& it) {
  int64_t pmin = std::numeric_limits<int64_t>::max(), pmax = -1;
  for (int i = 0; i < it.count; ++i) {
    pmin = std::min(pmin, P.positions[P.tokens[it.first + i]]);
    pmax = std::max(pmax, P.positions[P.tokens[it.first + i]]);
  }
  return {pmin, pmax};
}

// The first block an item reads: the first a query can see (the sliding window), never one a cascade item attended.
static inline int64_t first_read_block(const omf::PagedProblem& P, const omf::WorkItem& it, int64_t pmin) {
  const int64_t lo_key = P.window > 0 ? std::max<int64_t>(0, pmin - P.window + 1) : 0;
  return std::max<int64_t>(lo_key / P.block_size, it.skip_blocks);
}

// The key rows of `it`'s first visible block that its queries can see, as (pointer, bytes); (nullptr, 0) when its
// table does not hold that block (attend_item reports that error when it runs the item).
template <int D, typename KV>
static std::pair<const KV*, int64_t> first_key_block(const omf::PagedProblem& P, const omf::WorkItem& it) {
  const int64_t bs = P.block_size, row_stride = static_cast<int64_t>(P.kv_heads) * head_elems<KV, D>();
  const auto [pmin, pmax] = position_range(P, it);
  const int64_t b = first_read_block(P, it, pmin);
  if (pmax < 0 || b >= it.table_len || it.table[b] < 0 || it.table[b] >= P.num_slots / bs) return {nullptr, 0};
  const int64_t n = std::min<int64_t>(bs, pmax + 1 - b * bs);
  return {static_cast<const KV*>(P.key_pool) + it.table[b] * bs * row_stride,
          n * row_stride * static_cast<int64_t>(sizeof(KV))};
}

// ---- the tile path (prefill chunks): query rows in vector lanes ----
// Per KV head, the item's rows r = token i · G + hh sit in the lanes of NRV = ceil(rows / W) vectors, the queries
// transposed once per item to QT[d][r]. A block's scores are then ST[j][r] = Σ_d K[j][d] · QT[d][r] (each key element
// broadcast, no key transpose), the online softmax runs down the key rows with every lane its own query row (maxima,
// sums and corrections vertical: no horizontal reduction per row and block), and P·V accumulates OT[d][r] +=
// V[j][d] · P[j][r] (each value element broadcast). Both products are register tiles of up to 4 row vectors (the
// scores × 4 keys, P·V × 4 head dimensions), so every broadcast feeds up to 4 FMAs and every loaded vector 4.

// row vectors per register tile: 4 with 32 vector registers (AVX-512), 2 with 16 (AVX2) or plain arrays
constexpr int kLaneTile = Vec::W == 16 ? 4 : 2;

// Vec has bfloat16 dot products (the optional traits above)
template <typename T, typename = void>
struct HasBf16Dot : std::false_type {};
template <typename T>
struct HasBf16Dot<T, std::void_t<decltype(&T::dot_bf16)>> : std::true_type {};
constexpr bool kBf16Dot = HasBf16Dot<Vec>::value;

// f(rv0, std::integral_constant<int, RVT>) for each tile of the nrv row vectors (per_tile <= kLaneTile each)
template <typename F>
static inline void for_lane_tiles(int nrv, int per_tile, F&& f) {
  for (int rv0 = 0; rv0 < nrv; rv0 += per_tile) {
    switch (std::min(per_tile, nrv - rv0)) {
      case 4: if constexpr (kLaneTile >= 4) f(rv0, std::integral_constant<int, 4>{}); break;
      case 3: if constexpr (kLaneTile >= 3) f(rv0, std::integral_constant<int, 3>{}); break;
      case 2: f(rv0, std::integral_constant<int, 2>{}); break;
      default: f(rv0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// ST[jj][lanes] = Σ_d K[jj][d] · QT[d][lanes] for JT keys (K rows kstride apart) and RVT row vectors.
template <int D, int JT, int RVT>
static inline void score_lanes(const float* QT, int64_t ldq, const float* K, int64_t kstride, float* ST, int64_t lds) {
  typename Vec::V acc[JT][RVT];
  for (int jj = 0; jj < JT; ++jj)
    for (int i = 0; i < RVT; ++i) acc[jj][i] = Vec::zero();
  for (int d = 0; d < D; ++d) {
    typename Vec::V q[RVT];
    for (int i = 0; i < RVT; ++i) q[i] = Vec::load(QT + d * ldq + i * Vec::W);
    for (int jj = 0; jj < JT; ++jj) {
      const typename Vec::V kb = Vec::set1(K[jj * kstride + d]);
      for (int i = 0; i < RVT; ++i) acc[jj][i] = Vec::fma(kb, q[i], acc[jj][i]);
    }
  }
  for (int jj = 0; jj < JT; ++jj)
    for (int i = 0; i < RVT; ++i) Vec::store(ST + jj * lds + i * Vec::W, acc[jj][i]);
}

// OT[d][lanes] = OT[d][lanes] · corr[lanes] + Σ_j V[j][d] · PT[j][lanes] over n keys (V rows vstride apart), for all
// D head dimensions, 4 at a time, and RVT row vectors.
template <int D, int RVT>
static inline void pv_lanes(const float* PT, int64_t ldp, const float* V, int64_t vstride, int64_t n, float* OT,
                            int64_t ldo, const typename Vec::V* corr) {
  constexpr int DT = 4;
  static_assert(D % DT == 0, "head_dim must be a multiple of 4");
  for (int d0 = 0; d0 < D; d0 += DT) {
    typename Vec::V acc[DT][RVT];
    for (int dd = 0; dd < DT; ++dd)
      for (int i = 0; i < RVT; ++i) acc[dd][i] = Vec::mul(Vec::load(OT + (d0 + dd) * ldo + i * Vec::W), corr[i]);
    for (int64_t j = 0; j < n; ++j) {
      typename Vec::V p[RVT];
      for (int i = 0; i < RVT; ++i) p[i] = Vec::load(PT + j * ldp + i * Vec::W);
      const float* v = V + j * vstride + d0;
      for (int dd = 0; dd < DT; ++dd) {
        const typename Vec::V vb = Vec::set1(v[dd]);
        for (int i = 0; i < RVT; ++i) acc[dd][i] = Vec::fma(vb, p[i], acc[dd][i]);
      }
    }
    for (int dd = 0; dd < DT; ++dd)
      for (int i = 0; i < RVT; ++i) Vec::store(OT + (d0 + dd) * ldo + i * Vec::W, acc[dd][i]);
  }
}

// The block's scores of RVT row vectors (ST: n key rows ld apart, this tile's lanes), in place: each int8 key's scale
// applied (ksc; nullptr otherwise) and keys hidden from a row -inf (when `masked`); then each row's running maximum m
// (this tile's lanes) raised to the block's, msafe = that maximum made finite, corr = exp(old maximum - msafe).
template <int RVT>
static inline void lanes_max(float* ST, int64_t ld, float* m, const float* posf, int64_t n, int64_t j0,
                             const float* ksc, bool masked, int64_t window, typename Vec::V* msafe,
                             typename Vec::V* corr) {
  using V = typename Vec::V;
  V mx[RVT], pos[RVT];
  for (int i = 0; i < RVT; ++i) {
    mx[i] = Vec::set1(kNegInf);
    pos[i] = Vec::load(posf + i * Vec::W);
  }
  const V ninf = Vec::set1(kNegInf), one = Vec::set1(1.0f);
  for (int64_t j = 0; j < n; ++j) {
    float* s = ST + j * ld;
    const V kpos = Vec::set1(static_cast<float>(j0 + j));
    for (int i = 0; i < RVT; ++i) {
      V x = Vec::load(s + i * Vec::W);
      if (ksc != nullptr) x = Vec::mul(x, Vec::set1(ksc[j]));
      if (masked) {  // visible iff key <= pos and (no window or key > pos - window); padding rows have pos -1
        x = Vec::select_positive(Vec::sub(pos[i], kpos), x, ninf);
        if (window > 0)
          x = Vec::select_positive(Vec::sub(Vec::add(kpos, Vec::set1(static_cast<float>(window))),
                                            Vec::add(pos[i], one)), x, ninf);
        Vec::store(s + i * Vec::W, x);
      } else if (ksc != nullptr) {
        Vec::store(s + i * Vec::W, x);
      }
      mx[i] = Vec::max(mx[i], x);
    }
  }
  for (int i = 0; i < RVT; ++i) {
    const V mold = Vec::load(m + i * Vec::W);
    const V mnew = Vec::max(mold, mx[i]);
    msafe[i] = Vec::max(mnew, Vec::set1(-std::numeric_limits<float>::max()));  // -inf (nothing seen yet) -> finite
    corr[i] = vexp(Vec::sub(mold, msafe[i]));  // 0 where the row had seen nothing, 1 where its maximum held
    Vec::store(m + i * Vec::W, mnew);
  }
}

// One block for RVT row vectors from row vector rv0 of a KV head (state in lanes: QT, OT, m, l, posf with ld row
// stride): scores, scales, mask, online softmax, P·V. K, V: the block's first key / value row of this head as float
// (kstride apart), n <= bs keys at positions j0 …; ksc / vsc: int8 pools' per-key scales (nullptr otherwise).
template <int D, int RVT>
static inline void block_lanes(const float* QT, float* OT, float* m, float* l, const float* posf, int64_t ld, int rv0,
                               const float* K, const float* Vv, int64_t kstride, int64_t n, int64_t j0,
                               const float* ksc, const float* vsc, bool masked, int64_t window, float* ST) {
  using V = typename Vec::V;
  const int64_t off = static_cast<int64_t>(rv0) * Vec::W;
  ST += off;  // this tile's lanes of every key row
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) score_lanes<D, 4, RVT>(QT + off, ld, K + j * kstride, kstride, ST + j * ld, ld);
  for (; j < n; ++j) score_lanes<D, 1, RVT>(QT + off, ld, K + j * kstride, kstride, ST + j * ld, ld);
  V corr[RVT], msafe[RVT], sum[RVT];
  lanes_max<RVT>(ST, ld, m + off, posf + off, n, j0, ksc, masked, window, msafe, corr);
  for (int i = 0; i < RVT; ++i) sum[i] = Vec::zero();
  for (j = 0; j < n; ++j) {
    float* s = ST + j * ld;
    for (int i = 0; i < RVT; ++i) {
      V p = vexp(Vec::sub(Vec::load(s + i * Vec::W), msafe[i]));
      sum[i] = Vec::add(sum[i], p);
      if (vsc != nullptr) p = Vec::mul(p, Vec::set1(vsc[j]));  // the value row's scale, after the sum
      Vec::store(s + i * Vec::W, p);
    }
  }
  for (int i = 0; i < RVT; ++i)
    Vec::store(l + off + i * Vec::W, Vec::fma(Vec::load(l + off + i * Vec::W), corr[i], sum[i]));
  pv_lanes<D, RVT>(ST, ld, Vv, kstride, n, OT + off, ld, corr);
}

// ---- bfloat16 pools on the tile path (kBf16Dot; X = Vec, a template parameter so that a Vec without the bfloat16
// traits never instantiates these) ----
// Layouts: QT2[p][lanes] the queries' dimension pairs (2p, 2p + 1) (per KV head, D/2 rows ld apart); VP[jp][d] a
// block's value pairs (keys 2jp, 2jp + 1) of dimension d (D apart); PT2[jp][lanes] the probabilities of key pair jp.

// ST[jj][lanes] = Σ_p dot(K[jj] pair p, QT2[p][lanes]) for JT keys (K rows kstride apart) and RVT row vectors.
template <int D, int JT, int RVT, typename X>
static inline void score_lanes_bf16(const uint32_t* QT2, int64_t ldq, const uint16_t* K, int64_t kstride, float* ST,
                                    int64_t lds) {
  typename X::V acc[JT][RVT];
  for (int jj = 0; jj < JT; ++jj)
    for (int i = 0; i < RVT; ++i) acc[jj][i] = X::zero();
  for (int p = 0; p < D / 2; ++p) {
    typename X::VB q[RVT];
    for (int i = 0; i < RVT; ++i) q[i] = X::load_pairs(QT2 + p * ldq + i * X::W);
    for (int jj = 0; jj < JT; ++jj) {
      const typename X::VB kb = X::broadcast_pair(K + jj * kstride + 2 * p);
      for (int i = 0; i < RVT; ++i) acc[jj][i] = X::dot_bf16(acc[jj][i], q[i], kb);
    }
  }
  for (int jj = 0; jj < JT; ++jj)
    for (int i = 0; i < RVT; ++i) X::store(ST + jj * lds + i * X::W, acc[jj][i]);
}

// OT[d][lanes] = OT[d][lanes] · corr[lanes] + Σ_jp dot(PT2[jp][lanes], VP[jp][d]) over npairs key pairs, for all D
// head dimensions, 4 at a time, and RVT row vectors.
template <int D, int RVT, typename X>
static inline void pv_lanes_bf16(const uint32_t* PT2, int64_t ldp, const uint32_t* VP, int64_t npairs, float* OT,
                                 int64_t ldo, const typename X::V* corr) {
  constexpr int DT = 4;
  for (int d0 = 0; d0 < D; d0 += DT) {
    typename X::V acc[DT][RVT];
    for (int dd = 0; dd < DT; ++dd)
      for (int i = 0; i < RVT; ++i) acc[dd][i] = X::mul(X::load(OT + (d0 + dd) * ldo + i * X::W), corr[i]);
    for (int64_t jp = 0; jp < npairs; ++jp) {
      typename X::VB p[RVT];
      for (int i = 0; i < RVT; ++i) p[i] = X::load_pairs(PT2 + jp * ldp + i * X::W);
      const uint32_t* v = VP + jp * D + d0;
      for (int dd = 0; dd < DT; ++dd) {
        const typename X::VB vb = X::broadcast_pair(v + dd);
        for (int i = 0; i < RVT; ++i) acc[dd][i] = X::dot_bf16(acc[dd][i], p[i], vb);
      }
    }
    for (int dd = 0; dd < DT; ++dd)
      for (int i = 0; i < RVT; ++i) X::store(OT + (d0 + dd) * ldo + i * X::W, acc[dd][i]);
  }
}

// block_lanes for a bfloat16 pool: K the block's first key row of this head in the pool (kstride apart), VP its
// values in pairs; the probabilities of key pairs go to PT2 (the missing half of an odd n's last pair 0).
template <int D, int RVT, typename X>
static inline void block_lanes_bf16(const uint32_t* QT2, float* OT, float* m, float* l, const float* posf, int64_t ld,
                                    int rv0, const uint16_t* K, int64_t kstride, const uint32_t* VP, int64_t n,
                                    int64_t j0, bool masked, int64_t window, float* ST, uint32_t* PT2) {
  using V = typename X::V;
  const int64_t off = static_cast<int64_t>(rv0) * X::W;
  ST += off, PT2 += off;  // this tile's lanes of every key row / pair
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) score_lanes_bf16<D, 4, RVT, X>(QT2 + off, ld, K + j * kstride, kstride, ST + j * ld, ld);
  for (; j < n; ++j) score_lanes_bf16<D, 1, RVT, X>(QT2 + off, ld, K + j * kstride, kstride, ST + j * ld, ld);
  V corr[RVT], msafe[RVT], sum[RVT];
  lanes_max<RVT>(ST, ld, m + off, posf + off, n, j0, nullptr, masked, window, msafe, corr);
  for (int i = 0; i < RVT; ++i) sum[i] = X::zero();
  const int64_t npairs = (n + 1) / 2;
  for (int64_t jp = 0; jp < npairs; ++jp) {
    const float* s = ST + 2 * jp * ld;
    const bool odd = 2 * jp + 1 < n;
    for (int i = 0; i < RVT; ++i) {
      const V p0 = vexp(X::sub(X::load(s + i * X::W), msafe[i]));
      const V p1 = odd ? vexp(X::sub(X::load(s + ld + i * X::W), msafe[i])) : X::zero();
      sum[i] = X::add(sum[i], X::add(p0, p1));
      X::store_pairs(PT2 + jp * ld + i * X::W, p0, p1);
    }
  }
  for (int i = 0; i < RVT; ++i)
    X::store(l + off + i * X::W, X::fma(X::load(l + off + i * X::W), corr[i], sum[i]));
  pv_lanes_bf16<D, RVT, X>(PT2, ld, VP, npairs, OT + off, ld, corr);
}

// The queries of KV heads g_lo … g_hi - 1 in pairs: QT2[g][p][lanes] from QT[g][2p], QT[g][2p + 1] (float, scaled).
template <int D, typename X>
static inline void pair_queries_bf16(const float* QT, uint32_t* QT2, int64_t ld, int g_lo, int g_hi) {
  for (int g = g_lo; g < g_hi; ++g)
    for (int p = 0; p < D / 2; ++p)
      for (int64_t c = 0; c < ld; c += X::W) {
        const float* q = QT + (static_cast<int64_t>(g) * D + 2 * p) * ld + c;
        X::store_pairs(QT2 + (static_cast<int64_t>(g) * (D / 2) + p) * ld + c, X::load(q), X::load(q + ld));
      }
}

// One block of a KV head (krow / vrow: its first key / value row in the pool, row_stride apart; QT2, OT, m, l: its
// state in lanes) for every tile of the item's rows: the values paired by key (VP, in S.v2), then block_lanes_bf16
// per tile.
template <int D, typename X>
static inline void block_bf16(Scratch& S, const uint32_t* QT2, float* OT, float* m, float* l, int64_t ld, int nrv,
                              int per_tile, const uint16_t* krow, const uint16_t* vrow, int64_t row_stride, int64_t n,
                              int64_t j0, bool masked, int64_t window) {
  static_assert(D % X::W == 0, "the value pairs are written W at a time");
  uint32_t* VP = S.v2.data();
  for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
    const uint16_t* a = vrow + 2 * jp * row_stride;
    const uint16_t* b = 2 * jp + 1 < n ? a + row_stride : nullptr;
    for (int d = 0; d < D; d += X::W) X::store_row_pairs(VP + jp * D + d, a + d, b == nullptr ? nullptr : b + d);
  }
  for_lane_tiles(nrv, per_tile, [&](int rv0, auto c) {
    block_lanes_bf16<D, decltype(c)::value, X>(QT2, OT, m, l, S.posf.data(), ld, rv0, krow, row_stride, VP, n, j0,
                                               masked, window, S.s.data(), S.p2.data());
  });
}

// One work item on the tile path: its rows r = token i · G + hh in the lanes of nrv row vectors per KV head (ld lanes,
// rows padded to whole vectors), the KV heads g_lo … g_hi − 1 it attends (every one, or a cascade item's own) and
// their query heads h_lo … h_hi − 1.
struct LaneItem {
  int Hq, Hkv, G, bs;
  int64_t row_stride;  // elements per slot row
  int ntok;
  const int32_t* toks;
  int nrv;
  int64_t ld;
  int g_lo, g_hi, h_lo, h_hi;
};

template <int D, typename KV>
static inline LaneItem lane_item(const omf::PagedProblem& P, const omf::WorkItem& it) {
  LaneItem li;
  li.Hq = P.q_heads, li.Hkv = P.kv_heads, li.G = li.Hq / li.Hkv, li.bs = P.block_size;
  li.row_stride = static_cast<int64_t>(li.Hkv) * head_elems<KV, D>();
  li.ntok = it.count, li.toks = P.tokens + it.first;
  const int R = li.ntok * li.G;
  li.nrv = static_cast<int>((R + Vec::W - 1) / Vec::W);
  li.ld = static_cast<int64_t>(li.nrv) * Vec::W;
  li.g_lo = it.kv_head >= 0 ? it.kv_head : 0, li.g_hi = it.kv_head >= 0 ? it.kv_head + 1 : li.Hkv;
  li.h_lo = li.g_lo * li.G, li.h_hi = li.g_hi * li.G;
  return li;
}

// bfloat16 pools on a Vec with bfloat16 dot products take block_bf16 (see above)
template <typename KV>
constexpr bool kLaneDot16 = kBf16Dot && std::is_same<KV, uint16_t>::value;

// The tile path's state in S, per KV head g: QT (the queries times the scale, transposed) and OT at g·D·ld
// ([d][lane]), m, l at g·ld; posf the rows' positions as float (exact below 2^24), -1 on padding lanes; ST [bs][ld] for
// the block in flight. An item after a cascade (skip_blocks) starts from the cascade's state after the shared blocks.
template <int D>
static inline OMF_ALWAYS_INLINE void lanes_load(const omf::PagedProblem& P, const omf::WorkItem& it,
                                                const LaneItem& li, Scratch& S) {
  const int Hq = li.Hq, Hkv = li.Hkv, G = li.G, ntok = li.ntok;
  const int32_t* toks = li.toks;
  const int64_t ld = li.ld;
  S.q.assign(static_cast<size_t>(Hkv) * D * ld, 0.0f);
  S.acc.assign(static_cast<size_t>(Hkv) * D * ld, 0.0f);
  S.m.assign(static_cast<size_t>(Hkv) * ld, kNegInf);
  S.l.assign(static_cast<size_t>(Hkv) * ld, 0.0f);
  S.s.assign(static_cast<size_t>(li.bs) * ld, 0.0f);
  S.posf.assign(ld, -1.0f);
  if (it.skip_blocks > 0)
    for (int i = 0; i < ntok; ++i)
      for (int h = 0; h < Hq; ++h) {
        const size_t g = static_cast<size_t>(h / G), r = static_cast<size_t>(i * G + h % G);
        const float* st = cascade_state<D>(P, toks[i], h);
        S.m[g * ld + r] = st[0], S.l[g * ld + r] = st[1];
        float* ot = &S.acc[g * D * ld] + r;
        for (int d = 0; d < D; ++d) ot[d * ld] = st[2 + d];
      }
  for (int i = 0; i < ntok; ++i) {
    const float* q = P.q + toks[i] * P.q_tok_stride;
    for (int hh = 0; hh < G; ++hh) S.posf[i * G + hh] = static_cast<float>(P.positions[toks[i]]);
    for (int h = li.h_lo; h < li.h_hi; ++h) {
      const float* qh = q + h * P.q_head_stride;
      float* qt = &S.q[static_cast<size_t>(h / G) * D * ld] + i * G + h % G;
      for (int d = 0; d < D; ++d) qt[d * ld] = qh[d] * P.scale;
    }
  }
}

// The pool type's buffers: bfloat16 dot products' pairs (the queries paired once, here), or room for a block's rows
// as float (block_as_float) and int8 pools' scales.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void lanes_buffers(const LaneItem& li, Scratch& S) {
  if constexpr (kLaneDot16<KV>) {
    S.q2.resize(static_cast<size_t>(li.Hkv) * (D / 2) * li.ld);
    S.v2.resize(static_cast<size_t>((li.bs + 1) / 2) * D);
    S.p2.resize(static_cast<size_t>((li.bs + 1) / 2) * li.ld);
    pair_queries_bf16<D, Vec>(S.q.data(), S.q2.data(), li.ld, li.g_lo, li.g_hi);
  } else if constexpr (!std::is_same<KV, float>::value) {
    S.kt.resize(static_cast<size_t>(2) * li.bs * D);
    if constexpr (std::is_same<KV, int8_t>::value) {
      S.scale.resize(li.bs);
      S.vscale.resize(li.bs);
    }
  }
}

// A block's key and value rows of one head as block_lanes reads them: K, V (kstride apart) and int8 pools' per-key
// scales (nullptr otherwise).
struct FloatBlock {
  const float *K, *V;
  int64_t kstride;
  const float *ksc, *vsc;
};

// float pools as they lie (row_stride apart); bfloat16 and int8 ones widened into S.kt (D apart; int8 unscaled, its
// scales gathered into S.scale and S.vscale for the scores and the probabilities). n rows from krow / vrow.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE FloatBlock block_as_float(Scratch& S, const KV* krow, const KV* vrow,
                                                          int64_t row_stride, int64_t n, int bs) {
  if constexpr (std::is_same<KV, float>::value) {
    return {reinterpret_cast<const float*>(krow), reinterpret_cast<const float*>(vrow), row_stride, nullptr, nullptr};
  } else {
    float* kf = S.kt.data();
    float* vf = kf + static_cast<size_t>(bs) * D;
    for (int64_t j = 0; j < n; ++j)
      for (int d = 0; d < D; d += Vec::W) {
        Vec::store(kf + j * D + d, Vec::load_kv(krow + j * row_stride + d));
        Vec::store(vf + j * D + d, Vec::load_kv(vrow + j * row_stride + d));
      }
    if constexpr (std::is_same<KV, int8_t>::value) {
      for (int64_t j = 0; j < n; ++j) {
        S.scale[j] = row_scale<KV, D>(krow + j * row_stride);
        S.vscale[j] = row_scale<KV, D>(vrow + j * row_stride);
      }
      return {kf, vf, D, S.scale.data(), S.vscale.data()};
    }
    return {kf, vf, D, nullptr, nullptr};
  }
}

// One block of KV head g (its slots from `base`, n keys at positions j0 …) for every tile of the item's rows.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void lanes_head_block(const omf::PagedProblem& P, const LaneItem& li, Scratch& S,
                                                      int g, int64_t base, int64_t n, int64_t j0, bool masked,
                                                      int per_tile) {
  constexpr int64_t HE = head_elems<KV, D>();
  const int64_t ld = li.ld;
  const KV* krow = static_cast<const KV*>(P.key_pool) + base * li.row_stride + g * HE;
  const KV* vrow = static_cast<const KV*>(P.value_pool) + base * li.row_stride + g * HE;
  float* OT = &S.acc[static_cast<size_t>(g) * D * ld];
  float* m = &S.m[static_cast<size_t>(g) * ld];
  float* l = &S.l[static_cast<size_t>(g) * ld];
  if constexpr (kLaneDot16<KV>) {
    block_bf16<D, Vec>(S, &S.q2[static_cast<size_t>(g) * (D / 2) * ld], OT, m, l, ld, li.nrv, per_tile, krow, vrow,
                       li.row_stride, n, j0, masked, P.window);
  } else {
    const FloatBlock f = block_as_float<D, KV>(S, krow, vrow, li.row_stride, n, li.bs);
    float* QT = &S.q[static_cast<size_t>(g) * D * ld];
    for_lane_tiles(li.nrv, per_tile, [&](int rv0, auto c) {
      block_lanes<D, decltype(c)::value>(QT, OT, m, l, S.posf.data(), ld, rv0, f.K, f.V, f.kstride, n, j0, f.ksc,
                                         f.vsc, masked, P.window, S.s.data());
    });
  }
}

// A cascade item's end: each row's state after the shared blocks, for its sequence's own item.
template <int D>
static inline OMF_ALWAYS_INLINE void lanes_store_cascade(const omf::PagedProblem& P, const LaneItem& li,
                                                         const Scratch& S) {
  const int G = li.G;
  const int64_t ld = li.ld;
  for (int i = 0; i < li.ntok; ++i)
    for (int h = li.h_lo; h < li.h_hi; ++h) {
      const size_t g = static_cast<size_t>(h / G), r = static_cast<size_t>(i * G + h % G);
      float* st = cascade_state<D>(P, li.toks[i], h);
      st[0] = S.m[g * ld + r], st[1] = S.l[g * ld + r];
      const float* ot = &S.acc[g * D * ld] + r;
      for (int d = 0; d < D; ++d) st[2 + d] = ot[d * ld];
    }
}

// Each row's output: its accumulator over its sum l (0 for a row that saw nothing).
template <int D>
static inline OMF_ALWAYS_INLINE void lanes_write_out(const omf::PagedProblem& P, const LaneItem& li,
                                                     const Scratch& S) {
  const int G = li.G;
  const int64_t ld = li.ld;
  for (int i = 0; i < li.ntok; ++i) {
    float* o = P.o + li.toks[i] * P.o_tok_stride;
    for (int h = 0; h < li.Hq; ++h) {
      const size_t g = static_cast<size_t>(h / G), r = static_cast<size_t>(i * G + h % G);
      const float lr = S.l[g * ld + r];
      const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
      const float* ot = &S.acc[g * D * ld] + r;
      float* oh = o + h * P.o_head_stride;
      for (int d = 0; d < D; ++d) oh[d] = ot[d * ld] * inv;
    }
  }
}

// The tile path of one work item (rows in lanes, see above); blocks first_block … last_block are valid.
template <int D, typename KV>
static bool attend_lanes(const omf::PagedProblem& P, const omf::WorkItem& it, int64_t first_block,
                         int64_t last_block, int64_t pmin, int64_t pmax) {
  const LaneItem li = lane_item<D, KV>(P, it);
  Scratch& S = scratch();
  lanes_load<D>(P, it, li, S);
  lanes_buffers<D, KV>(li, S);
  // row vectors split evenly into tiles of <= kLaneTile (the score tile's 4 × kLaneTile accumulators in registers)
  const int tiles = (li.nrv + kLaneTile - 1) / kLaneTile, per_tile = (li.nrv + tiles - 1) / tiles;
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t base = it.table[b] * li.bs, j0 = b * li.bs;
    const int64_t n = std::min<int64_t>(li.bs, pmax + 1 - j0);
    const bool masked = pmin < j0 + n - 1 || P.window > 0;
    for (int g = li.g_lo; g < li.g_hi; ++g) lanes_head_block<D, KV>(P, li, S, g, base, n, j0, masked, per_tile);
  }
  if (it.cascade_blocks > 0) {
    lanes_store_cascade<D>(P, li, S);
    return true;
  }
  lanes_write_out<D>(P, li, S);
  return true;
}

// ---- the row path (decodes, short items): row r = token i · Hq + head h ----

// One work item on the row path; each row's scores over the block in flight at r · np_max.
struct RowItem {
  int Hq, Hkv, G, bs;
  int64_t row_stride;  // elements per slot row
  int ntok;
  const int32_t* toks;
  int nrows;
  int64_t np_max;
};

// A block in flight on the row path: its first slot, its first key's position, the keys any query sees (n), n in
// whole vectors (np) and in W-key chunks.
struct RowBlock {
  int64_t base, j0, n, np, chunks;
};

// int8 pools with head sizes kIntScores allows score (and sum P·V) in integers on the row path
template <int D, typename KV>
constexpr bool kIntRows = std::is_same<KV, int8_t>::value && kIntScores<D>;

// Blocks first … last of the item's table exist and lie inside the pool; else false, *error set.
static inline bool blocks_in_range(const omf::PagedProblem& P, const omf::WorkItem& it, int64_t first, int64_t last,
                                   const char** error) {
  if (last >= it.table_len) {
    *error = "PagedAttention: a position lies beyond its sequence's block table";
    return false;
  }
  const int64_t num_blocks = P.num_slots / P.block_size;
  for (int64_t b = first; b <= last; ++b)
    if (it.table[b] < 0 || it.table[b] >= num_blocks) {
      *error = "PagedAttention: block id out of range of the KV pool";
      return false;
    }
  return true;
}

// The rows' state in S: q (times the scale), acc (D floats a row), m, l, pos; s (np_max scores a row, -inf). An item
// after a cascade (one token) starts from the cascade's state after the shared blocks. int8 pools' integer rows: each
// query row rounded once to int16 (q16, qscale).
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void rows_load(const omf::PagedProblem& P, const omf::WorkItem& it,
                                               const RowItem& ri, Scratch& S) {
  const int Hq = ri.Hq, ntok = ri.ntok, nrows = ri.nrows;
  const int32_t* toks = ri.toks;
  const size_t rows = static_cast<size_t>(nrows);
  S.q.assign(rows * D, 0.0f);
  S.acc.assign(rows * D, 0.0f);
  S.m.assign(rows, kNegInf);
  S.l.assign(rows, 0.0f);
  S.s.assign(rows * ri.np_max, kNegInf);
  S.pos.assign(rows, -1);
  if (it.skip_blocks > 0)
    for (int h = 0; h < Hq; ++h) {
      const float* st = cascade_state<D>(P, toks[0], h);
      S.m[h] = st[0], S.l[h] = st[1];
      std::copy(st + 2, st + 2 + D, &S.acc[static_cast<size_t>(h) * D]);
    }
  for (int i = 0; i < ntok; ++i) {
    const float* q = P.q + toks[i] * P.q_tok_stride;
    for (int h = 0; h < Hq; ++h) {
      const int r = i * Hq + h;
      const float* qh = q + h * P.q_head_stride;
      for (int d = 0; d < D; ++d) S.q[static_cast<size_t>(r) * D + d] = qh[d] * P.scale;
      S.pos[r] = P.positions[toks[i]];
    }
  }
  if constexpr (kIntRows<D, KV>) {
    S.q16.resize(static_cast<size_t>(nrows) * D);
    S.qscale.resize(nrows);
    for (int r = 0; r < nrows; ++r)
      S.qscale[r] = quantize_row_i16<D>(&S.q[static_cast<size_t>(r) * D], &S.q16[static_cast<size_t>(r) * D]);
  }
}

// int8 pools: each row's s[j] (j < n) times the scale of key row j of the row's KV head, `rows` the block's first slot
// row in the key or value pool (the scales gathered per head once).
template <int D>
static inline OMF_ALWAYS_INLINE void rows_times_scales(const int8_t* rows, const RowItem& ri, Scratch& S, int64_t n) {
  gather_scales<int8_t, D>(rows, ri.row_stride, n, ri.Hkv, head_elems<int8_t, D>(), ri.np_max, S.scale);
  for (int r = 0; r < ri.nrows; ++r) {
    const float* sc = &S.scale[(r % ri.Hq / ri.G) * ri.np_max];
    for (int64_t j = 0; j < n; ++j) S.s[r * ri.np_max + j] *= sc[j];
  }
}

// Every row's scores over the block (whole slot rows, W at a time: all heads of a row used while it is in L1, rows
// read in order; one pump() per row and chunk), int8 pools' key scales applied where the scores are float.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void rows_scores(const omf::PagedProblem& P, const RowItem& ri, Scratch& S,
                                                 const RowBlock& blk, PrefetchPump& pump) {
  constexpr int64_t HE = head_elems<KV, D>();
  const int Hq = ri.Hq, Hkv = ri.Hkv, G = ri.G;
  const int64_t row_stride = ri.row_stride, np_max = ri.np_max, n = blk.n;
  const KV* kpool = static_cast<const KV*>(P.key_pool);
  for (int64_t c = 0; c < n; c += Vec::W) {
    const int64_t m = std::min<int64_t>(Vec::W, n - c);
    const KV* kchunk = kpool + (blk.base + c) * row_stride;
    if constexpr (kIntRows<D, KV>) {
      for (int i = 0; i < ri.ntok; ++i)
        for (int g = 0; g < Hkv; ++g) {  // rows i·Hq + g·G … + G − 1: KV head g's query rows of token i
          const int r0 = i * Hq + g * G;
          for (int t = 0; t < G; ++t) pump.pump();
          score_group_i8<D>(&S.q16[static_cast<size_t>(r0) * D], &S.qscale[r0], G, kchunk + g * HE, row_stride, m,
                            &S.s[r0 * np_max + c], np_max);
        }
    } else {
      for (int r = 0; r < ri.nrows; ++r) {
        pump.pump();
        score_chunk<D, KV>(&S.q[static_cast<size_t>(r) * D], kchunk + (r % Hq / G) * HE, row_stride, m,
                           &S.s[r * np_max + c]);
      }
    }
  }
  if constexpr (std::is_same<KV, int8_t>::value && !kIntRows<D, KV>)  // each key row's scale
    rows_times_scales<D>(kpool + blk.base * row_stride, ri, S, n);
}

// Every row's keys hidden from it masked (-inf), then its online softmax over the block: s becomes its
// probabilities, acc rescaled to the new maximum.
template <int D>
static inline OMF_ALWAYS_INLINE void rows_softmax(const omf::PagedProblem& P, const RowItem& ri, Scratch& S,
                                                  const RowBlock& blk) {
  const int64_t j0 = blk.j0, n = blk.n, np = blk.np;
  for (int r = 0; r < ri.nrows; ++r) {
    float* s = &S.s[r * ri.np_max];
    const int64_t p = S.pos[r];
    if (p < j0 + n - 1 || P.window > 0)
      for (int64_t j = 0; j < n; ++j)
        if (!visible(j0 + j, p, P.window)) s[j] = kNegInf;
    std::fill(s + n, s + np, kNegInf);
    const float corr = softmax_update(s, np, S.m[r], S.l[r]);
    if (corr != 1.0f) scale_row<D>(&S.acc[static_cast<size_t>(r) * D], corr);
  }
}

// int8 pools: each value row's scale folded into its probabilities; on the integer rows, each row's probabilities
// then rounded to int16 with the row's own scale (p16, pscale: pv_tile_i16).
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void rows_probabilities(const omf::PagedProblem& P, const RowItem& ri, Scratch& S,
                                                        const RowBlock& blk) {
  if constexpr (std::is_same<KV, int8_t>::value)
    rows_times_scales<D>(static_cast<const KV*>(P.value_pool) + blk.base * ri.row_stride, ri, S, blk.n);
  if constexpr (kIntRows<D, KV>) {
    const int nrows = ri.nrows;
    const int64_t np_max = ri.np_max, np = blk.np;
    S.p16.resize(static_cast<size_t>(nrows) * np_max);
    S.pscale.resize(nrows);
    for (int r = 0; r < nrows; ++r) {
      const float* s = &S.s[r * np_max];
      int16_t* p16 = &S.p16[static_cast<size_t>(r) * np_max];
      const float amax = abs_max(s, np);  // the probabilities past n are 0
      if (!(amax > 0.0f)) {
        std::fill(p16, p16 + np, int16_t{0});
        S.pscale[r] = 0.0f;
        continue;
      }
      for (int64_t j = 0; j < np; j += Vec::W) Vec::to_i16(s + j, 32767.0f / amax, p16 + j);
      S.pscale[r] = amax / 32767.0f;
    }
  }
}

// The pump's next region, spread over the P·V's pump() calls: the next block's key rows, or after the item's last
// block the next item's first ones (`next`; none without one). What is left of this block's values is read first.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void rows_prefetch_next(const omf::PagedProblem& P, const omf::WorkItem& it,
                                                        const omf::WorkItem* next, const RowItem& ri,
                                                        const RowBlock& blk, int64_t b, int64_t last_block,
                                                        int64_t pmax, PrefetchPump& pump) {
  const int Hkv = ri.Hkv, ntok = ri.ntok, bs = ri.bs;
  const int64_t n = blk.n;
  // the P·V (rows_pv) calls pump.pump() `pv_calls` times
  const int64_t pv_calls =
      kIntRows<D, KV> ? Hkv * ntok * pv_tiles<D>(ri.G) * (((n + 1) / 2 + 3) / 4) : blk.chunks * Hkv * ntok;
  pump.drain();
  if (b < last_block) {
    const int64_t nn = std::min<int64_t>(bs, pmax + 1 - (b + 1) * bs);
    pump.start(static_cast<const KV*>(P.key_pool) + it.table[b + 1] * bs * ri.row_stride,
               nn * ri.row_stride * static_cast<int64_t>(sizeof(KV)), pv_calls);
  } else if (next != nullptr) {
    const auto [k0, bytes] = first_key_block<D, KV>(P, *next);
    pump.start(k0, bytes, pv_calls);
  }
}

// P·V of the block into every row's acc: per KV head over the whole block in integers (the integer rows), else in
// chunks of W keys with every KV head's group of query rows in registers over the chunk.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE void rows_pv(const omf::PagedProblem& P, const RowItem& ri, Scratch& S,
                                             const RowBlock& blk, std::vector<const KV*>& vrows, PrefetchPump& pump) {
  constexpr int64_t HE = head_elems<KV, D>();
  const int Hq = ri.Hq, Hkv = ri.Hkv, G = ri.G, ntok = ri.ntok;
  const int64_t row_stride = ri.row_stride, np_max = ri.np_max, base = blk.base, n = blk.n;
  const KV* vpool = static_cast<const KV*>(P.value_pool);
  if constexpr (kIntRows<D, KV>) {
    for (int g = 0; g < Hkv; ++g) {
      for (int64_t j = 0; j < n; ++j) vrows[j] = vpool + (base + j) * row_stride + g * HE;
      if (n & 1) vrows[n] = vrows[n - 1];  // the padding key (probability 0)
      for (int i = 0; i < ntok; ++i) {
        const int r0 = i * Hq + g * G;
        pv_rows_i16<D>(&S.p16[static_cast<size_t>(r0) * np_max], np_max, vrows.data(), n, &S.pscale[r0],
                       &S.acc[static_cast<size_t>(r0) * D], G, pump);
      }
    }
  } else {
    for (int64_t c = 0; c < n; c += Vec::W) {
      const int64_t m = std::min<int64_t>(Vec::W, n - c);
      for (int g = 0; g < Hkv; ++g) {
        for (int64_t j = 0; j < m; ++j) vrows[j] = vpool + (base + c + j) * row_stride + g * HE;
        for (int i = 0; i < ntok; ++i) {
          pump.pump();
          const int r0 = i * Hq + g * G;
          pv_rows<D, KV>(&S.s[r0 * np_max + c], np_max, vrows.data(), m, &S.acc[static_cast<size_t>(r0) * D], G);
        }
      }
    }
  }
}

// Each row's output: its accumulator over its sum l (0 for a row that saw nothing).
template <int D>
static inline OMF_ALWAYS_INLINE void rows_write_out(const omf::PagedProblem& P, const RowItem& ri, const Scratch& S) {
  for (int i = 0; i < ri.ntok; ++i) {
    float* o = P.o + ri.toks[i] * P.o_tok_stride;
    for (int h = 0; h < ri.Hq; ++h) {
      const int r = i * ri.Hq + h;
      const float inv = S.l[r] > 0.0f ? 1.0f / S.l[r] : 0.0f;
      float* oh = o + h * P.o_head_stride;
      for (int d = 0; d < D; ++d) oh[d] = S.acc[static_cast<size_t>(r) * D + d] * inv;
    }
  }
}

// The row path of one work item (see above); blocks first_block … last_block are valid, pmax its last position.
// Memory overlaps compute: each block's value rows are prefetched during its scores, the next block's key rows (or
// the next item's first ones) during its P·V, a few lines per inner call.
template <int D, typename KV>
static inline OMF_ALWAYS_INLINE bool attend_rows(const omf::PagedProblem& P, const omf::WorkItem& it,
                                                 const omf::WorkItem* next, int64_t first_block, int64_t last_block,
                                                 int64_t pmax) {
  RowItem ri;
  ri.Hq = P.q_heads, ri.Hkv = P.kv_heads, ri.G = ri.Hq / ri.Hkv, ri.bs = P.block_size;
  ri.row_stride = static_cast<int64_t>(ri.Hkv) * head_elems<KV, D>();
  ri.ntok = it.count, ri.toks = P.tokens + it.first;
  ri.nrows = ri.ntok * ri.Hq;
  ri.np_max = round_up(ri.bs, Vec::W);
  Scratch& S = scratch();
  rows_load<D, KV>(P, it, ri, S);
  std::vector<const KV*> vrows(ri.bs + 1);
  PrefetchPump pump;
  {  // this item's first key block (usually in flight already: the previous item prefetched it)
    const auto [k0, bytes] = first_key_block<D, KV>(P, it);
    pump.start(k0, bytes, 1);
    pump.drain();
  }
  for (int64_t b = first_block; b <= last_block; ++b) {
    RowBlock blk;
    blk.base = it.table[b] * ri.bs, blk.j0 = b * ri.bs;
    blk.n = std::min<int64_t>(ri.bs, pmax + 1 - blk.j0);  // keys of this block any query can see
    blk.np = round_up(blk.n, Vec::W);
    blk.chunks = (blk.n + Vec::W - 1) / Vec::W;
    pump.start(static_cast<const KV*>(P.value_pool) + blk.base * ri.row_stride,
               blk.n * ri.row_stride * static_cast<int64_t>(sizeof(KV)), blk.chunks * ri.nrows);
    rows_scores<D, KV>(P, ri, S, blk, pump);
    rows_softmax<D>(P, ri, S, blk);
    rows_probabilities<D, KV>(P, ri, S, blk);
    rows_prefetch_next<D, KV>(P, it, next, ri, blk, b, last_block, pmax, pump);
    rows_pv<D, KV>(P, ri, S, blk, vrows, pump);
  }
  rows_write_out<D>(P, ri, S);
  return true;
}

// One work item on the row path or the tile path. `next`: the item this thread most likely runs next (nullptr for
// none); its first key block is prefetched while this item's last block runs.
template <int D, typename KV>
static bool attend_item(const omf::PagedProblem& P, const omf::WorkItem& it, const omf::WorkItem* next,
                        const char** error) {
  const int G = P.q_heads / P.kv_heads;
  const auto [pmin, pmax] = position_range(P, it);
  const int64_t first_block = first_read_block(P, it, pmin);
  const int64_t last_block = it.cascade_blocks > 0 ? it.cascade_blocks - 1 : pmax / P.block_size;
  if (!blocks_in_range(P, it, first_block, last_block, error)) return false;
  const bool row_path =
      kIntRows<D, KV> ? it.count * G <= kRowPathRowsInt && G <= kMaxGroupRows : it.count * G <= kRowPathRows;
  if (it.cascade_blocks > 0 || !row_path) return attend_lanes<D, KV>(P, it, first_block, last_block, pmin, pmax);
  return attend_rows<D, KV>(P, it, next, first_block, last_block, pmax);
}

// Symmetric int8 of one head's row (the pool write): scale = max|x| / 127, q = round-half-even(x / scale) clamped
// to ±127, the scale stored (4 bytes, native float) right after the D values. Vector division and rounding are
// IEEE-exact, so every path writes the same bytes as the scalar formula.
void quantize_kv_int8(const float* x, int64_t D, int8_t* out) {
  using V = typename Vec::V;
  const float scale = abs_max(x, D) / 127.0f;
  if (!(scale > 0.0f)) {
    std::fill(out, out + D, int8_t{0});
  } else {
    const V vs = Vec::set1(scale), hi = Vec::set1(127.0f), lo = Vec::set1(-127.0f);
    const int64_t whole = D / Vec::W * Vec::W;
    for (int64_t d = 0; d < whole; d += Vec::W)
      Vec::store_i8(out + d, Vec::max(lo, Vec::min(hi, Vec::round_nearest(Vec::div(Vec::load(x + d), vs)))));
    for (int64_t d = whole; d < D; ++d) out[d] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(x[d] / scale))));
  }
  std::memcpy(out + D, &scale, sizeof scale);
}

bool attend(const omf::PagedProblem& P, size_t item, const char** error) {
  const omf::WorkItem& it = P.items[item];
  const omf::WorkItem* next = item + 1 < P.num_items ? &P.items[item + 1] : nullptr;
#define OMF_HEAD_DIM(d)                                                               \
  case d:                                                                             \
    switch (P.kv_type) {                                                              \
      case omf::KvType::kBfloat16: return attend_item<d, uint16_t>(P, it, next, error); \
      case omf::KvType::kInt8: return attend_item<d, int8_t>(P, it, next, error);       \
      default: return attend_item<d, float>(P, it, next, error);                      \
    }
  switch (P.head_dim) {  // head_dims.h
    OMF_HEAD_DIMS(OMF_HEAD_DIM)
    default: *error = "PagedAttention: unsupported head_dim"; return false;
  }
#undef OMF_HEAD_DIM
}

void swiglu(const float* in, float* out, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = in + r * 2 * F;
    const float* up = gate + F;
    float* o = out + r * F;
    int64_t i = 0;
    const typename Vec::V one = Vec::set1(1.0f), zero = Vec::zero();
    for (; i + Vec::W <= F; i += Vec::W) {  // silu(g) = g / (1 + exp(-g)); exp of -|g| only (no overflow)
      const typename Vec::V g = Vec::load(gate + i);
      const typename Vec::V e = vexp(Vec::sub(zero, Vec::max(g, Vec::sub(zero, g))));  // exp(-|g|)
      const typename Vec::V inv = Vec::div(one, Vec::add(one, e));  // sigmoid(|g|)
      const typename Vec::V sig = Vec::select_positive(g, inv, Vec::mul(e, inv));  // g < 0: e / (1 + e), no cancellation
      Vec::store(o + i, Vec::mul(Vec::mul(g, sig), Vec::load(up + i)));
    }
    for (; i < F; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

// AddRMSNorm over `rows` rows of H: sum = a + b; y = sum / sqrt(mean(sum²) + eps) · w (sum of squares in float,
// W lanes then a horizontal sum).
void add_rms_norm(const float* a, const float* b, const float* w, float eps, float* y, float* sum, int64_t rows,
                  int64_t H) {
  using V = typename Vec::V;
  for (int64_t r = 0; r < rows; ++r) {
    const float* ar = a + r * H;
    const float* br = b + r * H;
    float* sr = sum + r * H;
    float* yr = y + r * H;
    V acc = Vec::zero();
    int64_t i = 0;
    for (; i + Vec::W <= H; i += Vec::W) {
      const V v = Vec::add(Vec::load(ar + i), Vec::load(br + i));
      Vec::store(sr + i, v);
      acc = Vec::fma(v, v, acc);
    }
    float ss = Vec::hsum(acc);
    for (; i < H; ++i) {
      sr[i] = ar[i] + br[i];
      ss += sr[i] * sr[i];
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    const V vinv = Vec::set1(inv);
    for (i = 0; i + Vec::W <= H; i += Vec::W)
      Vec::store(yr + i, Vec::mul(Vec::mul(Vec::load(sr + i), vinv), Vec::load(w + i)));
    for (; i < H; ++i) yr[i] = sr[i] * inv * w[i];
  }
}
