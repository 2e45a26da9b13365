// STUB for syntax checking only, not CANN.
// The subset of CANN's include/graph/ascend_string.h (metadef) that omforge's generated ONNX plugins use, with the
// same signatures; tests/test_atc_plugins.py and tests/test_refdata_build.py compile against it. Not an implementation of CANN.
#pragma once

#include <string>

namespace ge {
using char_t = char;

class AscendString {
 public:
  AscendString() = default;
  AscendString(const char_t* const name) : text_(name == nullptr ? "" : name) {}  // NOLINT: implicit as in CANN
  const char_t* GetString() const { return text_.c_str(); }
  bool operator<(const AscendString& d) const { return text_ < d.text_; }    // as CANN's: std::map keys
  bool operator==(const AscendString& d) const { return text_ == d.text_; }

 private:
  std::string text_;
};
}  // namespace ge
