// STUB for syntax checking only, not CANN.
// The ir_option names the RefData builder uses, copied from hicann/ge
// inc/graph_metadef/external/ge_common/ge_common_api_types.h (ffdcbc9; reached through include/ge/ge_api_types.h):
// INPUT_FORMAT :615, INPUT_SHAPE :616, DYNAMIC_DIMS :626 (kDynamicDims "ge.dynamicDims" :383), PRECISION_MODE :628
// ("ge.exec.precision_mode" :201), SOC_VERSION :634 ("ge.socVersion" :216), LOG_LEVEL :649, TILING_SCHEDULE_OPTIMIZE
// :683 ("ge.tiling_schedule_optimize" :246). In CANN some are `static const char_t *const X = ge::Y.c_str()`; the
// values are the same strings.
#pragma once

#include "graph/ascend_string.h"

namespace ge {
namespace ir_option {
static const char_t* const INPUT_FORMAT = "input_format";
static const char_t* const INPUT_SHAPE = "input_shape";
static const char_t* const DYNAMIC_DIMS = "ge.dynamicDims";
static const char_t* const PRECISION_MODE = "ge.exec.precision_mode";
static const char_t* const SOC_VERSION = "ge.socVersion";
static const char_t* const LOG_LEVEL = "log";
static const char_t* const TILING_SCHEDULE_OPTIMIZE = "ge.tiling_schedule_optimize";
}  // namespace ir_option
}  // namespace ge
