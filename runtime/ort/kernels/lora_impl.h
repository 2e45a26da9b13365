// LoraAdd's shrink and expand over one ISA's vector type `Vec` (lora.h has the contract). Included inside a
// namespace after the path's target pragma (lora_avx512.cpp, lora_avx2.cpp, lora_generic.cpp), so it includes
// nothing itself. Vec gives W lanes, zero/load/store, their partial forms for the first n < W lanes, fma, set1,
// reduce_rows (W vectors → the W sums) and the tile sizes: kDotRows (a dot tile is kDotRows tokens × W / kDotRows
// rows), kRows × kVecs (an expand row tile: tokens × vectors of W columns).
//
// Two tiles:
//  - dot tile: sums[i, j] = Σ_k x_i[k] · w_j[k] over a long k — W accumulators, one per (i, j), reduced together
//    by one transposed reduction. The shrink (x: the tokens' inputs, w: A_s's rows, k over in) and the expand of a
//    slot with few tokens (x: H rows, w: B_s's rows as they lie, k over PR).
//  - row tile: y'[i, o..] = y[i, o..] + Σ_r H[i, r] · Bt[r, o..] — the GEMM register tile over B_s transposed,
//    for a slot with many tokens (the transposition, once per slot and step, then costs less than the dot tiles'
//    reductions).

using V = Vec::V;
constexpr int W = Vec::W;

