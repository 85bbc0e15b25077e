// OpenMP under the kernels (parallel.h).
#include "parallel.h"

#include <pthread.h>

#include <atomic>

namespace ringcomm {
namespace {

std::atomic<bool> forked{false};

// Registered when the library is loaded, so any child forked after that is marked.
const bool registered = [] {
  pthread_atfork(nullptr, nullptr, [] { forked.store(true, std::memory_order_relaxed); });
  return true;
}();

}  // namespace

void parallel_run(int num_threads, int num_parts, const std::function<void(int)>& fn) {
  static_cast<void>(registered);
  if (num_threads <= 1 || num_parts <= 1 || forked.load(std::memory_order_relaxed)) {
    for (int part = 0; part < num_parts; ++part) fn(part);
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
  for (int part = 0; part < num_parts; ++part) fn(part);
}

}  // namespace ringcomm
