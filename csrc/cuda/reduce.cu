// CUDA reductions and casts: reduce_n with the semantics of csrc/cpu/reduce.cpp
// (dtype and op codes of csrc/cpu/common.h), and float32 <-> bf16/fp16 casts.
//
// [Note: one source, three compilers]
// The device part includes no header, so NVRTC (CuPy's RawModule) compiles it
// as it is; nvcc also builds the extern "C" host launchers at the end. The
// element math and the grid-stride loops are plain C++ marked RC_HOST_DEVICE,
// so the tests compile them with g++ and check them on the CPU, thread by
// emulated thread, against the C++ kernel (tests/test_cuda.py).

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define RC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RC_HOST_DEVICE inline
#endif

namespace ringcomm_cuda {

typedef unsigned long long Ptr;
enum DType { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3, kInt32 = 4, kInt64 = 5 };
enum RedOp { kSum = 0, kAvg = 1, kProduct = 2, kMin = 3, kMax = 4 };
const int kMaxSources = 8;  // sources per launch; ringcomm/kernels/cuda.py chains longer lists

struct BFloat16 { unsigned short bits; };
struct Half { unsigned short bits; };

RC_HOST_DEVICE unsigned int float_bits(float v) { union { float f; unsigned int u; } x; x.f = v; return x.u; }
RC_HOST_DEVICE float bits_float(unsigned int v) { union { unsigned int u; float f; } x; x.u = v; return x.f; }

// 16-bit floats load exactly into float32 and store with round to nearest even;
// bf16 keeps NaN a quiet NaN exactly as common.h does.
RC_HOST_DEVICE float to_acc(BFloat16 v) { return bits_float(static_cast<unsigned int>(v.bits) << 16); }
RC_HOST_DEVICE void store(BFloat16& out, float v) {
  unsigned int bits = float_bits(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) { out.bits = static_cast<unsigned short>((bits >> 16) | 0x40); return; }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  out.bits = static_cast<unsigned short>(bits >> 16);
}

RC_HOST_DEVICE float to_acc(Half v) {
  const unsigned int sign = static_cast<unsigned int>(v.bits & 0x8000u) << 16;
  const unsigned int exponent = (v.bits >> 10) & 0x1fu, mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float subnormal = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // mantissa * 2^-24, exact
  return bits_float(sign | float_bits(subnormal));
}
RC_HOST_DEVICE void store(Half& out, float v) {
  const unsigned int bits = float_bits(v), magnitude = bits & 0x7fffffffu;
  const unsigned int sign = (bits >> 16) & 0x8000u;
  unsigned int out_bits;
  if (magnitude > 0x7f800000u) {
    out_bits = 0x7e00u | ((magnitude >> 13) & 0x3ffu);  // NaN: quiet, payload kept where it fits
  } else if (magnitude >= 0x477ff000u) {
    out_bits = 0x7c00u;  // 65520 and up round to infinity
  } else if (magnitude >= 0x38800000u) {
    // Normal: rebias the exponent (127 -> 15); a mantissa carry moves into the exponent.
    const unsigned int rebiased = magnitude - 0x38000000u;
    out_bits = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
  } else if (magnitude <= 0x33000000u) {
    out_bits = 0;  // at most 2^-25 (a tie with 2^-24 goes to even): zero
  } else {
    // Subnormal: the 24-bit significand shifted to units of 2^-24, rounded to even.
    const unsigned int significand = 0x800000u | (magnitude & 0x7fffffu);
    const unsigned int shift = 126u - (magnitude >> 23);
    const unsigned int rest = significand & ((1u << shift) - 1u), tie = 1u << (shift - 1u);
    out_bits = significand >> shift;
    if (rest > tie || (rest == tie && (out_bits & 1u))) ++out_bits;
  }
  out.bits = static_cast<unsigned short>(sign | out_bits);
}

#define RC_IDENTITY(T) \
  RC_HOST_DEVICE T to_acc(T v) { return v; } \
  RC_HOST_DEVICE void store(T& out, T v) { out = v; }
RC_IDENTITY(float)
RC_IDENTITY(double)
RC_IDENTITY(int)
RC_IDENTITY(long long)
#undef RC_IDENTITY

template <typename T> struct Acc { typedef T Type; };
template <> struct Acc<BFloat16> { typedef float Type; };
template <> struct Acc<Half> { typedef float Type; };

// Integer sum and product wrap (unsigned arithmetic); float min/max propagate NaN.
RC_HOST_DEVICE float add(float a, float b) { return a + b; }
RC_HOST_DEVICE double add(double a, double b) { return a + b; }
RC_HOST_DEVICE int add(int a, int b) { return static_cast<int>(static_cast<unsigned int>(a) + b); }
RC_HOST_DEVICE long long add(long long a, long long b) { return static_cast<long long>(static_cast<Ptr>(a) + b); }
RC_HOST_DEVICE float mul(float a, float b) { return a * b; }
RC_HOST_DEVICE double mul(double a, double b) { return a * b; }
RC_HOST_DEVICE int mul(int a, int b) { return static_cast<int>(static_cast<unsigned int>(a) * b); }
RC_HOST_DEVICE long long mul(long long a, long long b) { return static_cast<long long>(static_cast<Ptr>(a) * b); }

struct Sum { template <typename A> RC_HOST_DEVICE A operator()(A a, A b) const { return add(a, b); } };
struct Product { template <typename A> RC_HOST_DEVICE A operator()(A a, A b) const { return mul(a, b); } };
struct Min { template <typename A> RC_HOST_DEVICE A operator()(A a, A b) const { return (a < b || a != a) ? a : b; } };
struct Max { template <typename A> RC_HOST_DEVICE A operator()(A a, A b) const { return (a > b || a != a) ? a : b; } };

// N elements moved as one load or store: 16 bytes when N * sizeof(T) == 16.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T e[N]; };

struct ReduceArgs {
  Ptr dst;
  Ptr srcs[kMaxSources];
  int num_srcs;
  long long numel;
  bool average;
  long long divisor;
};

template <typename T, int N, typename Op>
RC_HOST_DEVICE void reduce_at(const ReduceArgs& a, long long offset) {
  typedef typename Acc<T>::Type A;
  typedef Pack<T, N> P;
  Op op;
  P in = *reinterpret_cast<const P*>(a.srcs[0] + offset * sizeof(T));
  A acc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = to_acc(in.e[k]);
#pragma unroll
  for (int s = 1; s < kMaxSources; ++s) {
    if (s >= a.num_srcs) break;
    in = *reinterpret_cast<const P*>(a.srcs[s] + offset * sizeof(T));
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = op(acc[k], to_acc(in.e[k]));
  }
  if (a.average) {
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = acc[k] / static_cast<A>(a.divisor);
  }
  P out;
#pragma unroll
  for (int k = 0; k < N; ++k) store(out.e[k], acc[k]);
  *reinterpret_cast<P*>(a.dst + offset * sizeof(T)) = out;
}

// Elements before the first 16-byte boundary, or -1 when the pointers are not
// all equally misaligned (then every element takes the scalar path).
template <typename T>
RC_HOST_DEVICE long long aligned_head(const ReduceArgs& a) {
  const Ptr misalign = a.dst & 15u;
  if (misalign % sizeof(T) != 0) return -1;
#pragma unroll
  for (int s = 0; s < kMaxSources; ++s) {  // constant indices keep `a` in registers
    if (s < a.num_srcs && (a.srcs[s] & 15u) != misalign) return -1;
  }
  const long long head = static_cast<long long>(((16u - misalign) & 15u) / sizeof(T));
  return head < a.numel ? head : a.numel;
}

// Grid-stride loop: thread `first` of `stride` threads; scalar head, 16-byte body, scalar tail.
template <typename T, typename Op>
RC_HOST_DEVICE void reduce_range(const ReduceArgs& a, long long first, long long stride) {
  const int kVec = 16 / sizeof(T);
  const long long head = aligned_head<T>(a);
  const long long num_packs = head < 0 ? 0 : (a.numel - head) / kVec;
  const long long tail = head < 0 ? 0 : head + num_packs * kVec;
  for (long long i = first; i < head; i += stride) reduce_at<T, 1, Op>(a, i);
  for (long long p = first; p < num_packs; p += stride) reduce_at<T, kVec, Op>(a, head + p * kVec);
  for (long long i = tail + first; i < a.numel; i += stride) reduce_at<T, 1, Op>(a, i);
}

template <typename T>
RC_HOST_DEVICE void reduce_typed(const ReduceArgs& a, int op, long long first, long long stride) {
  switch (op) {
    case kSum: case kAvg: return reduce_range<T, Sum>(a, first, stride);
    case kProduct: return reduce_range<T, Product>(a, first, stride);
    case kMin: return reduce_range<T, Min>(a, first, stride);
    case kMax: return reduce_range<T, Max>(a, first, stride);
  }
}

RC_HOST_DEVICE void reduce_dispatch(const ReduceArgs& a, int dtype, int op, long long first, long long stride) {
  if (a.num_srcs < 1 || a.num_srcs > kMaxSources) return;  // the launchers reject it first
  switch (dtype) {
    case kFloat32: return reduce_typed<float>(a, op, first, stride);
    case kFloat64: return reduce_typed<double>(a, op, first, stride);
    case kBFloat16: return reduce_typed<BFloat16>(a, op, first, stride);
    case kFloat16: return reduce_typed<Half>(a, op, first, stride);
    case kInt32: return reduce_typed<int>(a, op, first, stride);
    case kInt64: return reduce_typed<long long>(a, op, first, stride);
  }
}

template <typename D, typename S, int N>
RC_HOST_DEVICE void cast_at(Ptr dst, Ptr src, long long offset) {
  const Pack<S, N> in = *reinterpret_cast<const Pack<S, N>*>(src + offset * sizeof(S));
  Pack<D, N> out;
#pragma unroll
  for (int k = 0; k < N; ++k) store(out.e[k], to_acc(in.e[k]));
  *reinterpret_cast<Pack<D, N>*>(dst + offset * sizeof(D)) = out;
}

// Four elements at a time (16 bytes of float32) when both pointers allow it.
template <typename D, typename S>
RC_HOST_DEVICE void cast_range(Ptr dst, Ptr src, long long numel, long long first, long long stride) {
  const bool vector = dst % (4 * sizeof(D)) == 0 && src % (4 * sizeof(S)) == 0;
  const long long num_packs = vector ? numel / 4 : 0;
  for (long long p = first; p < num_packs; p += stride) cast_at<D, S, 4>(dst, src, p * 4);
  for (long long i = num_packs * 4 + first; i < numel; i += stride) cast_at<D, S, 1>(dst, src, i);
}

RC_HOST_DEVICE bool cast_supported(int dst_dtype, int src_dtype) {
  const bool dst16 = dst_dtype == kBFloat16 || dst_dtype == kFloat16;
  const bool src16 = src_dtype == kBFloat16 || src_dtype == kFloat16;
  return (dst_dtype == kFloat32 && src16) || (dst16 && src_dtype == kFloat32);
}

RC_HOST_DEVICE void cast_dispatch(Ptr dst, int dst_dtype, Ptr src, int src_dtype, long long numel, long long first,
                                  long long stride) {
  if (!cast_supported(dst_dtype, src_dtype)) return;  // the launchers reject it first
  if (dst_dtype == kBFloat16) return cast_range<BFloat16, float>(dst, src, numel, first, stride);
  if (dst_dtype == kFloat16) return cast_range<Half, float>(dst, src, numel, first, stride);
  if (src_dtype == kBFloat16) return cast_range<float, BFloat16>(dst, src, numel, first, stride);
  return cast_range<float, Half>(dst, src, numel, first, stride);
}

}  // namespace ringcomm_cuda

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)

