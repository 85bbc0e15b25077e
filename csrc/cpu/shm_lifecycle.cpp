// How a shared-memory comm stops: close, abort, and what peers see of it.
//
// [Note: close and abort] A comm may be closed or aborted from any thread,
// also while another thread is inside one of its collectives (a watchdog, a
// signal handler, torch's destroy_process_group). Memory safety does not
// depend on timing: Python reaches the comm through a shared_ptr (the pybind11
// holder and the lean calls' capsule), and a running call holds its capsule,
// so the segment stays mapped until the last call returns. What close and
// abort decide is what the call in flight sees:
//   close(t)  the state becomes kClosing, so new calls are refused ("closed");
//             it waits up to t seconds for the call in flight (OpScope) to end
//             by itself, else aborts it; then the state is kClosed (kAborted).
//   abort()   the state becomes kAborted; the call in flight fails at its next
//             wait (within a spin slice or one 10 ms futex sleep; abort wakes
//             the sleepers) with a RuntimeError naming op, rank and step and
//             saying "aborted"; later calls are refused ("aborted").
// Then, with no call in flight, the segment is unmapped (else the destructor
// does it). Either way this rank writes its final state into its header, so a peer
// waiting on it fails within its liveness check (20 ms) naming this rank,
// instead of at its deadline. A collective that one rank aborts leaves its
// results undefined on every rank, as NCCL's ncclCommAbort does.
#include <chrono>
#include <thread>

#include "shm.h"
#include "shm_map.h"
#include "shm_p2p.h"

