// Which build of the kernels runs: the CPU's capability, found when the
// library first needs a kernel, and the table of that build's entry points.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "adam.h"
#include "common.h"
#include "quant.h"

namespace ringcomm {

// [Note: CPU capabilities]
// One binary for every x86-64 CPU, as ATen's DispatchStub and NumPy's dispatch
// do it. The library is compiled for a baseline (x86-64-v2) and the sources of
// csrc/cpu/kernels/ again for each wider capability, each in its own namespace:
//   default      x86-64-v2 (every x86-64 CPU since 2009; other architectures: the compiler's default)
//   avx2         x86-64-v3: AVX2, FMA, F16C, BMI2
//   avx512       x86-64-v4: AVX-512 F, BW, DQ, VL
//   avx512_bf16  x86-64-v4 + AVX512-BF16
// The best that the CPU (cpuid) and the build both have is used, or the one
// named by RINGCOMM_CPU_CAPABILITY, when the CPU has it (as ATEN_CPU_CAPABILITY:
// a wider one than the CPU has falls back to the CPU's best). Every build
// compiles with -ffp-contract=off, so they all round the same float ops the
// same way and give the same bits. setup.py links the baseline objects first,
// then the capabilities in increasing order, so where two builds hold the same
// inline function of a library header, the copy kept is the narrowest one
// (ELF keeps the first of equal COMDAT groups); tests/test_cpu_dispatch.py
// disassembles the library to check that no code outside the wider namespaces
// uses an instruction the baseline lacks.
enum class CpuCapability : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

struct CpuKernels {
  void (*reduce_n)(void* dst, const void* const* srcs, int num_srcs, int64_t numel, DType dtype, RedOp op,
                   int64_t divisor);
  void (*copy_bytes)(void* dst, const void* src, int64_t nbytes);
  void (*quantize)(const void* x, DType dtype, int64_t numel, uint8_t* data, float* scales, QuantFormat format,
                   int num_threads);
  void (*dequantize_sum)(const uint8_t* data, const float* scales, int num_rows, void* out, DType dtype,
                         int64_t numel, QuantFormat format, int num_threads);
  void (*adam_step)(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, DType out_dtype,
                    int64_t numel, const AdamHyper& hyper, AdamCopies* copies, int num_threads);
  uint64_t (*word_sum)(const void* data, int64_t nbytes, int64_t first);
};

const char* capability_name(CpuCapability capability);

// The capabilities this library was built with, narrowest first, and those of
// them that this CPU can run.
std::vector<CpuCapability> built_capabilities();
std::vector<CpuCapability> supported_capabilities();

// The capability in use; the first call chooses it (and throws
// std::invalid_argument for an unknown RINGCOMM_CPU_CAPABILITY).
CpuCapability active_capability();
const CpuKernels& cpu_kernels();

}  // namespace ringcomm