// Kernels take plain scalars (pointers as unsigned long long), so any launcher,
// CuPy included, can pass them; unused source slots may hold anything.
extern "C" __global__ void ringcomm_reduce(unsigned long long dst, unsigned long long s0, unsigned long long s1,
                                           unsigned long long s2, unsigned long long s3, unsigned long long s4,
                                           unsigned long long s5, unsigned long long s6, unsigned long long s7,
                                           int num_srcs, long long numel, int dtype, int op, long long divisor) {
  const ringcomm_cuda::ReduceArgs args = {dst, {s0, s1, s2, s3, s4, s5, s6, s7}, num_srcs, numel,
                                          op == ringcomm_cuda::kAvg, divisor};
  ringcomm_cuda::reduce_dispatch(args, dtype, op, blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x,
                                 static_cast<long long>(gridDim.x) * blockDim.x);
}

extern "C" __global__ void ringcomm_cast(unsigned long long dst, int dst_dtype, unsigned long long src, int src_dtype,
                                         long long numel) {
  ringcomm_cuda::cast_dispatch(dst, dst_dtype, src, src_dtype, numel,
                               blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x,
                               static_cast<long long>(gridDim.x) * blockDim.x);
}

#endif

#if defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#include <cuda_runtime.h>

namespace ringcomm_cuda {
const int kThreads = 256;  // launch shape, as in ringcomm/kernels/cuda.py
const int kMaxBlocks = 4096;

inline unsigned int num_blocks(long long numel, int elements_per_thread) {
  const long long per_block = static_cast<long long>(kThreads) * elements_per_thread;
  const long long blocks = (numel + per_block - 1) / per_block;
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}
}  // namespace ringcomm_cuda

