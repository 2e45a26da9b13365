// MatMulQ: y [M, N] = x [M, K] · Wᵀ for a block-quantized weight W [N, K], with int8 activations (the ORT CPU
// lowering of every quantized weight MatMul; passes/gemm_pack.py writes the weight layout below).
//
// Weight layout "panel16" (version kPanelLayout): W's codes c[n, k] are unsigned (4 bits: 0..15, 8 bits: 0..255)
// with zero point z = 2^(bits-1), scales s[n, b] and an optional block offset m[n, b] per weight block b of
// `block` (32, 64 or 128) consecutive k:   W[n, k] = (c[n, k] - z) · s[n, k / block] + m[n, k / block].
// N is padded to Np = 16·P (padding columns: code z, scale 0) and K to Kp = kb·block (padding codes z).
//   codes   uint8 [P, Kp/32, 16·32·bits/8]: panel p (columns 16p..16p+15), chunk j (k = 32j..32j+31):
//             8 bits: 8 groups g of 64 bytes; byte 4i+e = c[16p+i, 32j+4g+e]
//             4 bits: 4 groups h of 64 bytes; byte 4i+e = c[16p+i, 32j+8h+e] | c[16p+i, 32j+8h+4+e] << 4
//   scales  float16 [P, kb, 16] (IEEE binary16: GGUF's own d, and round-to-nearest scales rounded to it before the
//           codes are chosen — passes/quant.py — so no value changes; 2 bytes a block instead of 4: at 4 bits and
//           blocks of 32 a weight costs 18 bytes per 32, GGUF Q4_0's 18, where float32 scales made it 20),
//   offsets float [P, kb, 16] (absent for symmetric blocks; Q4_1's offset m + z·d is no binary16 value in general)
// Each 64-byte group is 16 int32 lanes of 4 consecutive k: one vpdpbusd against 4 broadcast activations.
//
// Activations are quantized once per call, symmetric int8 per 32 consecutive k of a row (d = max|x| / 127,
// a = round-half-even(x / d)); the products are exact integers per chunk, the zero point taken out in them
// (Σ_k (c − z)·a = Σ_k c·a − z·Σ_k a: signed codes on the tile unit, the accumulator started at −z·Σa on the
// vector paths), then
//   y[m, n] = Σ_b (Σ_{j∈b} s[n,b]·d[m,j] · Σ_k (c − z)·a)  +  m[n,b] · Σ_{k∈b} x[m,k]
// in float32, one fma per chunk (its product s·d rounded first) and one per block for the offset (the exact float
// block sums of x, so affine blocks cost one FMA per block, not a MatMul).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace omf {

constexpr int kPanelLayout = 2;  // bump with any change of the byte layout above (2: float16 scales)
constexpr int kPanel = 16;       // columns per panel
constexpr int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }  // panels holding n columns
constexpr int kChunk = 32;       // k per activation scale

// Outputs at least this wide (an lm_head's logits, far beyond L2) are written with streaming stores by the vector
// and tile GEMMs: a plain store of a line not in cache reads it first (~2× slower measured at M 64, MatMulQ).
constexpr int64_t kStreamColumns = 8192;
// Up to this many rows the AVX-512 GEMMs prefetch the next pair of panels while they multiply a pair; beyond, the
// first tile's misses are a small share of a pair's many tiles and the prefetches only displace them (MatMulBF16 at
// M 256–512: 2–10% slower with them).
constexpr int64_t kPrefetchRows = 128;

struct QuantizedRows {  // the activations of one call, made by quantize_rows
  int8_t* a;            // [M, Kp]
  float* d;             // [M, Kp/32] scale per chunk
  int32_t* asum;        // [M, Kp/32] Σa per chunk (the zero point's term, taken out in integers)
  float* xsum;          // [M, kb]  Σ_{k∈b} x     (the offsets' term; filled only when the weight has offsets)
};

// One quantized chunk's bookkeeping, shared by every path (their results agree bit for bit): its scale d and the
// sum of its codes Σa.
inline void record_chunk(const QuantizedRows& q, int64_t m, int64_t chunks, int64_t j, float d, int32_t sum) {
  q.d[m * chunks + j] = d;
  q.asum[m * chunks + j] = sum;
}