// `sums` [MT · NJ] (MT · NJ = W): row i of x (xr[i]) against row j of w (wr[j]) over K
template <int MT, int NJ>
inline void dot_tile(const float* const* xr, const float* const* wr, int64_t K, float* sums) {
  static_assert(MT * NJ == W, "a dot tile holds W sums");
  V acc[MT * NJ];
  for (int i = 0; i < MT * NJ; ++i) acc[i] = Vec::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    V xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = Vec::load(xr[i] + k);
    for (int j = 0; j < NJ; ++j) {
      const V wv = Vec::load(wr[j] + k);
      for (int i = 0; i < MT; ++i) acc[i * NJ + j] = Vec::fma(xv[i], wv, acc[i * NJ + j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    V xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = Vec::load_partial(xr[i] + k, n);
    for (int j = 0; j < NJ; ++j) {
      const V wv = Vec::load_partial(wr[j] + k, n);
      for (int i = 0; i < MT; ++i) acc[i * NJ + j] = Vec::fma(xv[i], wv, acc[i * NJ + j]);
    }
  }
  Vec::store(sums, Vec::reduce_rows(acc));
}

// dot tiles over the tokens order[begin, begin + count) × the rows [0, rows) of w (row j at w + j · ldw): `emit(i, j,
// sum)` for each valid pair (i: the position in order[]). A ragged edge repeats the last token / row (results
// dropped), so every tile is full.
template <typename XRow, typename Emit>
inline void dot_tiles(int64_t begin, int64_t count, XRow xrow, const float* w, int64_t ldw, int64_t rows, int64_t K,
                      Emit emit) {
  constexpr int MT = Vec::kDotRows, NJ = W / MT;
  alignas(64) float sums[W];
  int64_t i0 = begin;
  for (; i0 + MT <= begin + count; i0 += MT)  // full token tiles: MT tokens × NJ rows
    for (int64_t j0 = 0; j0 < rows; j0 += NJ) {
      const float* xr[MT];
      const float* wr[NJ];
      for (int i = 0; i < MT; ++i) xr[i] = xrow(i0 + i);
      for (int j = 0; j < NJ; ++j) wr[j] = w + std::min<int64_t>(j0 + j, rows - 1) * ldw;
      dot_tile<MT, NJ>(xr, wr, K, sums);
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NJ && j0 + j < rows; ++j) emit(i0 + i, j0 + j, sums[i * NJ + j]);
    }
  for (; i0 < begin + count; ++i0)  // the last tokens one at a time: 1 token × W rows
    for (int64_t j0 = 0; j0 < rows; j0 += W) {
      const float* xr[1] = {xrow(i0)};
      const float* wr[W];
      for (int j = 0; j < W; ++j) wr[j] = w + std::min<int64_t>(j0 + j, rows - 1) * ldw;
      dot_tile<1, W>(xr, wr, K, sums);
      for (int j = 0; j < W && j0 + j < rows; ++j) emit(i0, j0 + j, sums[j]);
    }
}

// MR rows × up to kVecs · W columns from o (c of them): y' = y + H · Bt
template <int MR>
inline void row_tile(const LoraProblem& P, const LoraGroup& g, int64_t i0, int64_t o, int64_t c) {
  constexpr int NV = Vec::kVecs;
  const float* yin[MR];
  float* yout[MR];
  const float* hr[MR];
  for (int r = 0; r < MR; ++r) {
    const int64_t t = P.order[i0 + r];
    yin[r] = P.y + t * P.out_dim + o, yout[r] = P.out + t * P.out_dim + o, hr[r] = P.h + (i0 + r) * P.pr;
  }
  V acc[MR][NV];
  const bool full = c == NV * W;
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NV; ++q) {
      const int64_t n = std::min<int64_t>(W, c - q * W);
      acc[r][q] = full ? Vec::load(yin[r] + q * W) : n > 0 ? Vec::load_partial(yin[r] + q * W, n) : Vec::zero();
    }
  const float* bt = g.bt + o;
  for (int64_t k = 0; k < P.pr; ++k, bt += g.ldbt) {  // Bt has zero columns up to ldbt: whole vectors load
    V wv[NV];
    for (int q = 0; q < NV; ++q) wv[q] = Vec::load(bt + q * W);
    for (int r = 0; r < MR; ++r) {
      const V hv = Vec::set1(hr[r][k]);
      for (int q = 0; q < NV; ++q) acc[r][q] = Vec::fma(hv, wv[q], acc[r][q]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NV; ++q) {
      const int64_t n = std::min<int64_t>(W, c - q * W);
      if (full) Vec::store(yout[r] + q * W, acc[r][q]);
      else if (n > 0) Vec::store_partial(yout[r] + q * W, acc[r][q], n);
    }
}

template <int MR>
inline void row_tiles(const LoraProblem& P, const LoraGroup& g, int64_t i0, int64_t o0, int64_t o1) {
  constexpr int64_t step = Vec::kVecs * W;
  for (int64_t o = o0; o < o1; o += step) row_tile<MR>(P, g, i0, o, std::min(step, o1 - o));
}

void shrink(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count) {
  const float* a = P.a + g.slot * P.pr * P.in;
  dot_tiles(begin, count, [&](int64_t i) { return P.x + P.order[i] * P.in; }, a, P.in, P.pr, P.in,
            [&](int64_t i, int64_t r, float s) { P.h[i * P.pr + r] = s; });
}

void expand(const LoraProblem& P, const LoraGroup& g, int64_t begin, int64_t count, int64_t o0, int64_t o1) {
  if (g.bt == nullptr) {  // dot tiles over B_s's rows o0..o1
    const float* b = P.b + (g.slot * P.out_dim + o0) * P.pr;
    dot_tiles(begin, count, [&](int64_t i) { return P.h + i * P.pr; }, b, P.pr, o1 - o0, P.pr,
              [&](int64_t i, int64_t o, float s) {
                const int64_t at = P.order[i] * P.out_dim + o0 + o;
                P.out[at] = P.y[at] + s;
              });
    return;
  }
  constexpr int MR = Vec::kRows;
  int64_t i0 = begin;
  for (; i0 + MR <= begin + count; i0 += MR) row_tiles<MR>(P, g, i0, o0, o1);
  for (; i0 < begin + count; ++i0) row_tiles<1>(P, g, i0, o0, o1);
}
