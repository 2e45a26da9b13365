// STUB for syntax checking only, not CANN (and not nlohmann/json).
// Declares the subset of nlohmann::json's API that omforge_onnx_attrs.h uses, so the generated plugins can be
// checked with `g++ -fsyntax-only` where the real header is not installed. Nothing here is defined.
#pragma once

#include <cstddef>
#include <string>

namespace nlohmann {
class json {
 public:
  using const_iterator = const json*;

  static json parse(const char* text, std::nullptr_t callback, bool allow_exceptions);
  static json array();

  bool is_discarded() const;
  bool is_object() const;
  bool is_array() const;
  bool is_string() const;
  bool is_number() const;
  bool is_number_integer() const;

  const_iterator find(const char* key) const;
  const_iterator begin() const;
  const_iterator end() const;

  template <typename T>
  T get() const;
};
}  // namespace nlohmann