// Σ_{k∈b} x of every weight block b of row xr, in one fixed order that every path computes the same (the float64
// reference does not depend on it): k past K counts as 0.0f; per block, 16 lanes acc[i] = x[i], then acc[i] +=
// x[16c + i] for c = 1 … block/16 − 1 (the vector path's add of the chunk's two 16-lane halves, chunk after
// chunk), then acc[i] + acc[i + 8], that + its [i + 4], that + its [i + 2], and lane 0 + lane 1 (the vector path's
// halving tree). Summed block after block in k order it was one dependent scalar add per element: quantizing 64
// rows of K 1,536 took 60–83 µs with the sums against 22 without (one thread); this order is a few vector adds
// per 32 elements.
inline void block_sums(const float* xr, int64_t K, int64_t block, int64_t kb, float* out) {
  for (int64_t b = 0; b < kb; ++b) {
    float acc[16];
    for (int64_t c = 0; c < block / 16; ++c)
      for (int i = 0; i < 16; ++i) {
        const int64_t k = b * block + c * 16 + i;
        const float v = k < K ? xr[k] : 0.0f;
        acc[i] = c == 0 ? v : acc[i] + v;
      }
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) acc[i] = acc[i] + acc[i + w];
    out[b] = acc[0];
  }
}

// IEEE binary16 bits → float, exactly (every binary16 value is a float): the portable paths' scale reads; the vector
// paths convert 8 or 16 at a time (vcvtph2ps), to the same values.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man · 2^-24
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 0x1F ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct QGemmProblem {
  QuantizedRows x;
  const uint8_t* codes;
  const uint16_t* scales;  // float16 bits
  const float* offsets;  // null: symmetric
  float* y;
  int64_t M, N, K, Kp, bits, block;
};

// the columns [16·panel_begin, 16·panel_end) of y, every row
using QGemmFn = void (*)(const QGemmProblem&, int64_t panel_begin, int64_t panel_end);
// rows [row_begin, row_end) of x [M, K] (float) into q (Kp, block as in the problem; xsum when want_xsum)
using QuantizeFn = void (*)(const float* x, int64_t K, int64_t Kp, int64_t block, bool want_xsum,
                            const QuantizedRows& q, int64_t row_begin, int64_t row_end);

// c[16p+i, 32j+t] of a panel16 chunk (`chunk`: panel p's bytes of chunk j), read from the layout above
inline int code_at(const uint8_t* chunk, int64_t bits, int i, int t) {
  if (bits == 8) return chunk[(t / 4) * 64 + 4 * i + t % 4];
  const int h = t / 8, r = t % 8;
  const uint8_t byte = chunk[h * 64 + 4 * i + r % 4];
  return r < 4 ? byte & 15 : byte >> 4;
}

// MatMulBF16 (bgemm_generic.cpp, bgemm_avx2.cpp, bgemm_avx512.cpp): bfloat16 weights in the panel16-bf16 layout, activations rounded to bfloat16 per call.
struct BGemmProblem {
  const uint16_t* a;      // [M, Kp] activations, bfloat16
  const uint16_t* codes;  // [P, Kp/2, 32]
  float* y;
  int64_t M, N, K, Kp;
  int64_t lda;  // a's row stride (≥ Kp, zero past K; the AMX path's is a multiple of 32 and its rows a multiple of 16)
};
using BGemmFn = void (*)(const BGemmProblem&, int64_t panel_begin, int64_t panel_end);
using ToBf16Fn = void (*)(const float* x, int64_t K, int64_t Kp, uint16_t* out, int64_t row_begin, int64_t row_end);

// What MatMulBF16's tiles compute, wherever their panels come from: y[m, n0 + c] = Σ_k a[m, k] · w(c, k) for every
// row m < M and the `panels` (1 or 2) panels at w (panel16-bf16, each Kp/2 × 32 bfloat16, consecutive), columns
// n0 + c < N of y [M, N]. The one vdpbf16ps tile code, shared by MatMulBF16 and MatMulQBF16.
struct Bf16Panels {
  const uint16_t* a;  // [M, Kp] bfloat16
  const uint16_t* w;  // [panels, Kp/2, 32] bfloat16
  float* y;
  int64_t M, N, Kp, n0;
  int64_t lda;  // a's row stride, as in BGemmProblem
};

// MatMulQBF16 (qbgemm_generic.cpp, qbgemm_avx512.cpp): MatMulQ's panel16 weights × activations rounded to bfloat16
// once per call. Per pair of panels a thread owns, the codes are decompressed into a per-thread buffer in the
// panel16-bf16 layout, w = bf16(fma(c − z, s, m)) (m = 0 for symmetric blocks), then MatMulBF16's tiles run over
// every row: y = Σ_k bf16(x)·w with float32 sums, the same products in the same order on both paths.
struct QBGemmProblem {
  const uint16_t* a;  // [M, Kp] activations, bfloat16 (Kp = kb·block, zero past K)
  const uint8_t* codes;
  const uint16_t* scales;  // float16 bits
  const float* offsets;  // null: symmetric
  float* y;
  int64_t M, N, K, Kp, bits, block;
  int64_t lda;  // a's row stride, as in BGemmProblem
};
using QBGemmFn = void (*)(const QBGemmProblem&, int64_t panel_begin, int64_t panel_end);

