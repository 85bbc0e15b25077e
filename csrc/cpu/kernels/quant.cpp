// Blockwise quantization kernels ([Note: quantized blocks] in ringcomm/kernels/quant.py).
// A block's absmax is found on the raw bits: |x| as an unsigned pattern orders
// as the floats do, and every NaN and inf lies at or above the infinity
// pattern, so one integer max finds the absmax and the non-finite case at once
// (a float max would drop NaN). The rest runs over tiles that the compiler
// vectorizes; the float ops are exactly those of the format (no FMA: a product
// and the sum it feeds are separate loops).
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/convert.h"
#include "kernels/quant_simd.h"
#include "parallel.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {
namespace {

constexpr int64_t kTile = 1024;  // elements per tile; even, so a tile starts on a byte of int4 pairs
// Element-rows per extra thread, at least: a parallel region on torch's awake
// OpenMP threads costs a few us, and 2^16 elements take ~5-15 us on one core.
constexpr int64_t kMinThreadWork = 1 << 16;

// Runs fn(first_block, end_block) over [0, num_blocks) split in contiguous
// ranges, kPartsPerThread per thread; the work is numel elements of each of
// num_rows rows.
template <typename Fn>
void parallel_blocks(int64_t numel, int num_rows, QuantFormat f, int num_threads, Fn fn) {
  const int64_t blocks = num_blocks(numel, f.block);
  if (blocks == 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>({num_threads, blocks, numel * num_rows / kMinThreadWork}));
  const int64_t parts = threads == 1 ? 1 : std::min<int64_t>(blocks, threads * kPartsPerThread);
  const int64_t per = (blocks + parts - 1) / parts;
  parallel_run(static_cast<int>(threads), static_cast<int>((blocks + per - 1) / per), [&](int part) {
    fn(part * per, std::min(blocks, (part + 1) * per));
  });
}

template <typename T> struct AbsBits;
template <> struct AbsBits<float> { using U = uint32_t; static constexpr U kMask = 0x7fffffffu, kInf = 0x7f800000u; };
template <> struct AbsBits<BFloat16> { using U = uint16_t; static constexpr U kMask = 0x7fff, kInf = 0x7f80; };
template <> struct AbsBits<Half> { using U = uint16_t; static constexpr U kMask = 0x7fff, kInf = 0x7c00; };

template <typename T>
typename AbsBits<T>::U absmax_bits(const T* x, int64_t len) {
  using U = typename AbsBits<T>::U;
  const U* bits = reinterpret_cast<const U*>(x);
  U m = 0;
  for (int64_t i = 0; i < len; ++i) {
    const U a = static_cast<U>(bits[i] & AbsBits<T>::kMask);
    m = a > m ? a : m;
  }
  return m;
}

template <typename T> float bits_to_float(typename AbsBits<T>::U bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(v));
  return load(v);
}

// q = clamp(round_half_to_even(x * inv), -qmax, qmax); a NaN product (0 * inf,
// where absmax < qmax / FLT_MAX) gives 0. Adding 1.5 * 2^23 rounds |y| <= 2^22
// half to even and leaves the integer in the low mantissa bits.
void quantize_tile(const float* x, int8_t* q, int64_t len, float inv, float qmax) {
  for (int64_t i = 0; i < len; ++i) {
    float y = x[i] * inv;
    y = y > qmax ? qmax : y;
    y = y < -qmax ? -qmax : y;
    y = y == y ? y : 0.0f;
    const float shifted = y + 12582912.0f;
    int32_t bits;
    std::memcpy(&bits, &shifted, sizeof(bits));
    q[i] = static_cast<int8_t>(bits - 0x4B400000);
  }
}

// Element 2i in the low nibble, 2i+1 in the high one, each as q + 8; an odd
// last element leaves its high nibble 0.
void pack_nibbles(const int8_t* q, uint8_t* data, int64_t len) {
  for (int64_t i = 0; i < len / 2; ++i) data[i] = static_cast<uint8_t>((q[2 * i] + 8) | ((q[2 * i + 1] + 8) << 4));
  if (len & 1) data[len / 2] = static_cast<uint8_t>(q[len - 1] + 8);
}

// A block of zeros (scale 0) or with a NaN or inf (scale NaN): every q is 0.
void fill_zero_block(uint8_t* data, int64_t len, int bits) {
  if (bits == 8) return static_cast<void>(std::memset(data, 0, static_cast<size_t>(len)));
  std::memset(data, 0x88, static_cast<size_t>(len / 2));
  if (len & 1) data[len / 2] = 0x08;
}

