// Byte copies of the collectives (copy.h).
#include <algorithm>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "copy.h"
#include "kernels/kernels.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

// Streaming (non-temporal) stores of the widest vector this build has: AVX-512 writes a whole cache line per
// store (the step's two snapshot copies in adam.cpp took 63 ms per rank and step instead of the 256-bit stores'
// 74 ms: 97.7M parameters, 2 ranks, a Xeon with AVX-512).
#if defined(__AVX512F__)
#define RINGCOMM_STREAMS 1
using Vector = __m512i;
inline Vector load_vector(const char* p) { return _mm512_loadu_si512(p); }
inline void stream_vector(char* p, Vector v) { _mm512_stream_si512(reinterpret_cast<Vector*>(p), v); }
#elif defined(__AVX2__)
#define RINGCOMM_STREAMS 1
using Vector = __m256i;
inline Vector load_vector(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const Vector*>(p)); }
inline void stream_vector(char* p, Vector v) { _mm256_stream_si256(reinterpret_cast<Vector*>(p), v); }
#endif

void stream_bytes(void* dst, const void* src, int64_t nbytes) {
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
#if defined(RINGCOMM_STREAMS)
  constexpr int64_t kWidth = sizeof(Vector);
  const int64_t head = std::min<int64_t>(nbytes, (kWidth - reinterpret_cast<uintptr_t>(out) % kWidth) % kWidth);
  std::memcpy(out, in, head);
  int64_t i = head;
  for (; i + 4 * kWidth <= nbytes; i += 4 * kWidth) {
    const Vector a = load_vector(in + i), b = load_vector(in + i + kWidth);
    const Vector c = load_vector(in + i + 2 * kWidth), d = load_vector(in + i + 3 * kWidth);
    stream_vector(out + i, a);
    stream_vector(out + i + kWidth, b);
    stream_vector(out + i + 2 * kWidth, c);
    stream_vector(out + i + 3 * kWidth, d);
  }
  std::memcpy(out + i, in + i, nbytes - i);
#else
  std::memcpy(out, in, nbytes);
#endif
}

void fence_streams() {
#if defined(RINGCOMM_STREAMS)
  _mm_sfence();  // streaming stores are weakly ordered: finish them before any flag is published
#endif
}

void copy_bytes(void* dst, const void* src, int64_t nbytes) {
  if (nbytes < kStreamMinBytes) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  stream_bytes(dst, src, nbytes);
  fence_streams();
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
