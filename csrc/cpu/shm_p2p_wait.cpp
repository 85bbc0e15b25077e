// Waits of the point-to-point channels, and how they fail: a dead, departed
// or silent peer, an abort, a corrupt channel. As the collectives' waits
// ([Note: shm waits] in shm.cpp): spin for spin_ns, then sleep on this rank's
// bell (futex, at most 10 ms at a time); every 20 ms and at the deadline, ask
// the comm whether the peer is still in the group. A failure names the op,
// this rank, the step (pieces moved of the message's), the tag, the size and
// the peer, and breaks the channels: every request they hold fails with it,
// and later calls are refused, since a late piece could pair with a new receive.
#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <sstream>

#include "shm_p2p.h"

namespace ringcomm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kLivenessCheck = std::chrono::milliseconds(20);
constexpr int64_t kMaxSleepNs = 10'000'000;

uint32_t* futex_word(std::atomic<uint32_t>& word) { return reinterpret_cast<uint32_t*>(&word); }

const char* op_name(const P2pRequest& request) {
  if (request.kind == P2pRequest::Kind::kSend) return "send";
  return request.any_source ? "recv_anysource" : "recv";
}

}  // namespace

void P2pChannels::wait(P2pRequest& request, double timeout_s) {
  if (request.state() == P2pRequest::Status::kPending) {
    const P2pCall call(comm_, op_name(request));
    wait_pending(request, timeout_s);
  }
  if (request.state() == P2pRequest::Status::kFailed) {
    if (request.caller_error) throw std::invalid_argument(request.error);
    throw std::runtime_error(request.error);
  }
}

void P2pChannels::wait_pending(P2pRequest& request, double timeout_s) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const auto spin_until = start + std::chrono::nanoseconds(spin_ns_);
  auto last_check = start;
  for (;;) {
    const uint32_t seen = bell(rank_)->rings.load(std::memory_order_seq_cst);
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (request.state() != P2pRequest::Status::kPending) return;
      check_usable(op_name(request));
      progress();
      flush_rings();
      if (request.state() != P2pRequest::Status::kPending) return;
      if (comm_.aborting())
        break_channels(where(request) + ": aborted (the group was aborted, or closed past its timeout, from "
                                        "another thread)");
    }
    const auto now = Clock::now();
    if (now < spin_until) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      continue;
    }
    if (now - last_check >= kLivenessCheck || now >= deadline) {
      last_check = now;
      const std::string gone = check_peers(request);
      if (!gone.empty() || now >= deadline) {
        const std::lock_guard<std::mutex> lock(mutex_);
        check_usable(op_name(request));
        progress();  // a last look: the peer may have posted just before it left
        flush_rings();
        if (request.state() != P2pRequest::Status::kPending) return;
        std::ostringstream why;
        if (gone.empty()) {
          why << "Timed out after " << timeout_s << " s";  // torch and gloo say "Timed out"
        } else {
          why << gone;
        }
        break_channels(where(request) + ": " + why.str());
      }
    }
    sleep_on_bell(seen, deadline);
  }
}

void P2pChannels::check_usable(const char* op) const {
  if (!broken_.empty())
    throw std::runtime_error(std::string(op) + ": rank " + std::to_string(rank_) +
                             ": point-to-point is unusable in this group after an earlier failure: " + broken_);
}

// "send: rank 0 at step 2/16 (tag 3, 4194304 bytes to rank 1), waiting for rank 1 to receive it"
std::string P2pChannels::where(const P2pRequest& request) const {
  const bool send = request.kind == P2pRequest::Kind::kSend;
  const bool rendezvous = send && request.ticket >= 0;
  const int64_t steps = rendezvous ? 1 : std::max<int64_t>(1, (request.nbytes + slot_nbytes_ - 1) / slot_nbytes_);
  const int64_t step = rendezvous ? 0 : std::min(steps, send ? request.pieces : request.moved / slot_nbytes_);
  const int source = request.source.load(std::memory_order_acquire);
  const bool unmatched = request.any_source && source < 0;
  const std::string peer = unmatched ? "any rank" : "rank " + std::to_string(send ? request.peer : source >= 0 ? source : request.peer);
  std::ostringstream out;
  out << op_name(request) << ": rank " << rank_ << " at step " << step << "/" << steps << " (tag " << request.tag
      << ", " << request.nbytes << " bytes " << (send ? "to " : "from ") << peer << "), waiting for " << peer
      << (send ? " to receive it" : " to send");
  return out.str();
}

// How the peer of `request` left the group ("" while it is there); for a
// receive from any source, the first peer that left.
std::string P2pChannels::check_peers(const P2pRequest& request) const {
  if (!request.any_source || request.source.load(std::memory_order_acquire) >= 0)
    return request.peer == rank_ ? "" : comm_.peer_gone(request.peer);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    std::string gone = comm_.peer_gone(peer);
    if (!gone.empty()) return gone;
  }
  return "";
}

// Fails every request the channels hold with `message`, refuses later calls,
// and raises it. The caller holds mutex_.
void P2pChannels::break_channels(const std::string& message) {
  broken_ = message;
  auto fail = [&message](const Request& request) {
    if (request && request->state() == P2pRequest::Status::kPending) {
      request->error = message;
      request->status.store(static_cast<int>(P2pRequest::Status::kFailed), std::memory_order_release);
    }
  };
  for (Outgoing& out : out_) {
    for (const Request& send : out.queue) fail(send);
    for (const Request& send : out.reading) fail(send);
    out.queue.clear();
    out.reading.clear();
  }
  for (Incoming& in : in_) {
    fail(in.request);
    in.request.reset();
    in.sink = Sink::kNone;
  }
  for (const Request& recv : posted_) fail(recv);
  posted_.clear();
  unexpected_.clear();
  throw std::runtime_error(message);
}

void P2pChannels::corrupt(int peer, const std::string& what) {
  break_channels("p2p: rank " + std::to_string(rank_) + " read " + what + " in rank " + std::to_string(peer) +
                 "'s channel, which the protocol never writes: the shared segment is corrupt");
}

// Sleeps until this rank's bell rings past `seen`, 10 ms pass, or the deadline.
void P2pChannels::sleep_on_bell(uint32_t seen, Clock::time_point deadline) {
  Bell* mine = bell(rank_);
  mine->sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (mine->rings.load(std::memory_order_seq_cst) == seen) {
    const int64_t left = std::chrono::nanoseconds(deadline - Clock::now()).count();
    const timespec timeout{0, static_cast<long>(std::max<int64_t>(0, std::min(kMaxSleepNs, left)))};
    syscall(SYS_futex, futex_word(mine->rings), FUTEX_WAIT, seen, &timeout, nullptr, 0);
  }
  mine->sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void P2pChannels::ring(int rank) {
  Bell* theirs = bell(rank);
  theirs->rings.fetch_add(1, std::memory_order_seq_cst);
  if (theirs->sleepers.load(std::memory_order_seq_cst) != 0)
    syscall(SYS_futex, futex_word(theirs->rings), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void P2pChannels::wake() {
  for (int rank = 0; rank < world_size_; ++rank) ring(rank);
}

}  // namespace ringcomm
