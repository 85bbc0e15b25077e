// Shared vocabulary of the C++ side: dtype and reduction-op codes (they match
// ringcomm/core/ops.py).
#pragma once

#include <cstdint>
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

// One spin-wait pause (a waiter polling a flag another process sets).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace ringcomm