namespace ringcomm {
namespace {

using Clock = std::chrono::steady_clock;

// How long an aborted call may take to reach its next wait before the segment
// stays mapped for the comm's destructor to unmap.
constexpr auto kAbortGrace = std::chrono::seconds(1);

const char* left_as(int32_t state) {
  return state == static_cast<int32_t>(CommState::kAborted) ? "aborted" : "closed";
}

}  // namespace

bool ShmComm::close(double timeout_s) {
  const std::lock_guard<std::mutex> lock(lifecycle_mutex_);
  int32_t expected = static_cast<int32_t>(CommState::kOpen);
  state_.compare_exchange_strong(expected, static_cast<int32_t>(CommState::kClosing), std::memory_order_seq_cst);
  const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const bool drained = wait_idle(Clock::now() + timeout);
  const bool aborted = !drained || abort_requested_.load(std::memory_order_seq_cst);  // an abort() ended the call
  const bool closed = leave(aborted ? CommState::kAborted : CommState::kClosed);
  if (drained || wait_idle(Clock::now() + kAbortGrace)) unmap();
  return closed;
}

void ShmComm::abort() {
  // First, without the lock (a close() may hold it while it waits for the call
  // in flight): that call fails at its next wait (within one 10 ms futex sleep;
  // the wake-up needs the mapping, which only the lock protects), and the close
  // then ends too.
  abort_requested_.store(true, std::memory_order_seq_cst);
  const std::lock_guard<std::mutex> lock(lifecycle_mutex_);
  leave(CommState::kAborted);
  if (wait_idle(Clock::now() + kAbortGrace)) unmap();
}

// Whether no call (collective or point-to-point) is in flight by `deadline`.
bool ShmComm::wait_idle(Clock::time_point deadline) const {
  while (caller_.load(std::memory_order_seq_cst) != 0 || p2p_calls_.load(std::memory_order_seq_cst) != 0) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// Unmaps the segment; every later call is refused by OpScope before it touches it.
void ShmComm::unmap() {
  if (base_ == nullptr) return;
  unmap_segment(base_, mapped_nbytes_);
  base_ = nullptr;
}

// Records how this rank left (the first final state stays; the caller holds
// lifecycle_mutex_) and wakes every sleeper that should notice. The header is
// written before the state, so a peer that sees anything this rank's caller did
// after the call failed also sees that this rank left. Returns whether it left closed.
bool ShmComm::leave(CommState how) {
  const CommState now = state();
  if (now == CommState::kClosed || now == CommState::kAborted) return now == CommState::kClosed;
  header(rank_)->state.store(static_cast<int32_t>(how), std::memory_order_seq_cst);
  state_.store(static_cast<int32_t>(how), std::memory_order_seq_cst);
  wake_all();
  p2p_->wake();
  return how == CommState::kClosed;
}

// As OpScope, but counting: point-to-point calls may overlap each other and a
// collective. Sequentially consistent against close()'s store of the state.
void ShmComm::enter_p2p(const char* op) {
  p2p_calls_.fetch_add(1, std::memory_order_seq_cst);
  const int32_t now = state_.load(std::memory_order_seq_cst);
  if (now == static_cast<int32_t>(CommState::kOpen)) return;
  p2p_calls_.fetch_sub(1, std::memory_order_seq_cst);
  throw std::runtime_error(std::string(op) + ": rank " + std::to_string(rank_) + ": the group is " + left_as(now));
}

bool ShmComm::aborting() const {
  return state_.load(std::memory_order_acquire) == static_cast<int32_t>(CommState::kAborted) ||
         abort_requested_.load(std::memory_order_acquire);
}

// A peer's header is untrusted: its state only compared, its pid judged as in wait_for.
std::string ShmComm::peer_gone(int peer) const {
  if (peer_exited(peer))
    return "rank " + std::to_string(peer) + " (pid " + std::to_string(header(peer)->pid) + ") has exited";
  const int32_t theirs = header(peer)->state.load(std::memory_order_acquire);
  if (theirs == static_cast<int32_t>(CommState::kClosed) || theirs == static_cast<int32_t>(CommState::kAborted))
    return "rank " + std::to_string(peer) + " " + left_as(theirs) + " the group";
  return "";
}

void ShmComm::check_aborted(const StepInfo& step, uint64_t round) {
  if (state_.load(std::memory_order_acquire) != static_cast<int32_t>(CommState::kAborted) &&
      !abort_requested_.load(std::memory_order_acquire))
    return;
  fail(std::string(step.op) + ": rank " + std::to_string(rank_) + " at step " + std::to_string(step.step) + "/" +
       std::to_string(step.num_steps) + " (round " + std::to_string(round) +
       "): aborted (the group was aborted, or closed past its timeout, from another thread)");
}

// A peer's header is not trusted (see [Note: shm trust]): any value but the two
// final states is ignored. `aborted_only`: a peer that closed has finished the
// calls it made (close waits for them), so only an abort can spoil this one.
void ShmComm::check_peer_left(int peer, const std::string& where, bool aborted_only) {
  const int32_t theirs = header(peer)->state.load(std::memory_order_acquire);
  if ((theirs == static_cast<int32_t>(CommState::kClosed) && !aborted_only) ||
      theirs == static_cast<int32_t>(CommState::kAborted))
    fail(where + ": rank " + std::to_string(peer) + " " + left_as(theirs) + " the group");
}

std::string ShmComm::peer_aborted() {
  // try_lock: a close or abort in progress (which may unmap) answers "" this time.
  const std::unique_lock<std::mutex> lock(lifecycle_mutex_, std::try_to_lock);
  if (!lock.owns_lock() || base_ == nullptr) return "";
  for (int peer = 0; peer < world_size_; ++peer) {
    const int32_t theirs = header(peer)->state.load(std::memory_order_acquire);  // untrusted: compared only
    if (peer != rank_ && theirs == static_cast<int32_t>(CommState::kAborted))
      return "rank " + std::to_string(peer) + " aborted the group";
  }
  return "";
}

std::unique_lock<std::mutex> ShmComm::lock_windows() {
  if (num_windows_.load(std::memory_order_acquire) == 0) return {};
  return std::unique_lock<std::mutex>(windows_mutex_);
}

}  // namespace ringcomm
