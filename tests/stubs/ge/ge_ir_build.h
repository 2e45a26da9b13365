// STUB for syntax checking only, not CANN.
// The subset of CANN's include/ge/ge_ir_build.h (hicann/ge inc/external/ge/ge_ir_build.h, ffdcbc9) that the RefData
// builder uses, with the same signatures: ModelBufferData :39-42, aclgrphBuildInitialize(map<AscendString,
// AscendString>&) :68, aclgrphBuildFinalize :75, aclgrphBuildModel(const Graph&, const map<AscendString,
// AscendString>&, ModelBufferData&) :94, aclgrphSaveModel(const char_t*, const ModelBufferData&) :110. Declarations
// only; tests/stubs/refdata_harness.cc defines them to record the calls.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "graph/graph.h"

namespace ge {
struct ModelBufferData {
  std::shared_ptr<uint8_t> data = nullptr;
  uint64_t length;
};

graphStatus aclgrphBuildInitialize(std::map<AscendString, AscendString>& global_options);
void aclgrphBuildFinalize();
graphStatus aclgrphBuildModel(const ge::Graph& graph, const std::map<AscendString, AscendString>& build_options,
                              ModelBufferData& model);
graphStatus aclgrphSaveModel(const char_t* output_file, const ModelBufferData& model);
}  // namespace ge
