// Fused Adam/AdamW for fp32 masters in host memory. Per element, in one pass:
// unscale/clip the gradient, update both moments and the master, and write
// the 16-bit copy of the parameter. torch's fused kernel does the update but
// leaves the 16-bit copy to a second pass that reads the master again.
#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

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

// [Note: copies in the step]
// With copies, each part is updated in blocks of kCopyBlock elements, and
// right after each block (its master and moments still in L1) the block is
// streamed to every copy and added to the word sums. A copy then costs only
// its writes, which non-temporal stores send past the caches; a copy after
// the step would read the 3 x numel floats from memory again, and a checksum
// of the copy would read them a third time. A copy's address may be the state
// itself (a snapshot's moments updated in place): it is then only summed.
constexpr int64_t kCopyBlock = 8192;  // floats: 4 streams of 32 KiB stay in L2

void copy_block(float* const state[3], AdamCopies& copies, int64_t begin, int64_t end, WordSum sums[3]) {
  for (int k = 0; k < 3; ++k) {
    for (int j = 0; j < copies.count; ++j) {
      if (copies.to[j][k] == state[k]) continue;
      stream_bytes(copies.to[j][k] + begin, state[k] + begin, (end - begin) * int64_t{sizeof(float)});
    }
    sums[k].add(word_sum_of(reinterpret_cast<const uint32_t*>(state[k] + begin), end - begin, begin));
  }
}

template <typename Out>
void run(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, Out* out, int64_t numel, const Coefs c,
         AdamCopies* copies, int num_threads) {
  constexpr int64_t kAlign = 64;  // elements: whole cache lines per part
  const int64_t parts = num_threads == 1 ? 1 : int64_t{kPartsPerThread} * num_threads;
  const int64_t per = ((numel + parts - 1) / parts + kAlign - 1) / kAlign * kAlign;
  if (numel == 0) return;
  const int num_parts = static_cast<int>((numel + per - 1) / per);
  std::vector<std::array<WordSum, 3>> sums(copies != nullptr ? num_parts : 0);
  float* const state[3] = {param, exp_avg, exp_avg_sq};
  parallel_run(num_threads, num_parts, [&](int part) {
    const int64_t begin = part * per, end = std::min(numel, (part + 1) * per);
    if (copies == nullptr) {
      update<Out>(param, grad, exp_avg, exp_avg_sq, out, begin, end, c);
      return;
    }
    for (int64_t block = begin; block < end; block += kCopyBlock) {
      const int64_t stop = std::min(end, block + kCopyBlock);
      update<Out>(param, grad, exp_avg, exp_avg_sq, out, block, stop, c);
      copy_block(state, *copies, block, stop, sums[part].data());
    }
    fence_streams();
  });
  for (int k = 0; k < 3 && copies != nullptr; ++k) {
    WordSum total;
    for (const auto& part : sums) total.add(part[k]);
    copies->sums[k] = total.value();
  }
}

}  // namespace

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
               int64_t numel, const AdamHyper& hyper, AdamCopies* copies, int num_threads) {
  const Coefs c = coefs_of(hyper);
  if (out == nullptr) {
    run<float>(param, grad, exp_avg, exp_avg_sq, nullptr, numel, c, copies, num_threads);
  } else if (out_dtype == DType::kBFloat16) {
    run(param, grad, exp_avg, exp_avg_sq, static_cast<BFloat16*>(out), numel, c, copies, num_threads);
  } else {  // float16 (checked in kernels.cpp)
    run(param, grad, exp_avg, exp_avg_sq, static_cast<Half*>(out), numel, c, copies, num_threads);
  }
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
