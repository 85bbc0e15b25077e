// Element-wise reductions over n sources into one destination.
#pragma once

#include <cstdint>

#include "common.h"

namespace ringcomm {

// dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... in source order; for kAvg the
// sum is then divided by `divisor`. 16-bit floats accumulate in float32 and
// round once when stored. dst may alias any source (element-wise in place).
void reduce_n(void* dst, const void* const* srcs, int num_srcs, int64_t numel, DType dtype, RedOp op,
              int64_t divisor);

}  // namespace ringcomm
