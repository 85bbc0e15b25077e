// The 16-bit float types, and loading them into their float32 accumulator and
// storing back, one element, 16 lanes (AVX-512) or a block at a time (the
// reduction, quantization and Adam kernels share it).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX512F__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which
// -Wmaybe-uninitialized misreports (GCC bug 105593) at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif
#include <type_traits>

#include "kernels/kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RINGCOMM_AVX512 1
#endif

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

// bfloat16 is the top half of a float32; rounding is to nearest even, and a
// NaN stays a (quiet) NaN instead of rounding into infinity. Both directions are
// integer arithmetic without branches on the bit patterns, so loops over them vectorize.
struct BFloat16 { uint16_t bits; };

inline uint32_t bf16_to_f32_bits(uint16_t bits) { return static_cast<uint32_t>(bits) << 16; }

inline uint16_t f32_to_bf16_bits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float load_float(BFloat16 v) {
  const uint32_t bits = bf16_to_f32_bits(v.bits);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline BFloat16 store_float(float v, BFloat16) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return BFloat16{f32_to_bf16_bits(bits)};
}

// IEEE half: the compiler's _Float16 converts with F16C where the target has it.
using Half = _Float16;
inline float load_float(Half v) { return static_cast<float>(v); }
inline Half store_float(float v, Half) { return static_cast<Half>(v); }

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

#if defined(RINGCOMM_AVX512)
// 16 consecutive T as float32 lanes, and back (bfloat16 rounding as store_float).
template <typename T> inline __m512 load16(const T* src) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(src);
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  if constexpr (std::is_same_v<T, Half>) return _mm512_cvtph_ps(bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T> inline void store16(T* dst, __m512 v) {
  if constexpr (std::is_same_v<T, float>) return _mm512_storeu_ps(dst, v);
  __m256i* out = reinterpret_cast<__m256i*>(dst);
  if constexpr (std::is_same_v<T, Half>) {
    return _mm256_storeu_si256(out, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  // VCVTNEPS2BF16 rounds as f32_to_bf16_bits (to nearest even, a NaN quieted the
  // same way) but flushes denormal inputs to zero: a vector holding one takes the
  // integer path below.
  if (!_mm512_fpclass_ps_mask(v, 0x20)) {
    const __m256bh narrowed = _mm512_cvtneps_pbh(v);
    return _mm256_storeu_si256(out, reinterpret_cast<const __m256i&>(narrowed));
  }
#endif
  const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(out, _mm512_cvtepi32_epi16(rounded));
}
#endif

// Widen a block of T into its accumulator type, and narrow it back (rounding
// once). Without AVX-512, float16 uses F16C where the target has it (the
// compiler's _Float16 conversions are scalar bit manipulation there) and
// bfloat16 loops over its bit patterns, which the compiler vectorizes.
template <typename T, typename A>
inline void widen(const T* src, A* out, int64_t len) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
    [[maybe_unused]] const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#if defined(RINGCOMM_AVX512)
    for (; i + 16 <= len; i += 16) _mm512_storeu_ps(out + i, load16(src + i));
#elif defined(__F16C__)
    if constexpr (std::is_same_v<T, Half>) {
      for (; i + 8 <= len; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
      for (; i < len; ++i) out[i] = _cvtsh_ss(bits[i]);
    }
#endif
    if constexpr (std::is_same_v<T, BFloat16>) {
      for (; i < len; ++i) {
        const uint32_t wide = bf16_to_f32_bits(bits[i]);
        std::memcpy(out + i, &wide, sizeof(wide));
      }
    }
  }
  for (; i < len; ++i) out[i] = load(src[i]);
}

template <typename T, typename A>
inline void narrow(const A* acc, T* dst, int64_t len) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
    [[maybe_unused]] uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
#if defined(RINGCOMM_AVX512)
    for (; i + 16 <= len; i += 16) store16(dst + i, _mm512_loadu_ps(acc + i));
#elif defined(__F16C__)
    if constexpr (std::is_same_v<T, Half>) {
      for (; i + 8 <= len; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(bits + i), _mm256_cvtps_ph(_mm256_loadu_ps(acc + i), _MM_FROUND_TO_NEAREST_INT));
      for (; i < len; ++i) bits[i] = _cvtss_sh(acc[i], _MM_FROUND_TO_NEAREST_INT);
    }
#endif
    if constexpr (std::is_same_v<T, BFloat16>) {
      for (; i < len; ++i) {
        uint32_t wide;
        std::memcpy(&wide, acc + i, sizeof(wide));
        bits[i] = f32_to_bf16_bits(wide);
      }
    }
  }
  for (; i < len; ++i) dst[i] = store<T>(acc[i]);
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
