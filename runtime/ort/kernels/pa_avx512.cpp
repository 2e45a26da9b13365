// PagedAttention, AVX-512F + BW path (chosen at run time when the CPU has both; see custom_op.cpp).
#if defined(__x86_64__) && defined(__GNUC__)
// Standard and project headers come before the target pragma: template code they define (std::vector, ...)
// is then compiled for the baseline ISA, so no AVX instruction can leak into code shared with other paths.
#include <immintrin.h>

#include "paged_attention.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,fma")

namespace omf::avx512 {
#include "avx512_reduce.h"

#include "pa_avx512_vec.h"

struct Vec : Avx512Vec {};

#include "paged_attention_impl.h"

}  // namespace omf::avx512

#pragma GCC pop_options
#endif
