// Reduction kernels: plain loops over fixed-size blocks that the compiler
// vectorizes for each CPU capability (kernels.h).
#include <algorithm>
#include <type_traits>

#include "kernels/convert.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {
namespace {

// Integer sum and product wrap around (as torch's do) instead of overflowing
// into undefined behaviour; float min/max propagate NaN (as torch.maximum).
// Functor types (not function pointers) so that the loops inline and vectorize.
struct Sum {
  template <typename A> A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) return static_cast<A>(static_cast<std::make_unsigned_t<A>>(a) + static_cast<std::make_unsigned_t<A>>(b));
    else return a + b;
  }
};
struct Product {
  template <typename A> A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) return static_cast<A>(static_cast<std::make_unsigned_t<A>>(a) * static_cast<std::make_unsigned_t<A>>(b));
    else return a * b;
  }
};
struct Min {
  template <typename A> A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) return a < b ? a : b;
    else return (a < b || a != a) ? a : b;
  }
};
struct Max {
  template <typename A> A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) return a > b ? a : b;
    else return (a > b || a != a) ? a : b;
  }
};

template <typename T, typename Combine>
void reduce_blocks(T* dst, const T* const* srcs, int num_srcs, int64_t numel, Combine combine, bool average,
                   int64_t divisor) {
  using A = typename Accumulate<T>::Type;
  constexpr int64_t kBlock = 1024;
  alignas(64) A acc[kBlock];
  alignas(64) A next[kBlock];
  const A scale_divisor = static_cast<A>(divisor);
  for (int64_t begin = 0; begin < numel; begin += kBlock) {
    const int64_t len = std::min(kBlock, numel - begin);
    widen(srcs[0] + begin, acc, len);
    for (int s = 1; s < num_srcs; ++s) {
      if constexpr (std::is_same_v<T, A>) {
        const T* src = srcs[s] + begin;
        for (int64_t i = 0; i < len; ++i) acc[i] = combine(acc[i], src[i]);
      } else {
        widen(srcs[s] + begin, next, len);
        for (int64_t i = 0; i < len; ++i) acc[i] = combine(acc[i], next[i]);
      }
    }
    if (average) {
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / scale_divisor;
    }
    narrow(acc, dst + begin, len);
  }
}

template <typename T>
void reduce_typed(void* dst, const void* const* srcs, int num_srcs, int64_t numel, RedOp op, int64_t divisor) {
  auto* out = static_cast<T*>(dst);
  auto* in = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case RedOp::kSum: return reduce_blocks(out, in, num_srcs, numel, Sum{}, false, 1);
    case RedOp::kAvg: return reduce_blocks(out, in, num_srcs, numel, Sum{}, true, divisor);
    case RedOp::kProduct: return reduce_blocks(out, in, num_srcs, numel, Product{}, false, 1);
    case RedOp::kMin: return reduce_blocks(out, in, num_srcs, numel, Min{}, false, 1);
    case RedOp::kMax: return reduce_blocks(out, in, num_srcs, numel, Max{}, false, 1);
  }
}

}  // namespace

void reduce_n(void* dst, const void* const* srcs, int num_srcs, int64_t numel, DType dtype, RedOp op,
              int64_t divisor) {
  switch (dtype) {
    case DType::kFloat32: return reduce_typed<float>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kFloat64: return reduce_typed<double>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kBFloat16: return reduce_typed<BFloat16>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kFloat16: return reduce_typed<Half>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kInt32: return reduce_typed<int32_t>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kInt64: return reduce_typed<int64_t>(dst, srcs, num_srcs, numel, op, divisor);
  }
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
