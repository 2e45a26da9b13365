// STUB for syntax checking only, not CANN.
// CANN's ge::TensorDesc (metadef include/graph/tensor.h) as the RefData builder uses it: default-constructed, then
// filled by GNode::GetInputDesc / GetOutputDesc and handed back to UpdateInputDesc / UpdateOutputDesc (hicann/ge
// inc/graph_metadef/external/graph/gnode.h:67-73). The `stub_tag` member is the harness's, not CANN's.
#pragma once

#include <string>

namespace ge {
class TensorDesc {
 public:
  TensorDesc() = default;
  std::string stub_tag;  // stub only: which input's desc this is (tests/stubs/refdata_harness.cc)
};
}  // namespace ge
