// Segment lifecycle, rounds and waits of the shared-memory transport.
//
// [Note: shm rounds] Every collective is a sequence of rounds, numbered the
// same on every rank. In round R each rank writes its slot R % num_slots,
// publishes posted = R, waits until every peer has posted R, reads the peer
// slots it needs and publishes consumed = R. Before writing slot R % num_slots
// again (round R + num_slots) a rank waits until every peer consumed R. Each
// flag sits on its own cache line; stores release, loads acquire. The first
// round of an op also carries an OpDesc, so a rank that called a different op
// or size is reported on every rank, and all ranks stay in step afterwards.
//
// [Note: shm waits] A rank waiting for a flag spins for spin_ns (the peer runs
// on another core and is about to post), then sleeps on the flag with futex
// (the peer is descheduled: ranks share cores with each other or with other
// work; sleeping hands this core over instead of burning the peer's chance to
// run). A waiter counts itself in the peer's `sleepers` before it re-reads the
// flag and sleeps, and a rank that stores a flag wakes the flag's futex when
// `sleepers` is non-zero; both sides use sequentially consistent operations,
// so either the waiter sees the new value or the poster sees the sleeper. The
// futex word is the low half of the 64-bit flag (x86 and arm64 are little-
// endian), which changes with every round. Sleeps last at most 10 ms, so a dead
// peer or the deadline is noticed while asleep.

#include "shm.h"

#include "shm_map.h"
#include "shm_p2p.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <random>

#include <cstdio>
#include <sstream>

namespace ringcomm {
namespace {

constexpr uint64_t kMagic = 0x72696e67636f6d32ull;  // "ringcom2"
constexpr int64_t kPage = 4096;

struct SegmentHeader {
  uint64_t magic;
  int32_t world_size;
  int32_t num_slots;
  int64_t slot_nbytes;
  int64_t p2p_slot_nbytes;
  int32_t p2p_num_slots;
};

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

int64_t headers_nbytes(int world_size) {
  return round_up(static_cast<int64_t>(sizeof(SegmentHeader)) + 64 + world_size * static_cast<int64_t>(sizeof(RankHeader)), kPage);
}

int64_t slot_stride(const ShmConfig& config) { return round_up(static_cast<int64_t>(sizeof(OpDesc)) + config.slot_nbytes, 64); }

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "futex word = low half of a flag: little-endian only");

uint32_t* futex_word(const Flag& flag) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(&flag.value));
}

// The kernel's id of the calling thread, asked once per thread (a system call).
int64_t thread_id() {
  thread_local const int64_t id = static_cast<int64_t>(syscall(SYS_gettid));
  return id;
}

}  // namespace

OpScope::OpScope(std::atomic<int64_t>& caller, const std::atomic<int32_t>& state, const char* op, int rank)
    : caller_(caller) {
  const int64_t me = thread_id();
  int64_t inside = 0;
  // Sequentially consistent, as close()'s store of the state and load of the
  // caller: either close() sees this call, or this call sees the new state.
  if (caller.compare_exchange_strong(inside, me, std::memory_order_seq_cst)) {
    const auto now = static_cast<CommState>(state.load(std::memory_order_seq_cst));
    if (now == CommState::kOpen) return;
    caller.store(0, std::memory_order_release);
    throw std::runtime_error(std::string(op) + ": rank " + std::to_string(rank) + ": the group is " +
                             (now == CommState::kAborted ? "aborted" : "closed"));
  }
  if (inside == me) {  // admitted by this thread's enclosing scope
    owner_ = false;
    return;
  }
  throw std::runtime_error(std::string(op) + ": rank " + std::to_string(rank) + ": called from thread id " +
                           std::to_string(me) + " while thread id " + std::to_string(inside) +
                           " is inside a collective of this group; a group's collectives must come from one "
                           "thread at a time, in the same order on every rank (use one group per thread)");
}

// Headers, then the collectives' slots (world_size * num_slots), then the
// point-to-point channels (shm_p2p.h).
static int64_t collective_nbytes(int world_size, const ShmConfig& config) {
  return headers_nbytes(world_size) + world_size * config.num_slots * slot_stride(config);
}

int64_t ShmComm::segment_nbytes(int world_size, const ShmConfig& config) {
  return collective_nbytes(world_size, config) + P2pChannels::region_nbytes(world_size, config);
}

