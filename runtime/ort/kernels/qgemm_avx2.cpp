// MatMulQ, 256-bit paths (chosen at run time where AVX-512 VNNI is missing; see qgemm_op.cpp): AVX-VNNI
// (omf::avxvnni) and plain AVX2 (omf::avx2), one implementation compiled twice (qgemm_avx2_impl.h).
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace omf::avx2 {
#define OMF_VNNI 0
#include "qgemm_avx2_impl.h"
#undef OMF_VNNI
}  // namespace omf::avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace omf::avxvnni {
#define OMF_VNNI 1
#include "qgemm_avx2_impl.h"
#undef OMF_VNNI
}  // namespace omf::avxvnni
#pragma GCC pop_options
#endif
