// Persistent worker threads for the CPU kernels that split a call over threads
// (quantization, Adam). Starting a thread per call costs ~35 us here, and the
// new thread then runs on a cold core: a 4 MiB quantize took longer on two
// started threads than on one. Workers kept here spin for a short while after
// each part, so calls in a row find them running, and then sleep.
#pragma once

#include <functional>

namespace ringcomm {

// Runs fn(0), ..., fn(num_parts - 1) and returns when all have returned: fn(0)
// on the calling thread, the others on workers. While another thread's call
// holds the workers (or from inside fn), every part runs on the caller, in
// order. fn must not throw.
void parallel_run(int num_parts, const std::function<void(int)>& fn);

}  // namespace ringcomm
