// omforge.kernels PagedAttention: the problem description shared by the ORT glue (custom_op.cpp) and the
// per-ISA kernels (paged_attention_impl.h instantiated by pa_*.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "head_dims.h"

namespace omf {

// One work item: query tokens of one sequence that share a block-table row, attended together — or a cascade item:
// the decode tokens of several sequences whose tables begin with the same `cascade_blocks` blocks, attended over
// those blocks together (their query rows in vector lanes, as a prefill chunk's), each row's softmax state written to
// PagedProblem::partial; each of those sequences' own items then starts after them (`skip_blocks`) from that state.
struct WorkItem {
  const int64_t* table;  // the sequence's block-table row (a cascade item: its first member's)
  int64_t table_len;     // its width (blocks beyond the last visible position are never read)
  int32_t first;         // index into PagedProblem::tokens of the item's first token
  int32_t count;         // number of tokens (<= kMaxItemTokens)
  int32_t skip_blocks = 0;     // > 0: blocks [0, skip_blocks) were attended by a cascade item (one token, no window)
  int32_t cascade_blocks = 0;  // > 0: a cascade item over blocks [0, cascade_blocks), every key visible to each row
  int32_t kv_head = -1;        // >= 0: the only KV head (and its query heads) the item attends (cascade items)
};

constexpr int kMaxItemTokens = 32;

// Element type of the KV pools. int8 (symmetric, per token and KV head): each head's row is D int8 values
// followed by its float32 scale (4 bytes), so a pool is [num_slots, kv_heads, D + 4] int8.
enum class KvType { kFloat32 = 0, kBfloat16 = 1, kInt8 = 2 };

struct PagedProblem {
  // q [.., Hq, D] and o: token t, head h at base + t * tok_stride + h * head_stride (floats).
  const float* q;
  int64_t q_tok_stride, q_head_stride;
  float* o;
  int64_t o_tok_stride, o_head_stride;
  // the pools, [num_slots, kv_heads, head_dim] of kv_type (read after this step's rows are written)
  const void* key_pool;
  const void* value_pool;
  KvType kv_type;
  int64_t num_slots;
  int q_heads, kv_heads, head_dim, block_size;
  float scale;
  int64_t window;             // > 0: a key at position j is visible to a query at p iff p - window < j <= p
  const int64_t* positions;   // [T]
  const int32_t* tokens;      // token ids (indices into T) of all work items, item after item
  const WorkItem* items;
  size_t num_items;
  // cascade state, per token t and q head h at (t * q_heads + h) * (head_dim + 2): the running max m, the sum l and
  // the unnormalized accumulator (head_dim floats) after the shared blocks; written by cascade items, read by the
  // items with skip_blocks > 0 (nullptr when the step has no cascade)
  float* partial = nullptr;
};

// Attention for one work item (its index in PagedProblem::items). Returns false (and sets *error) when a
// position lies beyond its block table or a block id beyond the pool.
using AttendFn = bool (*)(const PagedProblem&, size_t item, const char** error);

// A phase of a kernel function, split out of it for reading: inlined into its one caller whatever its size, so the
// code is the caller's as if written there.
#define OMF_ALWAYS_INLINE __attribute__((always_inline))

// One KV element as float: fp32 as is, bf16 widened (its bits are the high half of an fp32), int8 unscaled.
inline float kv_to_float(float x) { return x; }
inline float kv_to_float(int8_t x) { return static_cast<float>(x); }
inline float kv_to_float(uint16_t x) { return bf16_to_float(x); }

// SwiGLU of `rows` rows: out[r, :F] = silu(in[r, :F]) * in[r, F:2F].
using SwiGluFn = void (*)(const float* in, float* out, int64_t rows, int64_t F);
// One head's row into an int8 pool: D int8 values and the row's float scale (paged_attention_impl.h).
using QuantizeKvFn = void (*)(const float* x, int64_t D, int8_t* out);
// AddRMSNorm of `rows` rows of H (paged_attention_impl.h add_rms_norm).
using AddRmsNormFn = void (*)(const float* a, const float* b, const float* w, float eps, float* y, float* sum,
                              int64_t rows, int64_t H);

namespace avx512 {
bool attend(const PagedProblem&, size_t item, const char** error);
void swiglu(const float* in, float* out, int64_t rows, int64_t F);
void quantize_kv_int8(const float* x, int64_t D, int8_t* out);
void add_rms_norm(const float* a, const float* b, const float* w, float eps, float* y, float* sum, int64_t rows,
                  int64_t H);
}  // namespace avx512
namespace avx512bf16 {  // the AVX-512 attention with bfloat16 dot products on bfloat16 pools' tile path (its other
                        // ops are avx512's)
bool attend(const PagedProblem&, size_t item, const char** error);
}  // namespace avx512bf16
namespace avx2 {
bool attend(const PagedProblem&, size_t item, const char** error);
void swiglu(const float* in, float* out, int64_t rows, int64_t F);
void quantize_kv_int8(const float* x, int64_t D, int8_t* out);
void add_rms_norm(const float* a, const float* b, const float* w, float eps, float* y, float* sum, int64_t rows,
                  int64_t H);
}  // namespace avx2
namespace generic {
bool attend(const PagedProblem&, size_t item, const char** error);
void swiglu(const float* in, float* out, int64_t rows, int64_t F);
void quantize_kv_int8(const float* x, int64_t D, int8_t* out);
void add_rms_norm(const float* a, const float* b, const float* w, float eps, float* y, float* sum, int64_t rows,
                  int64_t H);
}  // namespace generic

}  // namespace omf
