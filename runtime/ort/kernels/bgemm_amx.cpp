// MatMulBF16 and MatMulQBF16 on the AMX tile unit (chosen at run time when the CPU has amx-bf16 and Linux grants
// this process the tile data state; see qgemm_op.cpp). The panel16-bf16 layout (bgemm_generic.cpp) is already the
// tile unit's B operand: 16 consecutive k pairs of a panel are 16 rows of 64 bytes (16 columns × 2 k), one tile
// load. A block of up to 2 × 16 rows × 2 panels keeps 4 float32 accumulator tiles (C 0–3), two activation tiles
// (A 4–5: 16 rows × 32 k) and two weight tiles (B 6–7); per 32 k it loads 4 tiles and issues 4 tdpbf16ps.
// Contract: the caller's activations have a row stride `lda` that is a multiple of 32 (zero past K) and a multiple of
// 16 rows (zero past M) — Bf16Isa's m_align and k_align; the products are those of the other paths (bf16 × bf16,
// float32 sums; the tile unit flushes denormals as vdpbf16ps does), summed in another order.
// The tile configuration is loaded per call and released before returning: another library on the same thread
// (MLAS's AMX kernels) may configure the tiles its own way between our calls.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include "amx.h"

namespace omf::amx {

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

namespace {

// C and A tiles of `rows` rows (M itself below 16: no wasted rows), B tiles of 16 k pairs; all 64 bytes wide
void configure(int rows) {
  TileConfig c = palette1();
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
    c.colsb[t] = 64;
  }
  load(c);
}

// tile t of C (0–3) to memory (the intrinsic wants its tile number as a literal)
inline void tile_stored(int t, void* p, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    default: _tile_stored(3, p, stride); break;
  }
}

// C tile `TILE` (rows m0.., columns n0..n0+15) into y, only what lies inside [M, N]
template <int TILE>
void store(const Bf16Panels& T, int64_t m0, int64_t n0, int rows) {
  const int64_t vr = std::min<int64_t>(rows, T.M - m0), vc = std::min<int64_t>(kPanel, T.N - n0);
  if (vr <= 0 || vc <= 0) return;
  if (vr == rows && vc == kPanel) {
    tile_stored(TILE, T.y + m0 * T.N + n0, T.N * 4);
    return;
  }
  alignas(64) float buf[16 * 16];
  tile_stored(TILE, buf, 64);
  for (int64_t r = 0; r < vr; ++r) std::memcpy(T.y + (m0 + r) * T.N + n0, buf + r * 16, vc * 4);
}

// rows m0 .. m0 + 16·MT of the NP panels at T.w (tiles of `rows` rows each)
template <int MT, int NP>
void block(const Bf16Panels& T, int64_t m0, int rows) {
  const int64_t pairs = T.Kp / 2, panel_elems = pairs * 32, lda_bytes = T.lda * 2;
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NP == 2) _tile_zero(3);
  alignas(64) uint16_t tail[2][16 * 32];  // the last k step's pairs when Kp is not a multiple of 32, zero-padded
  for (int64_t i = 0; i < pairs; i += 16) {
    const uint16_t* b0 = T.w + i * 32;
    const uint16_t* b1 = b0 + panel_elems;
    if (i + 16 > pairs) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail[0], b0, (pairs - i) * 64);
      if constexpr (NP == 2) std::memcpy(tail[1], b1, (pairs - i) * 64);
      b0 = tail[0];
      b1 = tail[1];
    }
    const uint16_t* a = T.a + m0 * T.lda + 2 * i;
    _tile_loadd(6, b0, 64);
    if constexpr (NP == 2) _tile_loadd(7, b1, 64);
    _tile_loadd(4, a, lda_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, a + 16 * T.lda, lda_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  store<0>(T, m0, T.n0, rows);
  if constexpr (NP == 2) store<1>(T, m0, T.n0 + kPanel, rows);
  if constexpr (MT == 2) store<2>(T, m0 + 16, T.n0, rows);
  if constexpr (MT == 2 && NP == 2) store<3>(T, m0 + 16, T.n0 + kPanel, rows);
}

template <int NP>
void blocks(const Bf16Panels& T, int rows) {
  for (int64_t m0 = 0; m0 < T.M; m0 += 32) {
    if (T.M - m0 > 16) block<2, NP>(T, m0, rows);
    else block<1, NP>(T, m0, rows);
  }
}

}  // namespace

void bf16_panels(const Bf16Panels& T, int panels) {
  const int rows = static_cast<int>(std::min<int64_t>(16, T.M));
  configure(rows);
  if (panels == 2) blocks<2>(T, rows);
  else blocks<1>(T, rows);
  _tile_release();
}

void bgemm(const BGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = P.Kp / 2 * 32;
  for (int64_t p = panel_begin; p < panel_end; p += 2)
    bf16_panels({P.a, P.codes + p * panel_elems, P.y, P.M, P.N, P.Kp, p * kPanel, P.lda}, p + 1 < panel_end ? 2 : 1);
}

void qbgemm(const QBGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  qbgemm_pairs(P, panel_begin, panel_end, [&P](int64_t p, uint16_t* out) { avx512bf16::decompress_panel(P, p, out); },
               [](const Bf16Panels& T, int n) { bf16_panels(T, n); });
}

}  // namespace omf::amx

#pragma GCC pop_options

#else  // no tile unit on this platform: never chosen

namespace omf::amx {
void bgemm(const BGemmProblem&, int64_t, int64_t) {}
void bf16_panels(const Bf16Panels&, int) {}
void qbgemm(const QBGemmProblem&, int64_t, int64_t) {}
}  // namespace omf::amx

#endif