// Host launchers: queue the kernel on `stream` (a cudaStream_t as an integer;
// 0 is the legacy default stream) and return a cudaError_t as int. Bad
// arguments return cudaErrorInvalidValue without touching the device.
extern "C" int ringcomm_cuda_reduce_n(unsigned long long dst, const unsigned long long* srcs, int num_srcs,
                                      long long numel, int dtype, int op, long long divisor,
                                      unsigned long long stream) {
  using namespace ringcomm_cuda;
  if (srcs == nullptr || num_srcs < 1 || num_srcs > kMaxSources || numel < 0 || dtype < kFloat32 || dtype > kInt64 ||
      op < kSum || op > kMax || (op == kAvg && divisor < 1)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (numel == 0) return static_cast<int>(cudaSuccess);
  Ptr s[kMaxSources] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < num_srcs; ++i) s[i] = srcs[i];
  const bool wide = dtype == kFloat64 || dtype == kInt64, narrow = dtype == kBFloat16 || dtype == kFloat16;
  const int element_nbytes = wide ? 8 : narrow ? 2 : 4;
  ringcomm_reduce<<<num_blocks(numel, 16 / element_nbytes), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      dst, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], num_srcs, numel, dtype, op, divisor);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int ringcomm_cuda_cast(unsigned long long dst, int dst_dtype, unsigned long long src, int src_dtype,
                                  long long numel, unsigned long long stream) {
  using namespace ringcomm_cuda;
  if (!cast_supported(dst_dtype, src_dtype) || numel < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (numel == 0) return static_cast<int>(cudaSuccess);
  ringcomm_cast<<<num_blocks(numel, 4), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      dst, dst_dtype, src, src_dtype, numel);
  return static_cast<int>(cudaGetLastError());
}

#endif
