// The kernels' worker threads (pool.h). Each worker waits on its own ticket: a
// call hands part t to worker t by storing a new ticket, after writing the job,
// and waits for the count of unfinished parts to reach zero, so the next call's
// job is written only after every worker of this one is done with it. Workers
// are detached and the pool is never freed: a worker may still be asleep in it
// when the process exits. A forked child (a rank started by fork) gets a new,
// empty pool; the parent's workers do not exist there.
#include "pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RINGCOMM_PAUSE() _mm_pause()
#else
#define RINGCOMM_PAUSE() std::this_thread::yield()
#endif

namespace ringcomm {
namespace {

// How long a worker spins for its next part before it sleeps: long enough to
// span the Python between two kernel calls, short beside a step.
constexpr auto kSpin = std::chrono::microseconds(200);

struct Worker {
  std::atomic<uint64_t> ticket{0};
};

class Pool {
 public:
  // Runs the parts, or returns false at once when another call holds the pool.
  bool try_run(int num_parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    while (static_cast<int>(workers_.size()) < num_parts - 1 && start_worker()) {
    }
    const int on_workers = std::min(num_parts - 1, static_cast<int>(workers_.size()));
    job_ = &fn;
    pending_.store(on_workers, std::memory_order_relaxed);
    ++generation_;
    for (int t = 1; t <= on_workers; ++t) workers_[t - 1].ticket.store(generation_, std::memory_order_release);
    { std::lock_guard<std::mutex> lock(sleep_); }  // a worker between its check and its wait has reached the wait
    wake_.notify_all();
    fn(0);
    for (int part = on_workers + 1; part < num_parts; ++part) fn(part);  // parts no worker could be started for
    while (pending_.load(std::memory_order_acquire) != 0) RINGCOMM_PAUSE();
    return true;
  }

 private:
  // False when the system refuses another thread.
  bool start_worker() {
    const int part = static_cast<int>(workers_.size()) + 1;
    Worker& self = workers_.emplace_back();
    try {
      std::thread([this, part, &self] { work(part, self); }).detach();
    } catch (const std::system_error&) {
      workers_.pop_back();
      return false;
    }
    return true;
  }

  [[noreturn]] void work(int part, Worker& self) {
    for (uint64_t seen = 0;; ) {
      seen = next_ticket(self, seen);
      (*job_)(part);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  uint64_t next_ticket(Worker& self, uint64_t seen) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    do {
      for (int i = 0; i < 64; ++i) {
        const uint64_t ticket = self.ticket.load(std::memory_order_acquire);
        if (ticket != seen) return ticket;
        RINGCOMM_PAUSE();
      }
    } while (std::chrono::steady_clock::now() < deadline);
    std::unique_lock<std::mutex> lock(sleep_);
    wake_.wait(lock, [&] { return self.ticket.load(std::memory_order_acquire) != seen; });
    return self.ticket.load(std::memory_order_acquire);
  }

  std::mutex busy_;  // held by the call running on the pool
  std::deque<Worker> workers_;  // a deque: a worker's address stays put as the pool grows
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<int> pending_{0};
  uint64_t generation_ = 0;
  std::mutex sleep_;
  std::condition_variable wake_;
};

std::mutex pool_creation;
Pool* pool = nullptr;

Pool& the_pool() {
  static const bool registered = [] {
    // A fork while another thread creates the pool must not leave its lock held in the child.
    pthread_atfork([] { pool_creation.lock(); }, [] { pool_creation.unlock(); },
                   [] {
                     pool_creation.unlock();
                     pool = nullptr;  // the parent's, workerless here: left, not freed
                   });
    return true;
  }();
  static_cast<void>(registered);
  std::lock_guard<std::mutex> lock(pool_creation);
  if (pool == nullptr) pool = new Pool();
  return *pool;
}

}  // namespace

void parallel_run(int num_parts, const std::function<void(int)>& fn) {
  if (num_parts > 1 && the_pool().try_run(num_parts, fn)) return;
  for (int part = 0; part < num_parts; ++part) fn(part);
}

}  // namespace ringcomm
