// What every op of the library does around its kernel: read an input's type, shape and data (describe; read_inputs
// for the first n), make an output like an input with another last dimension (last_dim_output), and spread work
// items over ORT's intra-op threads (items_of counts them; run_items: a single item runs on the calling thread, none
// runs nothing).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ort_abi.h"

namespace omf {

struct Tensor {
  const OrtValue* value = nullptr;
  int type = 0;
  std::vector<int64_t> dims;
  void* data = nullptr;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};

inline OrtStatus* describe(const ort::Api& api, const OrtValue* v, Tensor& t) {
  t.value = v;
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = api.GetTensorTypeAndShape(v, &info)) return s;
  size_t n = 0;
  OrtStatus* s = api.GetTensorElementType(info, &t.type);
  if (!s) s = api.GetDimensionsCount(info, &n);
  if (!s) {
    t.dims.resize(n);
    s = api.GetDimensions(info, t.dims.data(), n);
  }
  api.ReleaseTensorTypeAndShapeInfo(info);
  if (!s) s = api.GetTensorMutableData(const_cast<OrtValue*>(v), &t.data);
  return s;
}

// the inputs [0, n): all present (optional ones may be absent: have[i] false)
inline OrtStatus* read_inputs(const ort::Api& api, OrtKernelContext* ctx, size_t n, Tensor* in, bool* have) {
  size_t count = 0;
  if (OrtStatus* s = api.KernelContext_GetInputCount(ctx, &count)) return s;
  for (size_t i = 0; i < std::min(count, n); ++i) {
    const OrtValue* v = nullptr;
    if (OrtStatus* s = api.KernelContext_GetInput(ctx, i, &v)) return s;
    if (v == nullptr) continue;  // an omitted optional input
    if (OrtStatus* s = describe(api, v, in[i])) return s;
    have[i] = true;
  }
  return nullptr;
}

// output `index` shaped like x with its last dimension `last`; *data its buffer
inline OrtStatus* last_dim_output(const ort::Api& api, OrtKernelContext* ctx, size_t index, const Tensor& x,
                                  int64_t last, void** data) {
  std::vector<int64_t> dims = x.dims;
  dims.back() = last;
  OrtValue* out = nullptr;
  if (OrtStatus* s = api.KernelContext_GetOutput(ctx, index, dims.data(), dims.size(), &out)) return s;
  return api.GetTensorMutableData(out, data);
}

// work items of `per_item` each (the last one shorter) covering `total`
inline size_t items_of(int64_t total, int64_t per_item) {
  return static_cast<size_t>((total + per_item - 1) / per_item);
}

inline OrtStatus* run_items(const ort::Api& api, OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t items,
                            void* data) {
  if (items == 1) fn(data, 0);
  else if (items > 1) return api.KernelContext_ParallelFor(ctx, fn, items, 0, data);
  return nullptr;
}

}  // namespace omf
