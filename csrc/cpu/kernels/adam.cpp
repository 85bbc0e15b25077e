// Fused Adam/AdamW for fp32 masters in host memory. Per element, in one pass:
// unscale/clip the gradient, update both moments and the master, and write
// the 16-bit copy of the parameter. torch's fused kernel does the update but
// leaves the 16-bit copy to a second pass that reads the master again.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/convert.h"
#include "parallel.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {
namespace {

struct Coefs {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bias2_sqrt, eps, l2, grad_coef;
};

Coefs coefs_of(const AdamHyper& h) {
  const double bias1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bias2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  return Coefs{h.adamw ? 1.0f - h.lr * h.weight_decay : 1.0f, h.beta1, 1.0f - h.beta1, h.beta2, 1.0f - h.beta2,
               static_cast<float>(h.lr / bias1), static_cast<float>(1.0 / std::sqrt(bias2)), h.eps,
               h.adamw ? 0.0f : h.weight_decay, h.grad_coef};
}

template <typename Out>
void update(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
            float* __restrict__ exp_avg_sq, Out* __restrict__ out, int64_t begin, int64_t end, const Coefs c) {
#pragma GCC ivdep
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    // no L2 term without L2 decay (AdamW, or weight_decay 0), as torch: 0 * inf would make an inf master nan
    const float g = grad[i] * c.grad_coef + (c.l2 != 0.0f ? c.l2 * p : 0.0f);
    const float m = c.beta1 * exp_avg[i] + c.one_minus_beta1 * g;
    const float v = c.beta2 * exp_avg_sq[i] + c.one_minus_beta2 * g * g;
    p = p * c.decay - c.step_size * m / (std::sqrt(v) * c.inv_bias2_sqrt + c.eps);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
    if constexpr (!std::is_same_v<Out, float>) out[i] = store_float(p, Out{});
  }
}

template <typename Out>
void run(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, Out* out, int64_t numel, const Coefs c,
         int num_threads) {
  constexpr int64_t kAlign = 64;  // elements: whole cache lines per part
  const int64_t parts = num_threads == 1 ? 1 : int64_t{kPartsPerThread} * num_threads;
  const int64_t per = ((numel + parts - 1) / parts + kAlign - 1) / kAlign * kAlign;
  if (numel == 0) return;
  parallel_run(num_threads, static_cast<int>((numel + per - 1) / per), [&](int part) {
    update<Out>(param, grad, exp_avg, exp_avg_sq, out, part * per, std::min(numel, (part + 1) * per), c);
  });
}

}  // namespace

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
               int64_t numel, const AdamHyper& hyper, int num_threads) {
  const Coefs c = coefs_of(hyper);
  if (out == nullptr) {
    run<float>(param, grad, exp_avg, exp_avg_sq, nullptr, numel, c, num_threads);
  } else if (out_dtype == DType::kBFloat16) {
    run(param, grad, exp_avg, exp_avg_sq, static_cast<BFloat16*>(out), numel, c, num_threads);
  } else {  // float16 (checked in kernels.cpp)
    run(param, grad, exp_avg, exp_avg_sq, static_cast<Half*>(out), numel, c, num_threads);
  }
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
