// MatMulQ on the AMX tile unit (amx-int8), for the rows of a call that fill whole 16-row tiles; the rest of the rows
// go to the AVX-512 VNNI path. Bit for bit the VNNI path's results, so which rows take which path changes nothing:
// per 32-k chunk the exact int32 products Σ (c − z)·a of 16 rows × 16 columns come from one tdpbssd (activations:
// A tile, 16 rows × 32 bytes straight from the quantized rows; signed codes c − z: B tile, 8 rows of 64 bytes — the
// panel16 layout's groups with their top bit flipped for 8 bits, the nibbles of each group split into two rows and
// less 8 for 4 bits), and then the same float operations in the same order as the VNNI tile (qgemm_avx512.cpp):
//   acc = fma(float(dot), s·d, acc) per chunk; acc = fma(m, xsum, acc) per block.
// One panel at a time, its 16 float accumulators per row tile in registers; the panel's signed codes are made once
// per call into a per-thread, 64-byte aligned buffer and shared by every row tile, and each row tile's scales
// (d, Σa) are transposed once per call so a chunk reads them as one vector per row. Software-pipelined three chunks
// deep: chunk j+2's tdpbssd is issued and chunk j+1's tile stored while chunk j is scaled, so the tile unit and the
// vector unit overlap; C, A and B tiles alternate by chunk parity. Tile configuration loaded per call and released
// after it, as in bgemm_amx.cpp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include "amx.h"

namespace omf::amx {

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")

namespace {

// tiles 0–1: C (16 rows × 16 int32), 4–5: A (16 rows × 32 bytes), 6–7: B (8 rows × 64 bytes). Chunk j uses
// C, A and B tiles of parity j % 2: tiles are not renamed, so a load into the tile the previous chunk's tdpbssd
// still reads would wait for it.
void configure() {
  TileConfig c = palette1();
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t : {6, 7}) c.rows[t] = 8, c.colsb[t] = 64;
  load(c);
}

inline uint8_t* align64(uint8_t* p) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// panel p's signed codes c − z as B tiles: chunk j at out + j·512 (8 rows of 64 bytes, k quad t = row t); 8-bit
// codes are that layout already (c − 128: the top bit flipped), 4-bit groups are split into their low (quad 2h) and
// high (quad 2h+1) nibbles, less 8
template <int BITS>
const uint8_t* b_tiles(const QGemmProblem& P, int64_t p, std::vector<uint8_t>& buf) {
  const int64_t chunks = P.Kp / kChunk;
  constexpr int64_t chunk_bytes = kPanel * kChunk * BITS / 8;
  const uint8_t* panel = P.codes + p * chunks * chunk_bytes;
  buf.resize(static_cast<size_t>(chunks * 512 + 64));
  uint8_t* out = align64(buf.data());  // a tile row split over two cache lines costs both
  if constexpr (BITS == 8) {
    const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = 0; i < chunks * 8; ++i)
      _mm512_store_si512(out + i * 64, _mm512_xor_si512(_mm512_loadu_si512(panel + i * 64), top));
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t j = 0; j < chunks; ++j)
      for (int h = 0; h < 4; ++h) {
        const __m512i v = _mm512_loadu_si512(panel + j * chunk_bytes + h * 64);
        _mm512_store_si512(out + j * 512 + (2 * h) * 64, _mm512_sub_epi8(_mm512_and_si512(v, low4), eight));
        _mm512_store_si512(out + j * 512 + (2 * h + 1) * 64,
                           _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight));
      }
  }
  return out;
}

// the products of chunk j into C tile T from A tile A and B tile B (literals: the intrinsics want them)
#define OMF_CHUNK_PRODUCTS(T, A, B, j)                         \
  do {                                                         \
    _tile_zero(T);                                             \
    _tile_loadd(A, a + (j) * kChunk, P.Kp);                    \
    _tile_loadd(B, bt + (j) * 512, 64);                        \
    _tile_dpbssd(T, A, B);                                     \
  } while (0)

// Row tile m0's per-chunk scales d and per-block sums Σx, transposed: dt[j·16 + r], xt[b·16 + r] (one broadcast
// each from a constant offset, so the scaling loop needs no per-row address)
struct RowTileScales {
  std::vector<float> d, xsum;
};

void transpose_scales(const QGemmProblem& P, int64_t m0, bool offsets, RowTileScales& t) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block;
  t.d.resize(static_cast<size_t>(chunks * 16));
  for (int64_t j = 0; j < chunks; ++j)
    for (int r = 0; r < 16; ++r) t.d[j * 16 + r] = P.x.d[(m0 + r) * chunks + j];
  if (!offsets) return;
  t.xsum.resize(static_cast<size_t>(kb * 16));
  for (int64_t b = 0; b < kb; ++b)
    for (int r = 0; r < 16; ++r) t.xsum[b * 16 + r] = P.x.xsum[(m0 + r) * kb + b];
}

// chunk j's int32 products (dot, 16 rows × 16 columns) into the float accumulators: acc += float(dot)·(s·d)
// (s: the panel's block scales, dr: the rows' chunk scales), the VNNI tile's operations in its order
__attribute__((always_inline)) inline void scale_chunk(__m512 (&acc)[16], const int32_t* dot, __m512 s,
                                                       const float* dr) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot + 16 * r)), _mm512_mul_ps(s, _mm512_set1_ps(dr[r])),
                             acc[r]);
}