// MatMulQBF16's loop, the same on every path: per pair of the panels [panel_begin, panel_end), `decompress(p, out)`
// writes panel p into this thread's buffer (panel16-bf16, Kp/2 × 32), then `panels(tiles, n)` — the path's
// bf16_panels — runs MatMulBF16's tiles over the pair (the last may be a single panel).
template <typename Decompress, typename Panels>
inline void qbgemm_pairs(const QBGemmProblem& P, int64_t panel_begin, int64_t panel_end, Decompress decompress,
                         Panels panels) {
  thread_local std::vector<uint16_t> w;  // this thread's decompressed pair of panels, kept between calls
  const int64_t panel_elems = P.Kp / 2 * 32;
  w.resize(static_cast<size_t>(2 * panel_elems));
  for (int64_t p = panel_begin; p < panel_end; p += 2) {
    const int n = p + 1 < panel_end ? 2 : 1;
    for (int q = 0; q < n; ++q) decompress(p + q, w.data() + q * panel_elems);
    panels(Bf16Panels{P.a, w.data(), P.y, P.M, P.N, P.Kp, p * kPanel, P.lda}, n);
  }
}

// MatMulF32 (fgemm_generic.cpp, fgemm_avx512.cpp): float32 weights in the panel16-f32 layout, float32 activations
// read as they are. y[m, n] = Σ_k x[m, k] · W[n, k], float32 sums in k order (one fma per k on every path).
struct FGemmProblem {
  const float* a;  // [M, K] activations (row stride K)
  const float* w;  // [P, K, 16]: element [p, k, c] = W[16p + c, k], zero past N
  float* y;        // [M, N]
  int64_t M, N, K;
};
using FGemmFn = void (*)(const FGemmProblem&, int64_t panel_begin, int64_t panel_end);

namespace avx512bf16 {
void bgemm(const BGemmProblem&, int64_t, int64_t);
void bf16_panels(const Bf16Panels&, int panels);
void qbgemm(const QBGemmProblem&, int64_t, int64_t);
void to_bf16_rows(const float*, int64_t, int64_t, uint16_t*, int64_t, int64_t);
void decompress_panel(const QBGemmProblem&, int64_t p, uint16_t* out);  // panel p of the codes, panel16-bf16
}  // namespace avx512bf16

// AMX (bgemm_amx.cpp): MatMulBF16's and MatMulQBF16's tiles on the tile unit (tdpbf16ps), where the CPU has amx-bf16
// and the kernel grants this process the tile data state (isa.h amx_bf16, amx_int8).
namespace amx {
void bgemm(const BGemmProblem&, int64_t, int64_t);
void bf16_panels(const Bf16Panels&, int panels);
void qbgemm(const QBGemmProblem&, int64_t, int64_t);
// MatMulQ (qgemm_amx.cpp): whole 16-row tiles on tdpbssd, the other rows on the VNNI path, bit for bit its results
void qgemm(const QGemmProblem&, int64_t, int64_t);
}  // namespace amx

namespace avx512f {
void fgemm(const FGemmProblem&, int64_t, int64_t);
}  // namespace avx512f
namespace avx512vnni {
void qgemm(const QGemmProblem&, int64_t, int64_t);
void quantize_rows(const float*, int64_t, int64_t, int64_t, bool, const QuantizedRows&, int64_t, int64_t);
}  // namespace avx512vnni
namespace avxvnni {
void qgemm(const QGemmProblem&, int64_t, int64_t);
}  // namespace avxvnni
namespace avx2 {
void qgemm(const QGemmProblem&, int64_t, int64_t);
// MatMulBF16 / MatMulQBF16 (bgemm_avx2.cpp): bfloat16 widened to float32 in registers, FMA; the portable path's bits
void bgemm(const BGemmProblem&, int64_t, int64_t);
void bf16_panels(const Bf16Panels&, int panels);
void qbgemm(const QBGemmProblem&, int64_t, int64_t);
void to_bf16_rows(const float*, int64_t, int64_t, uint16_t*, int64_t, int64_t);
}  // namespace avx2
namespace generic {
void fgemm(const FGemmProblem&, int64_t, int64_t);
void bgemm(const BGemmProblem&, int64_t, int64_t);
void bf16_panels(const Bf16Panels&, int panels);
void qbgemm(const QBGemmProblem&, int64_t, int64_t);
void decompress_panel(const QBGemmProblem&, int64_t p, uint16_t* out);  // panel p of the codes, panel16-bf16
void to_bf16_rows(const float*, int64_t, int64_t, uint16_t*, int64_t, int64_t);
void qgemm(const QGemmProblem&, int64_t, int64_t);
void quantize_rows(const float*, int64_t, int64_t, int64_t, bool, const QuantizedRows&, int64_t, int64_t);
}  // namespace generic

}  // namespace omf
