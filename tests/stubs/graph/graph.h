// STUB for syntax checking only, not CANN.
// The subset of CANN's include/graph/graph.h (hicann/ge inc/graph_metadef/external/graph/graph.h, ffdcbc9) that the
// RefData builder uses, with the same signatures (Graph() :43, GetDirectNode :150, RemoveNode :152, AddNodeByOp :158,
// AddDataEdge :160, FindNodeByName :171). The inline bodies over `StubGraph` only let tests/stubs/refdata_harness.cc
// record what the builder did; they are not CANN's implementation.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "graph/gnode.h"
#include "graph/operator.h"

namespace ge {
class Graph {
 public:
  Graph() = default;
  ~Graph() = default;

  std::vector<GNode> GetDirectNode() const {
    std::vector<GNode> out;
    for (const auto& n : graph_->nodes) out.emplace_back(n.second);
    return out;
  }
  graphStatus RemoveNode(GNode& node) {
    const std::string name = node.Stub()->name;
    if (graph_->nodes.erase(name) == 0U) return GRAPH_FAILED;
    std::vector<StubEdge> kept;
    for (const auto& e : graph_->edges) {
      if (e.src != name && e.dst != name) kept.push_back(e);
    }
    graph_->edges = kept;
    return GRAPH_SUCCESS;
  }
  GNode AddNodeByOp(const Operator& op) {
    auto node = std::make_shared<StubNode>();
    AscendString name;
    (void)op.GetName(name);
    node->name = name.GetString();
    node->type = op.StubType();
    for (const auto& attr : op.Attrs()) {
      if (std::holds_alternative<int64_t>(attr.second)) node->ints[attr.first] = std::get<int64_t>(attr.second);
    }
    node->owner = graph_.get();
    graph_->nodes[node->name] = node;
    return GNode(node);
  }
  graphStatus AddDataEdge(GNode& src_node, const int32_t src_port_index, GNode& dst_node,
                          const int32_t dst_port_index) {
    graph_->edges.push_back({src_node.Stub()->name, src_port_index, dst_node.Stub()->name, dst_port_index});
    return GRAPH_SUCCESS;
  }
  GNodePtr FindNodeByName(const AscendString& node_name) const {
    const auto it = graph_->nodes.find(node_name.GetString());
    return it == graph_->nodes.end() ? nullptr : std::make_shared<GNode>(it->second);
  }

  StubGraph& Stub() { return *graph_; }  // stub only
  const StubGraph& Stub() const { return *graph_; }  // stub only

 private:
  std::shared_ptr<StubGraph> graph_ = std::make_shared<StubGraph>();
};
}  // namespace ge
