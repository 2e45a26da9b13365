// MatMulQBF16, AVX-512 BF16 path (chosen at run time with MatMulBF16's: avx512bf16 + avx512bw; see qgemm_op.cpp).
// Per pair of panels a thread owns: each 64-byte code group (16 columns × 4 consecutive k) is split into its four k
// with shifts and masks, widened to float, w = fma(c − z, s, m) over the 16 columns' block scale (and offset), two k
// rounded to bfloat16 together and interleaved into the panel16-bf16 layout (one 64-byte store per k pair); then
// MatMulBF16's tile loop (bf16_panels) runs over every row. Contract: qgemm.h, QBGemmProblem.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "qgemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

namespace omf::avx512bf16 {
namespace {

// the 16 columns' codes at byte e of each int32 lane of v (after a right shift by `shift` bits), as float, minus z
template <int MASK>
inline __m512 codes_at(__m512i v, int shift, __m512i z) {
  const __m512i c = _mm512_and_si512(_mm512_srli_epi32(v, static_cast<unsigned>(shift)), _mm512_set1_epi32(MASK));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(c, z));
}

// two k of the 16 columns (w at k even, w at k odd) as one k pair of the panel16-bf16 layout
inline void store_pair(uint16_t* out, __m512 even, __m512 odd, __m512i interleave) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [bf16(even) × 16, bf16(odd) × 16]
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(interleave, both));
}

template <int BITS>
void decompress_bits(const QBGemmProblem& P, int64_t p, uint16_t* out) {
  const int64_t chunks = P.Kp / kChunk, kb = P.Kp / P.block;
  constexpr int64_t chunk_bytes = kPanel * kChunk * BITS / 8;
  const uint8_t* panel = P.codes + p * chunks * chunk_bytes;
  const uint16_t* sp = P.scales + p * kb * kPanel;
  const float* op = P.offsets ? P.offsets + p * kb * kPanel : nullptr;
  const __m512i z = _mm512_set1_epi32(1 << (BITS - 1));
  alignas(64) uint16_t order[32];
  for (int c = 0; c < kPanel; ++c) order[2 * c] = static_cast<uint16_t>(c), order[2 * c + 1] = static_cast<uint16_t>(16 + c);
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t j = 0; j < chunks; ++j) {
    const int64_t b = j * kChunk / P.block;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + b * kPanel)));
    const __m512 m = op ? _mm512_loadu_ps(op + b * kPanel) : _mm512_setzero_ps();
    const uint8_t* c = panel + j * chunk_bytes;
    uint16_t* o = out + j * (kChunk / 2) * 32;  // this chunk's 16 k pairs
    auto w = [&](__m512i v, int shift) { return _mm512_fmadd_ps(codes_at<(1 << BITS) - 1>(v, shift, z), s, m); };
    if constexpr (BITS == 4) {
      for (int h = 0; h < 4; ++h) {  // low nibbles: k = 8h + e, high nibbles: k = 8h + 4 + e
        const __m512i v = _mm512_loadu_si512(c + h * 64);
        store_pair(o + (4 * h + 0) * 32, w(v, 0), w(v, 8), interleave);
        store_pair(o + (4 * h + 1) * 32, w(v, 16), w(v, 24), interleave);
        store_pair(o + (4 * h + 2) * 32, w(v, 4), w(v, 12), interleave);
        store_pair(o + (4 * h + 3) * 32, w(v, 20), w(v, 28), interleave);
      }
    } else {
      for (int g = 0; g < 8; ++g) {  // k = 4g + e
        const __m512i v = _mm512_loadu_si512(c + g * 64);
        store_pair(o + (2 * g + 0) * 32, w(v, 0), w(v, 8), interleave);
        store_pair(o + (2 * g + 1) * 32, w(v, 16), w(v, 24), interleave);
      }
    }
  }
}

}  // namespace

void decompress_panel(const QBGemmProblem& P, int64_t p, uint16_t* out) {
  if (P.bits == 4) decompress_bits<4>(P, p, out);
  else decompress_bits<8>(P, p, out);
}

void qbgemm(const QBGemmProblem& P, int64_t panel_begin, int64_t panel_end) {
  qbgemm_pairs(P, panel_begin, panel_end, [&P](int64_t p, uint16_t* out) { decompress_panel(P, p, out); },
               [](const Bf16Panels& T, int n) { bf16_panels(T, n); });
}

}  // namespace omf::avx512bf16

#pragma GCC pop_options
#endif