// the offsets' term of block b, after its last chunk: acc += o·Σx
__attribute__((always_inline)) inline void offset_term(__m512 (&acc)[16], __m512 o, const float* xr) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xr[r]), acc[r]);
}

template <int BITS, bool OFFSETS>
void row_tile(const QGemmProblem& P, int64_t m0, int64_t p, const uint8_t* bt, const RowTileScales& t) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block;
  const int shift = P.block == 128 ? 2 : P.block == 64 ? 1 : 0;  // chunk j is in block j >> shift
  const int64_t last = (int64_t{1} << shift) - 1;                  // a block's last chunk: (j & last) == last
  const uint16_t* sp = P.scales + p * kb * kPanel;
  const float* op = OFFSETS ? P.offsets + p * kb * kPanel : nullptr;
  const int8_t* a = P.x.a + m0 * P.Kp;
  const float* d = t.d.data();
  const float* xs = OFFSETS ? t.xsum.data() : nullptr;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) int32_t dot[2][16 * 16];
  // software pipeline over the chunks, two per turn, three chunks in flight: while chunk j is scaled from the
  // int32 tile stored one step before (its loads never wait on a tile store), chunk j + 1's tile is stored and
  // chunk j + 2's products are issued (tiles of parity j % 2, free since chunk j's store)
#define OMF_SCALE(J)                                                                                             \
  do {                                                                                                           \
    const int64_t b = (J) >> shift;                                                                              \
    scale_chunk(acc, dot[(J) % 2], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + b * kPanel))),    \
                d + (J) * 16);                                                                                   \
    if (OFFSETS && ((J) & last) == last) offset_term(acc, _mm512_loadu_ps(op + b * kPanel), xs + b * 16);        \
  } while (0)
  OMF_CHUNK_PRODUCTS(0, 4, 6, 0);
  if (chunks > 1) OMF_CHUNK_PRODUCTS(1, 5, 7, 1);
  _tile_stored(0, dot[0], 64);
  for (int64_t j = 0; j < chunks; j += 2) {
    if (j + 2 < chunks) OMF_CHUNK_PRODUCTS(0, 4, 6, j + 2);
    if (j + 1 < chunks) _tile_stored(1, dot[1], 64);
    OMF_SCALE(j);
    if (j + 1 == chunks) break;
    if (j + 3 < chunks) OMF_CHUNK_PRODUCTS(1, 5, 7, j + 3);
    if (j + 2 < chunks) _tile_stored(0, dot[0], 64);
    OMF_SCALE(j + 1);
  }
#undef OMF_SCALE
  const int64_t n0 = p * kPanel, valid = std::min<int64_t>(kPanel, P.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const bool stream = P.N >= kStreamColumns;
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    float* y = P.y + (m0 + r) * P.N + n0;
    if (stream && valid == kPanel && (reinterpret_cast<uintptr_t>(y) & 63) == 0) _mm512_stream_ps(y, acc[r]);
    else _mm512_mask_storeu_ps(y, mask, acc[r]);
  }
}
#undef OMF_CHUNK_PRODUCTS

template <int BITS>
void panels(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end, int64_t rows) {
  thread_local std::vector<uint8_t> buf;  // this thread's signed codes of one panel, kept between calls
  thread_local std::vector<RowTileScales> scales;  // and its row tiles' transposed scales, made once per call
  scales.resize(static_cast<size_t>(rows / 16));
  for (int64_t m0 = 0; m0 < rows; m0 += 16) transpose_scales(P, m0, P.offsets != nullptr, scales[m0 / 16]);
  configure();
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const uint8_t* bt = b_tiles<BITS>(P, p, buf);
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      if (P.offsets) row_tile<BITS, true>(P, m0, p, bt, scales[m0 / 16]);
      else row_tile<BITS, false>(P, m0, p, bt, scales[m0 / 16]);
    }
  }
  _tile_release();
}

}  // namespace

void qgemm(const QGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  const int64_t rows = P.M / 16 * 16;  // whole tiles here, the rest on the VNNI path
  if (rows > 0) {
    if (P.bits == 4) panels<4>(P, panel_begin, panel_end, rows);
    else panels<8>(P, panel_begin, panel_end, rows);
  }
  if (rows < P.M) {
    const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block;
    QGemmProblem rest = P;
    rest.x.a += rows * P.Kp;
    rest.x.d += rows * chunks;
    rest.x.asum += rows * chunks;
    rest.x.xsum += rows * kb;
    rest.y += rows * P.N;
    rest.M = P.M - rows;
    avx512vnni::qgemm(rest, panel_begin, panel_end);
  } else if (P.N >= kStreamColumns) {
    _mm_sfence();
  }
}

}  // namespace omf::amx

#pragma GCC pop_options

#else  // no tile unit on this platform: never chosen

namespace omf::amx {
void qgemm(const QGemmProblem&, int64_t, int64_t) {}
}  // namespace omf::amx

#endif
