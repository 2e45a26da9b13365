// The few facts of ONNX Runtime's C ABI that a custom-op library needs, declared by omforge itself
// (no ORT header is needed or vendored). Sources: the public documentation of onnxruntime_c_api.h;
// the facts are recorded in ../shared/reference/cpu-kernels.md.
//
//  - RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*) is the library's entry point; ORT hands it
//    the API table of the running ORT, so nothing links against libonnxruntime.
//  - OrtApi is an array of function pointers whose slots never move (ORT static_asserts it); we call
//    the slots below by index, and only those. Every one is exercised by tests/test_kernels.py.
//  - OrtCustomOp: its first 22 fields, in order. ORT reads no field newer than `version`, and we set
//    version = 17 (GetApi(17) exists on every ORT >= 1.17 and returns NULL before).
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtShapeInferContext;
struct OrtApi;  // opaque: used as an array of function pointers

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum OmfOrtErrorCode { kOrtOk = 0, kOrtFail = 1, kOrtInvalidArgument = 2 };

// ONNX TensorProto element types (ORT's ONNXTensorElementDataType has the same values). kUndefined as a custom op's
// input type: any tensor type (ORT's custom_ops.cc gives the input an "all types" constraint); the kernel checks it.
enum OmfElemType { kUndefined = 0, kFloat = 1, kUint8 = 2, kInt8 = 3, kUint16 = 4, kInt64 = 7, kFloat16 = 10, kBfloat16 = 16 };

// OrtCustomOpInputOutputCharacteristic: 0 required, 1 optional, 2 variadic. OrtMemType default: 0.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
};

}  // extern "C"

namespace omf::ort {

constexpr uint32_t kApiVersion = 17;

// Slots of the OrtApi table (index = position of the function pointer).
enum Slot : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomain_Add = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorElementType = 60,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttribute_float = 85,
  kKernelInfoGetAttribute_int64 = 86,
  kKernelContext_GetInputCount = 88,
  kKernelContext_GetInput = 90,
  kKernelContext_GetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  kKernelContext_ParallelFor = 274,
};

// Typed access to the slots used.
struct Api {
  const void* const* table = nullptr;

  template <typename Fn>
  Fn at(Slot s) const { return reinterpret_cast<Fn>(const_cast<void*>(table[s])); }

  OrtStatus* CreateStatus(int code, const char* msg) const {
    return at<OrtStatus* (*)(int, const char*)>(kCreateStatus)(code, msg);
  }
  OrtStatus* CreateCustomOpDomain(const char* domain, OrtCustomOpDomain** out) const {
    return at<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)(domain, out);
  }
  OrtStatus* CustomOpDomain_Add(OrtCustomOpDomain* d, const OrtCustomOp* op) const {
    return at<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(kCustomOpDomain_Add)(d, op);
  }
  OrtStatus* AddCustomOpDomain(OrtSessionOptions* o, OrtCustomOpDomain* d) const {
    return at<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(o, d);
  }
  OrtStatus* GetTensorMutableData(OrtValue* v, void** out) const {
    return at<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(v, out);
  }
  OrtStatus* GetTensorTypeAndShape(const OrtValue* v, OrtTensorTypeAndShapeInfo** out) const {
    return at<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(v, out);
  }
  OrtStatus* GetTensorElementType(const OrtTensorTypeAndShapeInfo* i, int* out) const {
    return at<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int*)>(kGetTensorElementType)(i, out);
  }
  OrtStatus* GetDimensionsCount(const OrtTensorTypeAndShapeInfo* i, size_t* out) const {
    return at<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(i, out);
  }
  OrtStatus* GetDimensions(const OrtTensorTypeAndShapeInfo* i, int64_t* out, size_t n) const {
    return at<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(i, out, n);
  }
  void ReleaseTensorTypeAndShapeInfo(OrtTensorTypeAndShapeInfo* i) const {
    at<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(i);
  }
  OrtStatus* KernelInfoGetAttribute_float(const OrtKernelInfo* k, const char* name, float* out) const {
    return at<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttribute_float)(k, name, out);
  }
  OrtStatus* KernelInfoGetAttribute_int64(const OrtKernelInfo* k, const char* name, int64_t* out) const {
    return at<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttribute_int64)(k, name, out);
  }
  OrtStatus* KernelContext_GetInputCount(const OrtKernelContext* c, size_t* out) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, size_t*)>(kKernelContext_GetInputCount)(c, out);
  }
  OrtStatus* KernelContext_GetInput(const OrtKernelContext* c, size_t i, const OrtValue** out) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContext_GetInput)(c, i, out);
  }
  OrtStatus* KernelContext_GetOutput(OrtKernelContext* c, size_t i, const int64_t* dims, size_t n, OrtValue** out) const {
    return at<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContext_GetOutput)(
        c, i, dims, n, out);
  }
  void ReleaseStatus(OrtStatus* s) const { at<void (*)(OrtStatus*)>(kReleaseStatus)(s); }
  OrtStatus* KernelContext_ParallelFor(const OrtKernelContext* c, void (*fn)(void*, size_t), size_t total,
                                       size_t num_batch, void* data) const {
    return at<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
        kKernelContext_ParallelFor)(c, fn, total, num_batch, data);
  }
};

}  // namespace omf::ort
