// Loading 16-bit floats into their float32 accumulator and storing back, one
// element or a block at a time (the reduction and quantization kernels share it).
#pragma once

#include <cstdint>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "common.h"

namespace ringcomm {

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

}  // namespace ringcomm