template <typename T>
void quantize_block(const T* x, int64_t len, uint8_t* data, float* scale, int bits) {
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  const auto m = absmax_bits(x, len);
  if (m == 0 || m >= AbsBits<T>::kInf) {
    *scale = m == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return fill_zero_block(data, len, bits);
  }
  const float absmax = bits_to_float<T>(m);
  *scale = absmax / qmax;
  const float inv = qmax / absmax;
  alignas(64) float wide[kTile];
  alignas(64) int8_t q[kTile];
  for (int64_t begin = quantize_lanes(x, len, data, inv, qmax, bits); begin < len; begin += kTile) {
    const int64_t n = std::min(kTile, len - begin);
    const float* src = wide;
    if constexpr (std::is_same_v<T, float>) src = x + begin;
    else widen(x + begin, wide, n);
    if (bits == 8) {
      quantize_tile(src, reinterpret_cast<int8_t*>(data + begin), n, inv, qmax);
    } else {
      quantize_tile(src, q, n, inv, qmax);
      pack_nibbles(q, data + begin / 2, n);
    }
  }
}

template <typename T>
void quantize_typed(const T* x, int64_t numel, uint8_t* data, float* scales, QuantFormat f, int num_threads) {
  parallel_blocks(numel, 1, f, num_threads, [=](int64_t first, int64_t end) {
    for (int64_t b = first; b < end; ++b) {
      const int64_t begin = b * f.block, len = std::min(f.block, numel - begin);
      quantize_block(x + begin, len, data + (f.bits == 8 ? begin : begin / 2), scales + b, f.bits);
    }
  });
}

// out = float(q) * scale for one tile of int8 bytes or int4 nibble pairs.
void dequantize_tile(const uint8_t* data, float scale, float* out, int64_t len, int bits) {
  if (bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(data);
    for (int64_t i = 0; i < len; ++i) out[i] = static_cast<float>(q[i]) * scale;
    return;
  }
  for (int64_t i = 0; i < len / 2; ++i) {
    out[2 * i] = static_cast<float>((data[i] & 15) - 8) * scale;
    out[2 * i + 1] = static_cast<float>((data[i] >> 4) - 8) * scale;
  }
  if (len & 1) out[len - 1] = static_cast<float>((data[len / 2] & 15) - 8) * scale;
}

void add_tile(float* acc, const float* next, int64_t len) {
  for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] + next[i];
}

template <typename T>
void dequantize_sum_range(const uint8_t* data, const float* scales, int num_rows, T* out, int64_t numel,
                          QuantFormat f, int64_t first_block, int64_t end_block) {
  const int64_t row_nbytes = packed_nbytes(numel, f.bits), row_scales = num_blocks(numel, f.block);
  alignas(64) float acc[kTile];
  alignas(64) float next[kTile];
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t block_begin = b * f.block, block_end = std::min(block_begin + f.block, numel);
    const BlockRows rows{data + (f.bits == 8 ? block_begin : block_begin / 2), row_nbytes, scales + b, row_scales, num_rows};
    const int64_t done = dequantize_sum_lanes(rows, out + block_begin, block_end - block_begin, f.bits);
    for (int64_t begin = block_begin + done; begin < block_end; begin += kTile) {
      const int64_t n = std::min(kTile, block_end - begin), byte = f.bits == 8 ? begin : begin / 2;
      float* first = acc;
      if constexpr (std::is_same_v<T, float>) first = num_rows == 1 ? out + begin : acc;
      dequantize_tile(data + byte, scales[b], first, n, f.bits);
      for (int j = 1; j < num_rows; ++j) {
        dequantize_tile(data + j * row_nbytes + byte, scales[j * row_scales + b], next, n, f.bits);
        add_tile(acc, next, n);
      }
      if (first != acc) continue;
      if constexpr (std::is_same_v<T, float>) std::memcpy(out + begin, acc, static_cast<size_t>(n) * sizeof(float));
      else narrow(acc, out + begin, n);
    }
  }
}

template <typename T>
void dequantize_sum_typed(const uint8_t* data, const float* scales, int num_rows, T* out, int64_t numel,
                          QuantFormat f, int num_threads) {
  parallel_blocks(numel, num_rows, f, num_threads, [=](int64_t first, int64_t end) {
    dequantize_sum_range(data, scales, num_rows, out, numel, f, first, end);
  });
}

}  // namespace

void quantize(const void* x, DType dtype, int64_t numel, uint8_t* data, float* scales, QuantFormat format,
              int num_threads) {
  switch (dtype) {
    case DType::kFloat32: return quantize_typed(static_cast<const float*>(x), numel, data, scales, format, num_threads);
    case DType::kBFloat16: return quantize_typed(static_cast<const BFloat16*>(x), numel, data, scales, format, num_threads);
    case DType::kFloat16: return quantize_typed(static_cast<const Half*>(x), numel, data, scales, format, num_threads);
    default: return;  // checked in kernels.cpp
  }
}

void dequantize_sum(const uint8_t* data, const float* scales, int num_rows, void* out, DType dtype, int64_t numel,
                    QuantFormat format, int num_threads) {
  switch (dtype) {
    case DType::kFloat32: return dequantize_sum_typed(data, scales, num_rows, static_cast<float*>(out), numel, format, num_threads);
    case DType::kBFloat16: return dequantize_sum_typed(data, scales, num_rows, static_cast<BFloat16*>(out), numel, format, num_threads);
    case DType::kFloat16: return dequantize_sum_typed(data, scales, num_rows, static_cast<Half*>(out), numel, format, num_threads);
    default: return;  // checked in kernels.cpp
  }
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
