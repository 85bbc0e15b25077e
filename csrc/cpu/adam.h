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

// Where the step also writes the updated master and moments (an in-memory
// snapshot's slots: zero/checkpoint/snapshot.py), through non-temporal stores
// while the values are in cache, and their word sums ([Note: word sums] in
// checksum.h), computed from the same cached values. A target that is the
// state itself (a snapshot's moments living in its file) is only summed; one
// that overlaps it otherwise is refused.
struct AdamCopies {
  static constexpr int kMaxCopies = 2;
  float* to[kMaxCopies][3] = {};  // [copy][0: master, 1: exp_avg, 2: exp_avg_sq], numel floats each
  int count = 0;
  uint64_t sums[3] = {};  // out: the word sums of the updated master, exp_avg, exp_avg_sq
};

// param, exp_avg, exp_avg_sq: fp32, updated in place; grad: fp32, read only;
// out: the parameter's 16-bit copy (kBFloat16, kFloat16), or nullptr for none;
// copies: nullptr for none. Split over num_threads threads.
void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
               int64_t numel, const AdamHyper& hyper, AdamCopies* copies, int num_threads);

}  // namespace ringcomm
