// AVX-512 lanes of the blockwise quantization kernels (quant.cpp): the same
// float32 ops as its portable tiles, 16 elements per vector, each row's q
// widened, scaled and added in one pass. Each function handles the longest
// prefix of whole vectors and returns its length; quant.cpp finishes the rest.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/convert.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

// One block's k rows: row j's bytes start at data + j * row_nbytes, its scale
// at scales[j * row_scales].
struct BlockRows {
  const uint8_t* data;
  int64_t row_nbytes;
  const float* scales;
  int64_t row_scales;
  int num_rows;
};

#if defined(RINGCOMM_AVX512)
// round_half_to_even(x * inv). With a finite inv (absmax >= qmax / FLT_MAX) and
// |x| <= absmax, |x * inv| rounds to at most qmax, so no clamp is needed;
// otherwise the clamp of the tiles: MINPS and MAXPS return their second operand
// when either is NaN, so a NaN survives the clamp and the ordered mask zeroes it.
template <bool kFiniteInv>
inline __m512i quantize16(__m512 x, __m512 inv, __m512 qmax) {
  __m512 y = _mm512_mul_ps(x, inv);
  if constexpr (kFiniteInv) return _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  y = _mm512_min_ps(qmax, y);
  y = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), qmax), y);
  const __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
  return _mm512_maskz_cvt_roundps_epi32(ordered, y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Elements 2i and 2i + 1 of 32 consecutive T, i = 0..15, as float32 lanes. A
// bfloat16 pair is one 32-bit lane: the odd element is its high half already.
template <typename T>
inline void load_pairs(const T* x, __m512* even, __m512* odd) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    const __m512i v = _mm512_loadu_si512(x);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  } else {
    const __m512 a = load16(x), b = load16(x + 16);
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    *even = _mm512_permutex2var_ps(a, evens, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), b);
  }
}

// 8 bits: one byte of q per element. 4 bits: elements 2i and 2i + 1 in the low
// and high nibble of byte i, each as q + 8: (q & 15) ^ 8 for q in [-8, 7].
template <bool kFiniteInv, typename T>
int64_t quantize_lanes_as(const T* x, int64_t len, uint8_t* data, float inv, float qmax, int bits) {
  const __m512 vinv = _mm512_set1_ps(inv), vqmax = _mm512_set1_ps(qmax);
  int64_t i = 0;
  if (bits == 8) {
    for (; i + 16 <= len; i += 16) {
      const __m512i q = quantize16<kFiniteInv>(load16(x + i), vinv, vqmax);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i), _mm512_cvtepi32_epi8(q));
    }
    return i;
  }
  for (; i + 32 <= len; i += 32) {
    __m512 even, odd;
    load_pairs(x + i, &even, &odd);
    const __m512i low = _mm512_and_si512(quantize16<kFiniteInv>(even, vinv, vqmax), _mm512_set1_epi32(15));
    const __m512i high = _mm512_slli_epi32(quantize16<kFiniteInv>(odd, vinv, vqmax), 4);
    const __m128i packed = _mm512_cvtepi32_epi8(_mm512_or_si512(low, high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i / 2), _mm_xor_si128(packed, _mm_set1_epi8(static_cast<char>(0x88))));
  }
  return i;
}

// The longest prefix of whole vectors of quantize_block's tiles; returns its length.
template <typename T>
int64_t quantize_lanes(const T* x, int64_t len, uint8_t* data, float inv, float qmax, int bits) {
  if (inv <= std::numeric_limits<float>::max()) return quantize_lanes_as<true>(x, len, data, inv, qmax, bits);
  return quantize_lanes_as<false>(x, len, data, inv, qmax, bits);
}

// The product as its own float32 value: GCC contracts a multiply feeding an add
// into an FMA even across intrinsics and statements, and the empty asm hides the
// product from it (no instruction is emitted).
inline __m512 rounded_product(__m512 a, __m512 b) {
  __m512 product = _mm512_mul_ps(a, b);
  asm("" : "+v"(product));
  return product;
}

// q of 16 int8 elements as float32.
inline __m512 int8_lanes(const uint8_t* bytes) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
}

// q of 32 int4 elements, 2i in even and 2i + 1 in odd, as float32: a nibble n
// ORed into the mantissa of 2^23 is the float 2^23 + n, and subtracting 2^23 + 8
// leaves n - 8 exactly.
inline void int4_pairs(const uint8_t* bytes, __m512* even, __m512* odd) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i two23 = _mm512_set1_epi32(0x4B000000);
  const __m512 bias = _mm512_set1_ps(8388616.0f);  // 2^23 + 8
  *even = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(15)), two23)), bias);
  *odd = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(v, 4), two23)), bias);
}

// out = sum over rows, in order, of float(q) * scale, each product rounded first.
// 4 bits sum in the pairs' layout and interleave once, at the store. kRows is
// rows.num_rows where it is a compile-time constant (0 where it is not).
template <int kRows, typename T>
int64_t sum_lanes(BlockRows rows, T* out, int64_t len, int bits) {
  const int num_rows = kRows > 0 ? kRows : rows.num_rows;
  int64_t i = 0;
  if (bits == 8) {
    for (; i + 16 <= len; i += 16) {
      __m512 acc = rounded_product(int8_lanes(rows.data + i), _mm512_set1_ps(rows.scales[0]));
      for (int j = 1; j < num_rows; ++j) {
        const __m512 product = rounded_product(int8_lanes(rows.data + j * rows.row_nbytes + i),
                                               _mm512_set1_ps(rows.scales[j * rows.row_scales]));
        acc = _mm512_add_ps(acc, product);
      }
      store16(out + i, acc);
    }
    return i;
  }
  const __m512i first_half = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
  for (; i + 32 <= len; i += 32) {
    __m512 even, odd, q_even, q_odd;
    int4_pairs(rows.data + i / 2, &q_even, &q_odd);
    const __m512 scale = _mm512_set1_ps(rows.scales[0]);
    even = rounded_product(q_even, scale);
    odd = rounded_product(q_odd, scale);
    for (int j = 1; j < num_rows; ++j) {
      int4_pairs(rows.data + j * rows.row_nbytes + i / 2, &q_even, &q_odd);
      const __m512 row_scale = _mm512_set1_ps(rows.scales[j * rows.row_scales]);
      even = _mm512_add_ps(even, rounded_product(q_even, row_scale));
      odd = _mm512_add_ps(odd, rounded_product(q_odd, row_scale));
    }
    store16(out + i, _mm512_permutex2var_ps(even, first_half, odd));
    store16(out + i + 16, _mm512_permutex2var_ps(even, second_half, odd));
  }
  return i;
}

// The row counts of a host's ranks unrolled (5-7% faster on 4 rows).
template <typename T>
int64_t dequantize_sum_lanes(BlockRows rows, T* out, int64_t len, int bits) {
  switch (rows.num_rows) {
    case 1: return sum_lanes<1>(rows, out, len, bits);
    case 2: return sum_lanes<2>(rows, out, len, bits);
    case 4: return sum_lanes<4>(rows, out, len, bits);
    case 8: return sum_lanes<8>(rows, out, len, bits);
    default: return sum_lanes<0>(rows, out, len, bits);
  }
}
#else
template <typename T> int64_t quantize_lanes(const T*, int64_t, uint8_t*, float, float, int) { return 0; }
template <typename T> int64_t dequantize_sum_lanes(BlockRows, T*, int64_t, int) { return 0; }
#endif

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
