// CUDA blockwise quantization with the semantics of csrc/cpu/quant.cpp ([Note:
// quantized blocks] in ringcomm/kernels/quant.py): one thread block per quantization
// block (grid-stride over blocks), a shared-memory absmax reduction on the
// |x| bit patterns (an integer max that keeps NaN and inf at the top), and
// __fmul_rn/__fadd_rn so that no multiply-add is fused. The device part
// includes no header (NVRTC compiles it as it is, see reduce.cu).

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define RC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RC_HOST_DEVICE inline
#endif

namespace ringcomm_quant {

typedef unsigned long long Ptr;
enum DType { kFloat32 = 0, kBFloat16 = 2, kFloat16 = 3 };
const int kThreads = 256;     // threads per block, a power of two (the tree reduction halves it)
const int kMaxGrid = 65535;   // thread blocks per launch, as MAX_GRID in ringcomm/kernels/cuda_quant.py

RC_HOST_DEVICE unsigned int float_bits(float v) { union { float f; unsigned int u; } x; x.f = v; return x.u; }
RC_HOST_DEVICE float bits_float(unsigned int v) { union { unsigned int u; float f; } x; x.u = v; return x.f; }

// float32 of element i of a float32, bfloat16 or float16 array (exact).
RC_HOST_DEVICE float load(Ptr base, int dtype, long long i) {
  if (dtype == kFloat32) return reinterpret_cast<const float*>(base)[i];
  const unsigned int h = reinterpret_cast<const unsigned short*>(base)[i];
  if (dtype == kBFloat16) return bits_float(h << 16);
  const unsigned int sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  return bits_float(sign | float_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f));
}

// Stores v rounded to nearest even into element i (bfloat16 keeps NaN quiet, as common.h).
RC_HOST_DEVICE void store(Ptr base, int dtype, long long i, float v) {
  if (dtype == kFloat32) { reinterpret_cast<float*>(base)[i] = v; return; }
  const unsigned int bits = float_bits(v), magnitude = bits & 0x7fffffffu;
  unsigned int out;
  if (dtype == kBFloat16) {
    out = magnitude > 0x7f800000u ? (bits >> 16) | 0x40u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  } else if (magnitude > 0x7f800000u) {
    out = ((bits >> 16) & 0x8000u) | 0x7e00u | ((magnitude >> 13) & 0x3ffu);
  } else if (magnitude >= 0x477ff000u) {
    out = ((bits >> 16) & 0x8000u) | 0x7c00u;
  } else if (magnitude >= 0x38800000u) {
    const unsigned int rebiased = magnitude - 0x38000000u;
    out = ((bits >> 16) & 0x8000u) | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13);
  } else if (magnitude <= 0x33000000u) {
    out = (bits >> 16) & 0x8000u;
  } else {
    const unsigned int significand = 0x800000u | (magnitude & 0x7fffffu), shift = 126u - (magnitude >> 23);
    const unsigned int rest = significand & ((1u << shift) - 1u), tie = 1u << (shift - 1u);
    out = significand >> shift;
    if (rest > tie || (rest == tie && (out & 1u))) ++out;
    out |= (bits >> 16) & 0x8000u;
  }
  reinterpret_cast<unsigned short*>(base)[i] = static_cast<unsigned short>(out);
}

// Device code rounds each op on its own; the emulator (g++) builds with -ffp-contract=off.
RC_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RC_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// q = clamp(round_half_to_even(x * inv), -qmax, qmax), NaN to 0 (1.5 * 2^23 rounds to an integer).
RC_HOST_DEVICE int quantize_value(float x, float inv, float qmax) {
  float y = mul_rn(x, inv);
  y = y > qmax ? qmax : y;
  y = y < -qmax ? -qmax : y;
  y = y == y ? y : 0.0f;
  return static_cast<int>(float_bits(add_rn(y, 12582912.0f))) - 0x4B400000;
}

// The largest |x| bit pattern of elements first, first + stride, ... of a block.
RC_HOST_DEVICE unsigned int partial_absmax(Ptr x, int dtype, long long begin, long long len, int first, int stride) {
  unsigned int m = 0;
  for (long long i = first; i < len; i += stride) {
    const unsigned int a = float_bits(load(x, dtype, begin + i)) & 0x7fffffffu;
    m = a > m ? a : m;
  }
  return m;
}

// Writes the bytes first, first + stride, ... of a block; zero: every q is 0 (scale 0 or NaN).
RC_HOST_DEVICE void quantize_bytes(Ptr x, int dtype, long long begin, long long len, Ptr data, int bits, float inv,
                                   bool zero, int first, int stride) {
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  unsigned char* out = reinterpret_cast<unsigned char*>(data) + (bits == 8 ? begin : begin / 2);
  const long long nbytes = bits == 8 ? len : (len + 1) / 2;
  for (long long i = first; i < nbytes; i += stride) {
    if (bits == 8) {
      out[i] = static_cast<unsigned char>(zero ? 0 : quantize_value(load(x, dtype, begin + i), inv, qmax));
      continue;
    }
    const int low = zero ? 0 : quantize_value(load(x, dtype, begin + 2 * i), inv, qmax);
    const bool pair = 2 * i + 1 < len;
    const int high = !pair || zero ? 0 : quantize_value(load(x, dtype, begin + 2 * i + 1), inv, qmax);
    out[i] = static_cast<unsigned char>((low + 8) | (pair ? (high + 8) << 4 : 0));
  }
}

