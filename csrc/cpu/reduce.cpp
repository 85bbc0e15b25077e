// Reduction kernels: plain loops over fixed-size blocks that the compiler
// vectorizes for the build machine (see setup.py for the -march choice).
#include "reduce.h"

#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
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

// Widen a block of T into its accumulator type, and narrow it back (rounding
// once). float16 uses F16C vector conversions where the target has them: the
// compiler's _Float16 conversions are scalar bit manipulation.
template <typename T, typename A>
inline void widen(const T* src, A* out, int64_t len) {
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      _mm256_store_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < len; ++i) out[i] = _cvtsh_ss(reinterpret_cast<const uint16_t*>(src)[i]);
    return;
  }
#endif
  for (int64_t i = 0; i < len; ++i) out[i] = load(src[i]);
}

template <typename T, typename A>
inline void narrow(const A* acc, T* dst, int64_t len) {
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, Half>) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < len; ++i) reinterpret_cast<uint16_t*>(dst)[i] = _cvtss_sh(acc[i], _MM_FROUND_TO_NEAREST_INT);
    return;
  }
#endif
  for (int64_t i = 0; i < len; ++i) dst[i] = store<T>(acc[i]);
}

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
