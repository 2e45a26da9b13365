// STUB for syntax checking only, not CANN.
// The subset of CANN's include/register/register.h (metadef) that omforge's generated ONNX plugins use:
// domi::Status, FrameworkType, ImplyType, OpRegistrationData and REGISTER_CUSTOM_OP, with CANN's signatures
// (including the OriginOpType overloads, so overload resolution is checked as CANN would do it). The inline
// bodies record each registration only so tests/stubs/plugin_harness.cc can find a parse function by its ONNX
// key; they are not CANN's OpRegistry.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "graph/ascend_string.h"
#include "graph/operator.h"

namespace domi {
using Status = uint32_t;
constexpr Status SUCCESS = 0U;
constexpr Status FAILED = 0xFFFFFFFFU;

enum FrameworkType { CAFFE = 0, MINDSPORE = 1, TENSORFLOW = 3, ANDROID_NN, ONNX, FRAMEWORK_RESERVED };

enum class ImplyType : unsigned int { BUILDIN = 0, TVM, CUSTOM, AI_CPU, CCE, GELOCAL, HCCL, INVALID = 0xFFFFFFFF };

using ParseParamByOpFunc = std::function<Status(const ge::Operator&, ge::Operator&)>;

struct Registration {  // stub only: what the harness looks up
  std::string om_type;
  std::vector<std::string> origin_types;
  ParseParamByOpFunc parse;
  bool onnx = false;
  bool tvm = false;
};

inline std::vector<Registration>& Registrations() {  // stub only
  static std::vector<Registration> all;
  return all;
}

class OpRegistrationData {
 public:
  OpRegistrationData(const ge::char_t* om_optype) { data_.om_type = om_optype; }  // NOLINT: implicit as in CANN

  OpRegistrationData& FrameworkType(const domi::FrameworkType& fmk_type) {
    data_.onnx = fmk_type == ONNX;
    return *this;
  }
  [[deprecated("use OriginOpType(const std::vector<ge::AscendString>&)")]]
  OpRegistrationData& OriginOpType(const std::initializer_list<std::string>& ori_optype_list) {
    data_.origin_types.assign(ori_optype_list.begin(), ori_optype_list.end());
    return *this;
  }
  OpRegistrationData& OriginOpType(const std::vector<ge::AscendString>& ori_op_type_list) {
    for (const ge::AscendString& type : ori_op_type_list) {
      data_.origin_types.emplace_back(type.GetString());
    }
    return *this;
  }
  OpRegistrationData& OriginOpType(const ge::char_t* ori_op_type) {
    data_.origin_types.emplace_back(ori_op_type);
    return *this;
  }
  OpRegistrationData& ParseParamsByOperatorFn(const ParseParamByOpFunc& parse_param_by_op_fn) {
    data_.parse = parse_param_by_op_fn;
    return *this;
  }
  OpRegistrationData& ImplyType(const domi::ImplyType& imply_type) {
    data_.tvm = imply_type == domi::ImplyType::TVM;
    return *this;
  }

 private:
  friend class OpReceiver;
  Registration data_;
};

class OpReceiver {
 public:
  OpReceiver(OpRegistrationData& reg_data) { Registrations().push_back(reg_data.data_); }  // NOLINT: as in CANN
};
}  // namespace domi

#define REGISTER_CUSTOM_OP(name) REGISTER_CUSTOM_OP_UNIQ_HELPER(__COUNTER__, name)
#define REGISTER_CUSTOM_OP_UNIQ_HELPER(ctr, name) REGISTER_CUSTOM_OP_UNIQ(ctr, name)
#define REGISTER_CUSTOM_OP_UNIQ(ctr, name) \
  static OpReceiver register_op##ctr __attribute__((unused)) = OpRegistrationData(name)
