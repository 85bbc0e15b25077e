// The host optimizer step of ZeRO-Offload, fused: one pass over memory.
#pragma once

#include <cstdint>

#include "common.h"

namespace ringcomm {

struct AdamHyper {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;      // after this update (1 on the first)
  float grad_coef;   // unscale and clip: the gradient is multiplied by it
  bool adamw;        // decoupled weight decay (AdamW) vs L2 added to the gradient (Adam)
};

// param, exp_avg, exp_avg_sq: fp32, updated in place; grad: fp32, read only;
// out: the parameter's 16-bit copy (kBFloat16, kFloat16), or nullptr for none.
// Split over num_threads threads.
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
               int64_t numel, const AdamHyper& hyper, int num_threads);

}  // namespace ringcomm
