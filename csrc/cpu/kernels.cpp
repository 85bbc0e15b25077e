// The kernels' entry points: check the arguments, then run the build that
// cpu_capability.h chose for this CPU.
#include <stdexcept>
#include <string>

#include "adam.h"
#include "checksum.h"
#include "copy.h"
#include "cpu_capability.h"
#include "quant.h"
#include "reduce.h"

namespace ringcomm {
namespace {

void check_format(const char* op, int64_t numel, QuantFormat f, int num_threads) {
  if (f.bits != 4 && f.bits != 8) throw std::invalid_argument(std::string(op) + ": bits=" + std::to_string(f.bits) + ", expected 4 or 8");
  if (f.block < 1 || (f.bits == 4 && f.block % 2 != 0)) {
    throw std::invalid_argument(std::string(op) + ": block=" + std::to_string(f.block) + " must be >= 1, and even for 4 bits");
  }
  if (numel < 0 || num_threads < 1) {
    throw std::invalid_argument(std::string(op) + ": numel=" + std::to_string(numel) + ", num_threads=" +
                                std::to_string(num_threads) + " (expected numel >= 0, num_threads >= 1)");
  }
}

void check_float_dtype(const char* op, DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    throw std::invalid_argument(std::string(op) + ": dtype code " + std::to_string(static_cast<int>(dtype)) +
                                ", expected float32, bfloat16 or float16");
  }
}

}  // namespace

void reduce_n(void* dst, const void* const* srcs, int num_srcs, int64_t numel, DType dtype, RedOp op,
              int64_t divisor) {
  if (num_srcs < 1) throw std::invalid_argument("reduce_n: needs at least one source, got " + std::to_string(num_srcs));
  if (numel < 0) throw std::invalid_argument("reduce_n: numel=" + std::to_string(numel) + " < 0");
  if (op == RedOp::kAvg && divisor < 1) throw std::invalid_argument("reduce_n: avg divisor=" + std::to_string(divisor) + " < 1");
  cpu_kernels().reduce_n(dst, srcs, num_srcs, numel, dtype, op, divisor);
}

void copy_bytes(void* dst, const void* src, int64_t nbytes) { cpu_kernels().copy_bytes(dst, src, nbytes); }

void quantize(const void* x, DType dtype, int64_t numel, uint8_t* data, float* scales, QuantFormat format,
              int num_threads) {
  check_format("quantize", numel, format, num_threads);
  check_float_dtype("quantize", dtype);
  cpu_kernels().quantize(x, dtype, numel, data, scales, format, num_threads);
}

void dequantize_sum(const uint8_t* data, const float* scales, int num_rows, void* out, DType dtype, int64_t numel,
                    QuantFormat format, int num_threads) {
  check_format("dequantize_sum", numel, format, num_threads);
  if (num_rows < 1) throw std::invalid_argument("dequantize_sum: num_rows=" + std::to_string(num_rows) + " < 1");
  check_float_dtype("dequantize_sum", dtype);
  cpu_kernels().dequantize_sum(data, scales, num_rows, out, dtype, numel, format, num_threads);
}

void adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
               int64_t numel, const AdamHyper& hyper, AdamCopies* copies, int num_threads) {
  if (numel < 0 || num_threads < 1 || hyper.step < 1) {
    throw std::invalid_argument("adam_step: numel=" + std::to_string(numel) + ", num_threads=" +
                                std::to_string(num_threads) + ", step=" + std::to_string(hyper.step));
  }
  if (out != nullptr && out_dtype != DType::kBFloat16 && out_dtype != DType::kFloat16) {
    throw std::invalid_argument("adam_step: the parameter copy must be bfloat16 or float16, got dtype code " +
                                std::to_string(static_cast<int>(out_dtype)));
  }
  if (copies != nullptr && (copies->count < 0 || copies->count > AdamCopies::kMaxCopies)) {
    throw std::invalid_argument("adam_step: " + std::to_string(copies->count) + " copies, at most " +
                                std::to_string(AdamCopies::kMaxCopies));
  }
  const float* const state[3] = {param, exp_avg, exp_avg_sq};
  for (int j = 0; copies != nullptr && j < copies->count; ++j) {
    for (int k = 0; k < 3; ++k) {
      const float* to = copies->to[j][k];
      if (to == nullptr && numel > 0) {
        throw std::invalid_argument("adam_step: copy " + std::to_string(j) + " has a null target");
      }
      if (to != state[k] && to < state[k] + numel && state[k] < to + numel) {  // the state itself is allowed
        throw std::invalid_argument("adam_step: copy " + std::to_string(j) + " of state " + std::to_string(k) +
                                    " overlaps the state it copies");
      }
    }
  }
  cpu_kernels().adam_step(param, grad, exp_avg, exp_avg_sq, out, out_dtype, numel, hyper, copies, num_threads);
}

uint64_t word_sum(const void* data, int64_t nbytes, int64_t first) {
  if (nbytes < 0 || first < 0) {
    throw std::invalid_argument("word_sum: nbytes=" + std::to_string(nbytes) + ", first=" + std::to_string(first) +
                                " (expected both >= 0)");
  }
  return cpu_kernels().word_sum(data, nbytes, first);
}

}  // namespace ringcomm
