// STUB for syntax checking only, not CANN.
// The subset of CANN's include/graph/ascend_string.h (metadef) that omforge's generated ONNX plugins use, with the
// same signatures; tests/test_atc.py compiles the plugins against it. Not an implementation of CANN.
#pragma once

#include <string>

namespace ge {
using char_t = char;

class AscendString {
 public:
  AscendString() = default;
  AscendString(const char_t* const name) : text_(name == nullptr ? "" : name) {}  // NOLINT: implicit as in CANN
  const char_t* GetString() const { return text_.c_str(); }

 private:
  std::string text_;
};
}  // namespace ge
