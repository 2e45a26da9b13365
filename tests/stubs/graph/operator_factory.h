// STUB for syntax checking only, not CANN.
// The subset of CANN's include/graph/operator_factory.h (hicann/ge inc/graph_metadef/external/graph/
// operator_factory.h, ffdcbc9) that the RefData builder uses: CreateOperator(const char_t*, const char_t*). In
// CANN it builds the op from its registered prototype (REG_OP(RefData): INPUT x, OUTPUT y, ATTR index); this stub
// knows only Data and RefData and returns an empty Operator for any other type. Not CANN's implementation.
#pragma once

#include <string>

#include "graph/operator.h"

namespace ge {
class OperatorFactory {
 public:
  static Operator CreateOperator(const char_t* const operator_name, const char_t* const operator_type) {
    const std::string type = operator_type;
    return (type == "RefData" || type == "Data") ? Operator(operator_name, operator_type) : Operator();
  }
};
}  // namespace ge
