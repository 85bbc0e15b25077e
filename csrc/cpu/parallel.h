// Splitting a CPU kernel (quantization, Adam) over threads: OpenMP, whose
// runtime is the one torch loaded (libgomp.so.1, found by its soname), so the
// kernels run on torch's threads, awake after its ops, instead of competing
// with them for the cores; DeepSpeed's CPU Adam does the same.
#pragma once

#include <functional>

namespace ringcomm {

// Parts per thread that the kernels cut their work into: a thread that starts
// late leaves its unclaimed parts to the others.
constexpr int kPartsPerThread = 4;

// Runs fn(0), ..., fn(num_parts - 1) on up to num_threads threads, the caller
// among them, and returns when all have returned. Parts are claimed in order by
// whichever thread is free, so more parts than threads even out a thread that
// starts late. In a process forked after this library was loaded every part
// runs on the caller: GNU OpenMP's threads do not survive a fork, and the
// child's first parallel region would wait for them forever. fn must not throw.
void parallel_run(int num_threads, int num_parts, const std::function<void(int)>& fn);

}  // namespace ringcomm
