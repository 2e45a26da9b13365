// MatMulQ on the AMX tile unit (amx-int8), for the rows of a call that fill whole 16-row tiles; the rest of the rows
// go to the AVX-512 VNNI path. Bit for bit the VNNI path's results, so which rows take which path changes nothing:
// per 32-k chunk the exact int32 products Σ (c − z)·a of 16 rows × 16 columns come from one tdpbssd (activations:
// A tile, 16 rows × 32 bytes straight from the quantized rows; signed codes c − z: B tile, 8 rows of 64 bytes — the
// panel16 layout's groups with their top bit flipped for 8 bits, the nibbles of each group split into two rows and
// less 8 for 4 bits), and then the same float operations in the same order as the VNNI tile (qgemm_avx512.cpp):
//   acc = fma(float(dot), s·d, acc) per chunk; acc = fma(m, xsum, acc) per block.
// One panel at a time, its 16 float accumulators per row tile in registers; the panel's signed codes are made once
// per call into a per-thread buffer and shared by every row tile. Tile configuration loaded per call and
// released after it, as in bgemm_amx.cpp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include "amx.h"

namespace omf::amx {

namespace {
bool ask_int8() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8") ||
      !__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
    return false;
  return request_tile_data();
}
}  // namespace

bool available_int8() {
  static const bool granted = ask_int8();
  return granted;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")

namespace {

// tiles 0–1: C (16 rows × 16 int32), 4–5: A (16 rows × 32 bytes), 6: B (8 rows × 64 bytes)
void configure() {
  TileConfig c = palette1();
  for (int t : {0, 1}) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t : {4, 5}) c.rows[t] = 16, c.colsb[t] = 32;
  c.rows[6] = 8, c.colsb[6] = 64;
  load(c);
}

constexpr int64_t kStreamColumns = 8192;  // as the VNNI path: wide outputs (the logits) with streaming stores

// panel p's signed codes c − z as B tiles: chunk j at out + j·512 (8 rows of 64 bytes, k quad t = row t); 8-bit
// codes are that layout already (c − 128: the top bit flipped), 4-bit groups are split into their low (quad 2h) and
// high (quad 2h+1) nibbles, less 8
template <int BITS>
const uint8_t* b_tiles(const QGemmProblem& P, int64_t p, std::vector<uint8_t>& buf) {
  const int64_t chunks = P.Kp / kChunk;
  constexpr int64_t chunk_bytes = kPanel * kChunk * BITS / 8;
  const uint8_t* panel = P.codes + p * chunks * chunk_bytes;
  buf.resize(static_cast<size_t>(chunks * 512));
  if constexpr (BITS == 8) {
    const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = 0; i < chunks * 8; ++i)
      _mm512_storeu_si512(buf.data() + i * 64, _mm512_xor_si512(_mm512_loadu_si512(panel + i * 64), top));
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t j = 0; j < chunks; ++j)
      for (int h = 0; h < 4; ++h) {
        const __m512i v = _mm512_loadu_si512(panel + j * chunk_bytes + h * 64);
        _mm512_storeu_si512(buf.data() + j * 512 + (2 * h) * 64, _mm512_sub_epi8(_mm512_and_si512(v, low4), eight));
        _mm512_storeu_si512(buf.data() + j * 512 + (2 * h + 1) * 64,
                            _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight));
      }
  }
  return buf.data();
}

// the products of chunk j into C tile T (literal: the intrinsics want one)
#define OMF_CHUNK_PRODUCTS(T, A, j)                                \
  do {                                                             \
    _tile_zero(T);                                                 \
    _tile_loadd(A, P.x.a + m0 * P.Kp + (j) * kChunk, P.Kp);        \
    _tile_loadd(6, bt + (j) * 512, 64);                            \
    _tile_dpbssd(T, A, 6);                                         \
  } while (0)

template <int BITS>
void row_tile(const QGemmProblem& P, int64_t m0, int64_t p, const uint8_t* bt) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block, per_block = P.block / kChunk;
  const float* sp = P.scales + p * kb * kPanel;
  const float* op = P.offsets ? P.offsets + p * kb * kPanel : nullptr;
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) int32_t dot[2][16 * 16];
  // software pipeline over the chunks: chunk j + 1's products (C tile (j + 1) % 2) are issued before chunk j's
  // are stored and scaled, so the tile unit works while the vector unit converts
  OMF_CHUNK_PRODUCTS(0, 4, 0);
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t b = j / per_block;
    if (j % 2 == 0) {
      if (j + 1 < chunks) OMF_CHUNK_PRODUCTS(1, 5, j + 1);
      _tile_stored(0, dot[0], 64);
    } else {
      if (j + 1 < chunks) OMF_CHUNK_PRODUCTS(0, 4, j + 1);
      _tile_stored(1, dot[1], 64);
    }
    const int32_t* dj = dot[j % 2];
    const __m512 s = _mm512_loadu_ps(sp + b * kPanel);
    for (int r = 0; r < 16; ++r) {
      const __m512 d = _mm512_set1_ps(P.x.d[(m0 + r) * chunks + j]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dj + 16 * r)), _mm512_mul_ps(s, d), acc[r]);
    }
    if (op && (j + 1) % per_block == 0) {  // the block's last chunk: its offset's term
      const __m512 o = _mm512_loadu_ps(op + b * kPanel);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(P.x.xsum[(m0 + r) * kb + b]), acc[r]);
    }
  }
  const int64_t n0 = p * kPanel, valid = std::min<int64_t>(kPanel, P.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const bool stream = P.N >= kStreamColumns;
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
  configure();
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const uint8_t* bt = b_tiles<BITS>(P, p, buf);
    for (int64_t m0 = 0; m0 < rows; m0 += 16) row_tile<BITS>(P, m0, p, bt);
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
bool available_int8() { return false; }
void qgemm(const QGemmProblem&, int64_t, int64_t) {}
}  // namespace omf::amx

#endif
