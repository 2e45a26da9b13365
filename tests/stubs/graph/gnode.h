// STUB for syntax checking only, not CANN.
// The subset of CANN's include/graph/gnode.h (hicann/ge inc/graph_metadef/external/graph/gnode.h, ffdcbc9) that the
// RefData builder uses, with the same signatures (GetType :41, GetName :43, GetOutDataNodesAndPortIndexs :49,
// GetInputDesc :67, UpdateInputDesc :69, GetOutputDesc :71, UpdateOutputDesc :73, GetAttr(int64_t) :75). The inline
// bodies over `StubNode` only let tests/stubs/refdata_harness.cc record what the builder did; not CANN's code.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "graph/ascend_string.h"
#include "graph/operator.h"
#include "graph/tensor.h"

namespace ge {
class GNode;
using GNodePtr = std::shared_ptr<GNode>;

struct StubEdge {  // stub only
  std::string src;
  int32_t src_port;
  std::string dst;
  int32_t dst_port;
};

struct StubGraph {  // stub only: nodes by name, data edges
  std::map<std::string, std::shared_ptr<struct StubNode>> nodes;
  std::vector<StubEdge> edges;
};

struct StubNode {  // stub only
  std::string name;
  std::string type;
  std::map<std::string, int64_t> ints;
  TensorDesc input_desc;
  TensorDesc output_desc;
  StubGraph* owner = nullptr;
};

class GNode {
 public:
  GNode() = default;
  explicit GNode(std::shared_ptr<StubNode> node) : node_(std::move(node)) {}  // stub only
  ~GNode() = default;

  graphStatus GetType(AscendString& type) const {
    type = AscendString(node_->type.c_str());
    return GRAPH_SUCCESS;
  }
  graphStatus GetName(AscendString& name) const {
    name = AscendString(node_->name.c_str());
    return GRAPH_SUCCESS;
  }
  std::vector<std::pair<GNodePtr, int32_t>> GetOutDataNodesAndPortIndexs(const int32_t index) const {
    std::vector<std::pair<GNodePtr, int32_t>> out;
    for (const auto& e : node_->owner->edges) {
      if (e.src == node_->name && e.src_port == index) {
        out.emplace_back(std::make_shared<GNode>(node_->owner->nodes.at(e.dst)), e.dst_port);
      }
    }
    return out;
  }
  graphStatus GetInputDesc(const int32_t index, TensorDesc& tensor_desc) const {
    if (index != 0) return GRAPH_FAILED;
    tensor_desc = node_->input_desc;
    return GRAPH_SUCCESS;
  }
  graphStatus UpdateInputDesc(const int32_t index, const TensorDesc& tensor_desc) {
    if (index != 0) return GRAPH_FAILED;
    node_->input_desc = tensor_desc;
    return GRAPH_SUCCESS;
  }
  graphStatus GetOutputDesc(const int32_t index, TensorDesc& tensor_desc) const {
    if (index != 0) return GRAPH_FAILED;
    tensor_desc = node_->output_desc;
    return GRAPH_SUCCESS;
  }
  graphStatus UpdateOutputDesc(const int32_t index, const TensorDesc& tensor_desc) {
    if (index != 0) return GRAPH_FAILED;
    node_->output_desc = tensor_desc;
    return GRAPH_SUCCESS;
  }
  graphStatus GetAttr(const AscendString& name, int64_t& attr_value) const {
    const auto it = node_->ints.find(name.GetString());
    if (it == node_->ints.end()) return GRAPH_FAILED;
    attr_value = it->second;
    return GRAPH_SUCCESS;
  }

  const std::shared_ptr<StubNode>& Stub() const { return node_; }  // stub only

 private:
  std::shared_ptr<StubNode> node_;
};
}  // namespace ge