ShmComm::ShmComm(const std::string& name, int rank, int world_size, ShmConfig config, bool create)
    : name_(name),
      rank_(rank),
      world_size_(world_size),
      config_(config),
      slot_stride_(slot_stride(config)),
      descs_(world_size > 0 ? world_size : 0),
      peer_inputs_(world_size > 0 ? world_size : 0),
      peer_outputs_(world_size > 0 ? world_size : 0),
      srcs_(world_size > 0 ? world_size : 0),
      seen_consumed_(world_size > 0 ? world_size : 0, 0) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("shm: rank " + std::to_string(rank) + " outside world_size " + std::to_string(world_size));
  if (config.num_slots < 2) throw std::invalid_argument("shm: num_slots=" + std::to_string(config.num_slots) + " < 2");
  if (config.slot_nbytes < 64 * world_size || config.slot_nbytes % 64 != 0)
    throw std::invalid_argument("shm: slot_nbytes=" + std::to_string(config.slot_nbytes) +
                                " must be a multiple of 64 and at least 64 * world_size (" + std::to_string(64 * world_size) + ")");
  if (config.p2p_num_slots < 2 || config.p2p_slot_nbytes < 64 || config.p2p_slot_nbytes % 64 != 0)
    throw std::invalid_argument("shm: p2p_num_slots=" + std::to_string(config.p2p_num_slots) + " must be >= 2 and "
                                "p2p_slot_nbytes=" + std::to_string(config.p2p_slot_nbytes) +
                                " a multiple of 64, at least 64");
  const int64_t total = segment_nbytes(world_size, config);
  base_ = map_segment(name, total, create);
  mapped_nbytes_ = total;
  auto* segment = reinterpret_cast<SegmentHeader*>(base_);
  if (create) {
    segment->world_size = world_size;
    segment->num_slots = config.num_slots;
    segment->slot_nbytes = config.slot_nbytes;
    segment->p2p_slot_nbytes = config.p2p_slot_nbytes;
    segment->p2p_num_slots = config.p2p_num_slots;
    std::atomic_thread_fence(std::memory_order_release);
    segment->magic = kMagic;
  } else if (segment->magic != kMagic || segment->world_size != world_size || segment->num_slots != config.num_slots ||
             segment->slot_nbytes != config.slot_nbytes || segment->p2p_slot_nbytes != config.p2p_slot_nbytes ||
             segment->p2p_num_slots != config.p2p_num_slots) {
    unmap_segment(base_, mapped_nbytes_);
    base_ = nullptr;
    throw std::runtime_error("shm: segment '" + name + "' was not made by this group (magic or config differs)");
  }
  pid_ns_ = own_pid_namespace();
  cma_token_ = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32) | 1u;
  RankHeader* mine = header(rank_);
  mine->pid_ns = pid_ns_;
  mine->pid = getpid();
  mine->cma_token = cma_token_;
  mine->cma_token_addr = reinterpret_cast<uintptr_t>(&cma_token_);
  p2p_ = std::make_unique<P2pChannels>(*this, base_ + collective_nbytes(world_size, config), config);
}

ShmComm::~ShmComm() { unmap(); }

void ShmComm::unlink(const std::string& name) { unlink_segment(name); }

RankHeader* ShmComm::header(int rank) const {
  return reinterpret_cast<RankHeader*>(base_ + round_up(sizeof(SegmentHeader), 64)) + rank;
}

OpDesc* ShmComm::slot_desc(int rank, uint64_t round) const {
  const int64_t index = static_cast<int64_t>(rank) * config_.num_slots + static_cast<int64_t>(round % config_.num_slots);
  return reinterpret_cast<OpDesc*>(base_ + headers_nbytes(world_size_) + index * slot_stride_);
}

char* ShmComm::slot_data(int rank, uint64_t round) const {
  return reinterpret_cast<char*>(slot_desc(rank, round)) + sizeof(OpDesc);
}

void ShmComm::check_usable(const char* op) const {
  if (!broken_.empty())
    throw std::runtime_error(std::string(op) + ": rank " + std::to_string(rank_) +
                             ": the group is unusable after an earlier failure: " + broken_);
}

StepInfo ShmComm::begin_op(const char* op, int64_t num_steps, double timeout_s) const {
  check_usable(op);
  const auto timeout = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  return StepInfo{op, 0, num_steps, std::chrono::steady_clock::now() + timeout, timeout_s};
}

void ShmComm::fail(const std::string& message) {
  broken_ = message;
  throw std::runtime_error(message);
}

