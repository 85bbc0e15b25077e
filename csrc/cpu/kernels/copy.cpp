// Byte copies of the collectives (copy.h).
#include <algorithm>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "copy.h"
#include "kernels/kernels.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

void stream_bytes(void* dst, const void* src, int64_t nbytes) {
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
#if defined(__AVX2__)
  const int64_t head = std::min<int64_t>(nbytes, (32 - reinterpret_cast<uintptr_t>(out) % 32) % 32);
  std::memcpy(out, in, head);
  int64_t i = head;
  for (; i + 128 <= nbytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i + 96), d);
  }
  std::memcpy(out + i, in + i, nbytes - i);
#else
  std::memcpy(out, in, nbytes);
#endif
}

void fence_streams() {
#if defined(__AVX2__)
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
