// STUB for syntax checking only, not CANN.
// CANN's include/parser/onnx_parser.h (hicann/ge inc/parser/external/parser/onnx_parser.h:34, ffdcbc9):
// aclgrphParseONNX, same signature. Declaration only; tests/stubs/refdata_harness.cc defines it.
#pragma once

#include <map>

#include "graph/ascend_string.h"
#include "graph/graph.h"

namespace ge {
graphStatus aclgrphParseONNX(const char* model_file, const std::map<ge::AscendString, ge::AscendString>& parser_params,
                             ge::Graph& graph);
}  // namespace ge