// Element i of a block from row j: float(q) * scale.
RC_HOST_DEVICE float dequantize_value(Ptr data, long long row_nbytes, int j, long long i, int bits, float scale) {
  const unsigned char* row = reinterpret_cast<const unsigned char*>(data) + j * row_nbytes;
  const int q = bits == 8 ? static_cast<int>(static_cast<signed char>(row[i]))
                          : static_cast<int>((row[i / 2] >> (4 * (i & 1))) & 15u) - 8;
  return mul_rn(static_cast<float>(q), scale);
}

// Elements first, first + stride, ... of block b: the rows' sum in order, rounded once.
RC_HOST_DEVICE void dequantize_sum_elements(Ptr data, Ptr scales, int num_rows, Ptr out, int dtype, long long numel,
                                            int bits, long long block, long long b, int first, int stride) {
  const long long row_nbytes = bits == 8 ? numel : (numel + 1) / 2, row_scales = (numel + block - 1) / block;
  const float* s = reinterpret_cast<const float*>(scales);
  const long long begin = b * block, end = begin + block < numel ? begin + block : numel;
  for (long long i = begin + first; i < end; i += stride) {
    float acc = dequantize_value(data, row_nbytes, 0, i, bits, s[b]);
    for (int j = 1; j < num_rows; ++j) acc = add_rn(acc, dequantize_value(data, row_nbytes, j, i, bits, s[j * row_scales + b]));
    store(out, dtype, i, acc);
  }
}

RC_HOST_DEVICE bool format_ok(int dtype, long long numel, int bits, long long block) {
  return (dtype == kFloat32 || dtype == kBFloat16 || dtype == kFloat16) && numel >= 0 && block >= 1 &&
         (bits == 8 || (bits == 4 && block % 2 == 0));
}

}  // namespace ringcomm_quant

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

extern "C" __global__ void ringcomm_quantize(unsigned long long x, int dtype, long long numel, unsigned long long data,
                                             unsigned long long scales, int bits, long long block) {
  using namespace ringcomm_quant;
  __shared__ unsigned int absmax[kThreads];
  if (!format_ok(dtype, numel, bits, block)) return;  // the launchers reject it first
  const int t = threadIdx.x;
  for (long long b = blockIdx.x; b * block < numel; b += gridDim.x) {
    const long long begin = b * block, len = begin + block < numel ? block : numel - begin;
    absmax[t] = partial_absmax(x, dtype, begin, len, t, blockDim.x);
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
      if (t < half && absmax[t + half] > absmax[t]) absmax[t] = absmax[t + half];
      __syncthreads();
    }
    const unsigned int m = absmax[0];
    const float qmax = bits == 8 ? 127.0f : 7.0f, top = bits_float(m);
    const bool zero = m == 0 || m >= 0x7f800000u;
    if (t == 0) reinterpret_cast<float*>(scales)[b] = m == 0 ? 0.0f : zero ? bits_float(0x7fc00000u) : top / qmax;
    quantize_bytes(x, dtype, begin, len, data, bits, zero ? 0.0f : qmax / top, zero, t, blockDim.x);
    __syncthreads();  // absmax[0] is read by all before the next block overwrites it
  }
}

extern "C" __global__ void ringcomm_dequantize_sum(unsigned long long data, unsigned long long scales, int num_rows,
                                                   unsigned long long out, int dtype, long long numel, int bits,
                                                   long long block) {
  using namespace ringcomm_quant;
  if (!format_ok(dtype, numel, bits, block) || num_rows < 1) return;
  for (long long b = blockIdx.x; b * block < numel; b += gridDim.x) {
    dequantize_sum_elements(data, scales, num_rows, out, dtype, numel, bits, block, b, threadIdx.x, blockDim.x);
  }
}

#endif

#if defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cuda_runtime.h>

// Host launchers: queue on `stream` (a cudaStream_t as an integer) and return a cudaError_t as int;
// bad arguments return cudaErrorInvalidValue without touching the device.
static unsigned int quant_grid(long long numel, long long block) {
  const long long blocks = (numel + block - 1) / block;
  return static_cast<unsigned int>(blocks < ringcomm_quant::kMaxGrid ? blocks : ringcomm_quant::kMaxGrid);
}

extern "C" int ringcomm_cuda_quantize(unsigned long long x, int dtype, long long numel, unsigned long long data,
                                      unsigned long long scales, int bits, long long block, unsigned long long stream) {
  if (!ringcomm_quant::format_ok(dtype, numel, bits, block)) return static_cast<int>(cudaErrorInvalidValue);
  if (numel == 0) return static_cast<int>(cudaSuccess);
  ringcomm_quantize<<<quant_grid(numel, block), ringcomm_quant::kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      x, dtype, numel, data, scales, bits, block);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int ringcomm_cuda_dequantize_sum(unsigned long long data, unsigned long long scales, int num_rows,
                                            unsigned long long out, int dtype, long long numel, int bits,
                                            long long block, unsigned long long stream) {
  if (!ringcomm_quant::format_ok(dtype, numel, bits, block) || num_rows < 1) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (numel == 0) return static_cast<int>(cudaSuccess);
  ringcomm_dequantize_sum<<<quant_grid(numel, block), ringcomm_quant::kThreads, 0,
                            reinterpret_cast<cudaStream_t>(stream)>>>(data, scales, num_rows, out, dtype, numel, bits,
                                                                      block);
  return static_cast<int>(cudaGetLastError());
}

#endif
