// Shared vocabulary of the C++ side: dtype and reduction-op codes (they match
// ringcomm/ops.py) and the 16-bit float conversions the kernels use.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ringcomm {

enum class DType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3, kInt32 = 4, kInt64 = 5 };
enum class RedOp : int { kSum = 0, kAvg = 1, kProduct = 2, kMin = 3, kMax = 4 };

inline DType to_dtype(int code) {
  if (code < 0 || code > 5) throw std::invalid_argument("ringcomm: unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

inline RedOp to_redop(int code) {
  if (code < 0 || code > 4) throw std::invalid_argument("ringcomm: unknown reduce op code " + std::to_string(code));
  return static_cast<RedOp>(code);
}

inline int64_t element_nbytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat64: case DType::kInt64: return 8;
    case DType::kBFloat16: case DType::kFloat16: return 2;
  }
  return 0;
}

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

}  // namespace ringcomm
