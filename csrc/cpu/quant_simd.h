// AVX-512 lanes of the blockwise quantization kernels (quant.cpp): the same
// float32 ops as its portable tiles, 16 elements per vector, each row's q
// widened, scaled and added in one pass. Each function handles the longest
// prefix of whole vectors and returns its length; quant.cpp finishes the rest.
#pragma once

#include <cstdint>

#include "convert.h"

namespace ringcomm {

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
// clamp(round_half_to_even(x * inv), -qmax, qmax), a NaN product giving 0. MINPS
// and MAXPS return their second operand when either is NaN, so a NaN survives
// the clamp and the ordered mask zeroes it; the conversion rounds to nearest even.
inline __m512i quantize16(__m512 x, __m512 inv, __m512 qmax) {
  __m512 y = _mm512_mul_ps(x, inv);
  y = _mm512_min_ps(qmax, y);
  y = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), qmax), y);
  const __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
  return _mm512_maskz_cvt_roundps_epi32(ordered, y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// 8 bits: one byte of q per element. 4 bits: q + 8 per byte, then each 16-bit
// pair (low byte element 2i) folded into one byte, element 2i + 1 in the high nibble.
template <typename T>
int64_t quantize_lanes(const T* x, int64_t len, uint8_t* data, float inv, float qmax, int bits) {
  const __m512 vinv = _mm512_set1_ps(inv), vqmax = _mm512_set1_ps(qmax);
  int64_t i = 0;
  if (bits == 8) {
    for (; i + 16 <= len; i += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i), _mm512_cvtepi32_epi8(quantize16(load16(x + i), vinv, vqmax)));
    }
    return i;
  }
  const __m512i eight = _mm512_set1_epi32(8);
  for (; i + 32 <= len; i += 32) {
    const __m128i lo = _mm512_cvtepi32_epi8(_mm512_add_epi32(quantize16(load16(x + i), vinv, vqmax), eight));
    const __m128i hi = _mm512_cvtepi32_epi8(_mm512_add_epi32(quantize16(load16(x + i + 16), vinv, vqmax), eight));
    const __m256i pairs = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    const __m256i folded = _mm256_or_si256(pairs, _mm256_srli_epi16(pairs, 4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i / 2), _mm256_cvtepi16_epi8(folded));
  }
  return i;
}

// The product as its own float32 value: GCC contracts a multiply feeding an add
// into an FMA even across intrinsics and statements, and the empty asm hides the
// product from it (no instruction is emitted).
inline __m512 rounded_product(__m512 a, __m512 b) {
  __m512 product = _mm512_mul_ps(a, b);
  asm("" : "+v"(product));
  return product;
}

// q of 16 int8 elements, or of 32 int4 elements (two vectors, in element order), as float32.
inline __m512 int8_lanes(const uint8_t* bytes) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
}

inline void int4_lanes(const uint8_t* bytes, __m512* first, __m512* second) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i low = _mm512_and_si512(v, _mm512_set1_epi32(15));
  const __m512i high = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xf0)), 12);
  const __m512i q16 = _mm512_sub_epi16(_mm512_or_si512(low, high), _mm512_set1_epi16(8));
  *first = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q16)));
  *second = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q16, 1)));
}

// out = sum over rows, in order, of float(q) * scale, each product rounded first.
template <typename T>
int64_t dequantize_sum_lanes(BlockRows rows, T* out, int64_t len, int bits) {
  int64_t i = 0;
  if (bits == 8) {
    for (; i + 16 <= len; i += 16) {
      __m512 acc = _mm512_mul_ps(int8_lanes(rows.data + i), _mm512_set1_ps(rows.scales[0]));
      for (int j = 1; j < rows.num_rows; ++j) {
        const __m512 product = rounded_product(int8_lanes(rows.data + j * rows.row_nbytes + i),
                                               _mm512_set1_ps(rows.scales[j * rows.row_scales]));
        acc = _mm512_add_ps(acc, product);
      }
      store16(out + i, acc);
    }
    return i;
  }
  for (; i + 32 <= len; i += 32) {
    __m512 first, second, q_first, q_second;
    int4_lanes(rows.data + i / 2, &q_first, &q_second);
    const __m512 scale = _mm512_set1_ps(rows.scales[0]);
    first = _mm512_mul_ps(q_first, scale);
    second = _mm512_mul_ps(q_second, scale);
    for (int j = 1; j < rows.num_rows; ++j) {
      int4_lanes(rows.data + j * rows.row_nbytes + i / 2, &q_first, &q_second);
      const __m512 row_scale = _mm512_set1_ps(rows.scales[j * rows.row_scales]);
      first = _mm512_add_ps(first, rounded_product(q_first, row_scale));
      second = _mm512_add_ps(second, rounded_product(q_second, row_scale));
    }
    store16(out + i, first);
    store16(out + i + 16, second);
  }
  return i;
}
#else
template <typename T> int64_t quantize_lanes(const T*, int64_t, uint8_t*, float, float, int) { return 0; }
template <typename T> int64_t dequantize_sum_lanes(BlockRows, T*, int64_t, int) { return 0; }
#endif

}  // namespace ringcomm
