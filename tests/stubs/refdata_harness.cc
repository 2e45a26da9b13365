// STUB harness for tests/test_refdata_build.py only, not CANN: definitions of the IR build calls the RefData
// builder (compile/ascend/templates/refdata_build.cc.j2) makes, which print what they were given so the test can
// check it. aclgrphParseONNX builds a graph the way hicann/ge's ONNX parser shapes one (one Data node per graph input,
// named after it, "index" = its position: parser/parser/onnx/onnx_parser.cc:293-357): the inputs come from the
// environment variable STUB_ONNX_INPUTS ("a,b,c"), each with one consumer node "use:<name>" at port 1.
// aclgrphSaveModel writes "<output>.om" like CANN's (examples/offline_compile_run: "add_sample" -> add_sample.om).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "ge/ge_ir_build.h"
#include "parser/onnx_parser.h"

namespace ge {
namespace {
void PrintOptions(const char* what, const std::map<AscendString, AscendString>& options) {
  for (const auto& o : options) std::printf("%s %s=%s\n", what, o.first.GetString(), o.second.GetString());
}
}  // namespace

graphStatus aclgrphBuildInitialize(std::map<AscendString, AscendString>& global_options) {
  PrintOptions("global", global_options);
  return GRAPH_SUCCESS;
}

void aclgrphBuildFinalize() { std::printf("finalize\n"); }

graphStatus aclgrphParseONNX(const char* model_file, const std::map<AscendString, AscendString>& parser_params,
                             Graph& graph) {
  std::printf("parse %s\n", model_file);
  PrintOptions("parser", parser_params);
  const char* inputs = std::getenv("STUB_ONNX_INPUTS");
  std::stringstream names(inputs == nullptr ? "" : inputs);
  int64_t index = 0;
  StubGraph& g = graph.Stub();
  for (std::string name; std::getline(names, name, ',');) {
    auto data = std::make_shared<StubNode>();
    data->name = name;
    data->type = "Data";
    data->ints["index"] = index++;
    data->input_desc.stub_tag = "desc:" + name;
    data->output_desc.stub_tag = "desc:" + name;
    data->owner = &g;
    g.nodes[name] = data;
    auto use = std::make_shared<StubNode>();
    use->name = "use:" + name;
    use->type = "Consumer";
    use->owner = &g;
    g.nodes[use->name] = use;
    g.edges.push_back({name, 0, use->name, 1});
  }
  return GRAPH_SUCCESS;
}

graphStatus aclgrphBuildModel(const Graph& graph, const std::map<AscendString, AscendString>& build_options,
                              ModelBufferData& model) {
  PrintOptions("build", build_options);
  const StubGraph& g = graph.Stub();
  for (const auto& n : g.nodes) {
    if (n.second->type == "Consumer") continue;
    std::printf("node %s %s index=%lld in=%s out=%s\n", n.first.c_str(), n.second->type.c_str(),
                static_cast<long long>(n.second->ints.count("index") ? n.second->ints.at("index") : -1),
                n.second->input_desc.stub_tag.c_str(), n.second->output_desc.stub_tag.c_str());
  }
  for (const auto& e : g.edges) std::printf("edge %s:%d -> %s:%d\n", e.src.c_str(), e.src_port, e.dst.c_str(), e.dst_port);
  model.data = std::shared_ptr<uint8_t>(new uint8_t[1]{0}, [](uint8_t* p) { delete[] p; });
  model.length = 1;
  return GRAPH_SUCCESS;
}

graphStatus aclgrphSaveModel(const char_t* output_file, const ModelBufferData& model) {
  if (model.data == nullptr || model.length == 0) return GRAPH_FAILED;
  const std::string path = std::string(output_file) + ".om";
  std::ofstream(path) << "stub om\n";
  std::printf("save %s\n", path.c_str());
  return GRAPH_SUCCESS;
}
}  // namespace ge
