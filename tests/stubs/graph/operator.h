// STUB for syntax checking only, not CANN.
// The subset of CANN's include/graph/operator.h (metadef) that omforge's generated ONNX plugins and RefData
// builder use, with the same signatures (IsEmpty, GetName: hicann/ge inc/graph_metadef/external/graph/operator.h:108,
// 113; SetAttr(const char_t*, int64_t): :317; SetAttr(const char_t*, bool): :345). The inline bodies (a name ->
// value map) only let the harnesses (tests/stubs/plugin_harness.cc, refdata_harness.cc) read back what was set; they are not CANN's implementation.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <variant>

#include "graph/ascend_string.h"

namespace ge {
using float32_t = float;
using graphStatus = uint32_t;
constexpr graphStatus GRAPH_SUCCESS = 0U;
constexpr graphStatus GRAPH_FAILED = 0xFFFFFFFFU;

class Operator {
 public:
  using Value = std::variant<float32_t, int64_t, std::string>;

  Operator() = default;
  Operator(const char_t* name, const char_t* type) : name_(name), type_(type) {}

  bool IsEmpty() const { return type_.empty(); }  // stub: an Operator() made by no factory is empty
  graphStatus GetName(AscendString& name) const {
    name = AscendString(name_.c_str());
    return GRAPH_SUCCESS;
  }

  graphStatus GetAttr(const char_t* name, AscendString& attr_value) const {
    const auto it = attrs_.find(name);
    if (it == attrs_.end() || !std::holds_alternative<std::string>(it->second)) {
      return GRAPH_FAILED;
    }
    attr_value = AscendString(std::get<std::string>(it->second).c_str());
    return GRAPH_SUCCESS;
  }

  Operator& SetAttr(const char_t* name, float32_t attr_value) { return Set(name, attr_value); }
  Operator& SetAttr(const char_t* name, int64_t attr_value) { return Set(name, attr_value); }
  Operator& SetAttr(const char_t* name, int32_t attr_value) { return Set(name, static_cast<int64_t>(attr_value)); }
  Operator& SetAttr(const char_t* name, bool attr_value) { return Set(name, static_cast<int64_t>(attr_value)); }  // :345
  Operator& SetAttr(const char_t* name, const AscendString& attr_value) {
    return Set(name, std::string(attr_value.GetString()));
  }
  Operator& SetAttr(const char_t* name, const char_t* attr_value) { return Set(name, std::string(attr_value)); }

  const std::map<std::string, Value>& Attrs() const { return attrs_; }  // stub only: for the harnesses
  const std::string& StubType() const { return type_; }                   // stub only

 private:
  Operator& Set(const char_t* name, Value value) {
    attrs_[name] = std::move(value);
    return *this;
  }

  std::string name_;
  std::string type_;
  std::map<std::string, Value> attrs_;
};
}  // namespace ge
