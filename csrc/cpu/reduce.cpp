// Reduction kernels: plain loops over fixed-size blocks that the compiler
// vectorizes for the build machine (see setup.py for the -march choice).
#include "reduce.h"

#include <algorithm>
#include <type_traits>

namespace ringcomm {
namespace {

// How a storage type T is loaded into, and stored from, its accumulator.
template <typename T> struct Accumulate { using Type = T; };
template <> struct Accumulate<BFloat16> { using Type = float; };
template <> struct Accumulate<Half> { using Type = float; };

template <typename T> inline typename Accumulate<T>::Type load(T v) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) return load_float(v);
  else return v;
}
template <typename T> inline T store(typename Accumulate<T>::Type v) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) return store_float(v, T{});
  else return v;
}

// Integer sum and product wrap around (as torch's do) instead of overflowing
// into undefined behaviour; float min/max propagate NaN (as torch.maximum).
template <typename A> inline A combine_sum(A a, A b) {
  if constexpr (std::is_integral_v<A>) return static_cast<A>(static_cast<std::make_unsigned_t<A>>(a) + static_cast<std::make_unsigned_t<A>>(b));
  else return a + b;
}
template <typename A> inline A combine_product(A a, A b) {
  if constexpr (std::is_integral_v<A>) return static_cast<A>(static_cast<std::make_unsigned_t<A>>(a) * static_cast<std::make_unsigned_t<A>>(b));
  else return a * b;
}
template <typename A> inline A combine_min(A a, A b) {
  if constexpr (std::is_integral_v<A>) return a < b ? a : b;
  else return (a < b || a != a) ? a : b;
}
template <typename A> inline A combine_max(A a, A b) {
  if constexpr (std::is_integral_v<A>) return a > b ? a : b;
  else return (a > b || a != a) ? a : b;
}

template <typename T, typename Combine>
void reduce_blocks(T* dst, const T* const* srcs, int num_srcs, int64_t numel, Combine combine, bool average,
                   int64_t divisor) {
  using A = typename Accumulate<T>::Type;
  constexpr int64_t kBlock = 1024;
  alignas(64) A acc[kBlock];
  const A scale_divisor = static_cast<A>(divisor);
  for (int64_t begin = 0; begin < numel; begin += kBlock) {
    const int64_t len = std::min(kBlock, numel - begin);
    const T* first = srcs[0] + begin;
    for (int64_t i = 0; i < len; ++i) acc[i] = load(first[i]);
    for (int s = 1; s < num_srcs; ++s) {
      const T* src = srcs[s] + begin;
      for (int64_t i = 0; i < len; ++i) acc[i] = combine(acc[i], load(src[i]));
    }
    if (average) {
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / scale_divisor;
    }
    T* out = dst + begin;
    for (int64_t i = 0; i < len; ++i) out[i] = store<T>(acc[i]);
  }
}

template <typename T>
void reduce_typed(void* dst, const void* const* srcs, int num_srcs, int64_t numel, RedOp op, int64_t divisor) {
  using A = typename Accumulate<T>::Type;
  auto* out = static_cast<T*>(dst);
  auto* in = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case RedOp::kSum: return reduce_blocks(out, in, num_srcs, numel, combine_sum<A>, false, 1);
    case RedOp::kAvg: return reduce_blocks(out, in, num_srcs, numel, combine_sum<A>, true, divisor);
    case RedOp::kProduct: return reduce_blocks(out, in, num_srcs, numel, combine_product<A>, false, 1);
    case RedOp::kMin: return reduce_blocks(out, in, num_srcs, numel, combine_min<A>, false, 1);
    case RedOp::kMax: return reduce_blocks(out, in, num_srcs, numel, combine_max<A>, false, 1);
  }
}

}  // namespace

void reduce_n(void* dst, const void* const* srcs, int num_srcs, int64_t numel, DType dtype, RedOp op,
              int64_t divisor) {
  if (num_srcs < 1) throw std::invalid_argument("reduce_n: needs at least one source, got " + std::to_string(num_srcs));
  if (numel < 0) throw std::invalid_argument("reduce_n: numel=" + std::to_string(numel) + " < 0");
  if (op == RedOp::kAvg && divisor < 1) throw std::invalid_argument("reduce_n: avg divisor=" + std::to_string(divisor) + " < 1");
  switch (dtype) {
    case DType::kFloat32: return reduce_typed<float>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kFloat64: return reduce_typed<double>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kBFloat16: return reduce_typed<BFloat16>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kFloat16: return reduce_typed<Half>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kInt32: return reduce_typed<int32_t>(dst, srcs, num_srcs, numel, op, divisor);
    case DType::kInt64: return reduce_typed<int64_t>(dst, srcs, num_srcs, numel, op, divisor);
  }
}

}  // namespace ringcomm