// Waits until `peer`'s flag reaches `target` (see [Note: shm waits]); returns
// the value it read. See [Note: shm trust] in shm_trust.cpp for `limit`.
uint64_t ShmComm::wait_for(int peer, FlagKind kind, uint64_t target, const StepInfo& step, const char* what) {
  const Flag& flag = kind == FlagKind::kPosted ? header(peer)->posted : header(peer)->consumed;
  const uint64_t limit = kind == FlagKind::kPosted ? seq_ + config_.num_slots : seq_;
  uint64_t value = flag.value.load(std::memory_order_acquire);
  if (value >= target) {
    if (value > limit) fail_flag(peer, kind, value, limit, step);
    return value;
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto spin_until = start + std::chrono::nanoseconds(config_.spin_ns);
  auto last_alive_check = start;
  for (int64_t spin = 1;; ++spin) {
    value = flag.value.load(std::memory_order_acquire);
    if (value >= target) {
      if (value > limit) fail_flag(peer, kind, value, limit, step);
      return value;
    }
    if (spin % 64 != 0) {
      cpu_relax();
      continue;
    }
    check_aborted(step, target);
    const auto now = Clock::now();
    if (now < spin_until) continue;
    sleep_on(peer, flag, value, step);
    if (now - last_alive_check < std::chrono::milliseconds(20) && now < step.deadline) continue;
    last_alive_check = now;
    std::ostringstream where;
    where << step.op << ": rank " << rank_ << " at step " << step.step << "/" << step.num_steps << " (round " << target
          << ") waiting for rank " << peer << " to " << what;
    if (peer_exited(peer)) fail(where.str() + ": " + exited_peers(peer));
    check_peer_left(peer, where.str());
    if (now >= step.deadline) {
      std::ostringstream message;
      message << where.str() << ": Timed out after " << step.timeout_s << " s";  // torch and gloo say "Timed out"
      fail(message.str());
    }
  }
}

// Sleeps until `flag` (of `peer`) moves past `seen`, a peer wakes it, or 10 ms pass.
void ShmComm::sleep_on(int peer, const Flag& flag, uint64_t seen, const StepInfo& step) {
  std::atomic<uint32_t>& sleepers = header(peer)->sleepers;
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (flag.value.load(std::memory_order_seq_cst) == seen) {
    const auto left = step.deadline - std::chrono::steady_clock::now();
    const int64_t ns = std::max<int64_t>(0, std::min<int64_t>(10'000'000, std::chrono::nanoseconds(left).count()));
    const timespec timeout{0, static_cast<long>(ns)};
    syscall(SYS_futex, futex_word(flag), FUTEX_WAIT, static_cast<uint32_t>(seen), &timeout, nullptr, 0);
  }
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

// Stores a flag of this rank and wakes the peers asleep on it.
void ShmComm::publish(Flag& flag, uint64_t value) {
  flag.value.store(value, std::memory_order_seq_cst);
  if (header(rank_)->sleepers.load(std::memory_order_seq_cst) != 0)
    syscall(SYS_futex, futex_word(flag), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Wakes every futex sleeper on this rank's flags and, in this process, on the
// peers' flags (spurious wake-ups elsewhere only cost a re-check).
void ShmComm::wake_all() {
  for (int peer = 0; peer < world_size_; ++peer) {
    RankHeader* theirs = header(peer);
    syscall(SYS_futex, futex_word(theirs->posted), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    syscall(SYS_futex, futex_word(theirs->consumed), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

char* ShmComm::acquire_slot(const StepInfo& step) {
  const uint64_t round = seq_ + 1;
  if (round > static_cast<uint64_t>(config_.num_slots)) {
    const uint64_t target = round - config_.num_slots;
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer != rank_ && seen_consumed_[peer] < target)  // else no need to touch the peer's cache line
        seen_consumed_[peer] = wait_for(peer, FlagKind::kConsumed, target, step, "free a staging slot");
    }
  }
  return slot_data(rank_, round);
}

void ShmComm::post(const OpDesc* desc) {
  const uint64_t round = seq_ + 1;
  if (desc != nullptr) *slot_desc(rank_, round) = *desc;
  seq_ = round;
  publish(header(rank_)->posted, round);
}

void ShmComm::wait_posted(const StepInfo& step) {
  for (int peer = 0; peer < world_size_; ++peer)
    if (peer != rank_) wait_for(peer, FlagKind::kPosted, seq_, step, "post its data");
}

void ShmComm::release() { publish(header(rank_)->consumed, seq_); }

}  // namespace ringcomm
