// The kernels of one CPU capability. setup.py compiles every source of this
// folder once per capability ([Note: CPU capabilities] in cpu_capability.h),
// each time with that capability's -march and RINGCOMM_CPU_CAPABILITY naming
// the namespace that holds all of its code, so no two builds share a symbol.
// Arguments are checked before the call (kernels.cpp); these only compute.
#pragma once

#include <cstdint>

#include "adam.h"
#include "checksum.h"
#include "common.h"
#include "quant.h"

#ifndef RINGCOMM_CPU_CAPABILITY
#define RINGCOMM_CPU_CAPABILITY cpu_default
#endif

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

void reduce_n(void* dst, const void* const* srcs, int num_srcs, int64_t numel, DType dtype, RedOp op, int64_t divisor);
void copy_bytes(void* dst, const void* src, int64_t nbytes);
// memcpy through non-temporal stores where the build has them (AVX2, AVX-512); the
// caller issues fence_streams() before anyone else may read dst.
void stream_bytes(void* dst, const void* src, int64_t nbytes);
void fence_streams();
WordSum word_sum_of(const uint32_t* words, int64_t count, int64_t first);  // the sum of words first, first + 1, ...
uint64_t word_sum_bytes(const void* data, int64_t nbytes, int64_t first);
void quantize(const void* x, DType dtype, int64_t numel, uint8_t* data, float* scales, QuantFormat format,
              int num_threads);
void dequantize_sum(const uint8_t* data, const float* scales, int num_rows, void* out, DType dtype, int64_t numel,
                    QuantFormat format, int num_threads);
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
               int64_t numel, const AdamHyper& hyper, AdamCopies* copies, int num_threads);

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
