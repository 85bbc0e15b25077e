// Word sums ([Note: word sums] in checksum.h).
#include <cstring>

#include "kernels/kernels.h"

namespace ringcomm {
namespace RINGCOMM_CPU_CAPABILITY {

WordSum word_sum_of(const uint32_t* words, int64_t count, int64_t first) {
  uint32_t plain = 0, weighted = 0;
  uint32_t weight = static_cast<uint32_t>(2 * first + 1);  // mod 2^32, as every weight
#pragma GCC ivdep
  for (int64_t i = 0; i < count; ++i) {
    plain += words[i];
    weighted += words[i] * weight;
    weight += 2;
  }
  return WordSum{plain, weighted};
}

uint64_t word_sum_bytes(const void* data, int64_t nbytes, int64_t first) {
  const int64_t whole = nbytes / 4;
  WordSum sum = word_sum_of(static_cast<const uint32_t*>(data), whole, first);
  if (nbytes % 4 != 0) {
    uint32_t last = 0;  // the bytes left, zero-padded, little-endian
    std::memcpy(&last, static_cast<const char*>(data) + 4 * whole, nbytes % 4);
    sum.add(word_sum_of(&last, 1, first + whole));
  }
  return sum.value();
}

}  // namespace RINGCOMM_CPU_CAPABILITY
}  // namespace ringcomm
