// Shared-memory transport for ranks on one host: one POSIX segment per group,
// a few staging slots per rank, sequence-numbered flags, a deadline on every
// wait. The collectives loop over segments here, in C++, with the GIL released.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "trace.h"

namespace ringcomm {

enum class OpKind : int32_t { kBarrier = 0, kAllReduce = 1, kReduceScatter = 2, kAllGather = 3, kBroadcast = 4,
                             kAllToAll = 5 };

// How peers reach a rank's buffers in one op: through staging slots, in
// windows they map (ringcomm.empty), or by cross-memory attach (CMA: the kernel
// copies from the rank's own memory, process_vm_readv, as Open MPI does).
enum class Access : int32_t { kStaged = 0, kWindows = 1, kCma = 2 };

// A caller's description of its call in its own units (CallKey.values() of
// ringcomm/transport/agreement.py, whose KEY_LEN is kCallKeyLen): compared across
// ranks with the rest of the OpDesc, never used otherwise. All 0: none.
constexpr int kCallKeyLen = 7;
struct CallKey {
  int64_t values[kCallKeyLen];
};

// What a rank is about to do; written into its slot with the op's first round
// so that every rank can check that all ranks called the same thing.
struct alignas(64) OpDesc {
  int32_t kind, dtype, redop, root;
  int64_t numel;
  int32_t access;                    // Access
  int64_t in_window, in_offset;      // kWindows: window id and byte offset of the input
  int64_t out_window, out_offset;    // ... and of the output
  uint64_t in_addr, out_addr;        // kCma: the buffers' addresses in the rank's own process
  CallKey key;
};

// Ranks that called different things (check_descs): a ValueError in Python,
// which ringcomm's shm transport words in the caller's units from last_calls().
class CallMismatch : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A collective's buffers, as addresses in this process: distinct types, so that
// swapping output and input does not compile. Every entry point takes
// (output, input), as torch's reduce_scatter_tensor / all_gather_into_tensor.
struct Output { uintptr_t address; };
struct Input { uintptr_t address; };

// Where rank r maps window `id` of every rank (see ShmWindow in shm_map.h).
struct WindowTable {
  int64_t id;
  std::vector<char*> bases;   // by rank
  std::vector<int64_t> nbytes;
};

struct alignas(64) Flag { std::atomic<uint64_t> value; };

// Where a comm is in its life (see [Note: close and abort] in shm_lifecycle.cpp).
// Also what a rank leaves in its header when it stops: peers waiting on it fail
// at once, naming it, instead of at their deadline.
enum class CommState : int32_t { kOpen = 0, kClosing = 1, kClosed = 2, kAborted = 3 };

struct RankHeader {
  Flag posted;    // last round whose data this rank has written into its slot
  Flag consumed;  // last round whose peer slots this rank has finished reading
  alignas(64) std::atomic<uint32_t> sleepers;  // peers asleep on this rank's flags (futex): wake them
  alignas(64) int64_t pid;
  uint64_t pid_ns;  // inode of the rank's /proc/self/ns/pid (0: unknown); its pid means something only there
  uint64_t cma_token, cma_token_addr;  // a random value and its address in the rank: peers read it to test CMA
  int32_t cma_ok;                      // this rank read every peer's token through CMA
  std::atomic<int32_t> state;          // CommState: kClosed or kAborted once this rank left the group
};

struct ShmConfig {
  int64_t slot_nbytes;         // staging bytes per slot (data part)
  int num_slots;               // slots per rank; rounds can run this far ahead
  int64_t oneshot_max_nbytes;  // all-reduce of at most this many bytes: one round
  int64_t spin_ns;             // busy-wait this long before sleeping on the flag (futex)
  int64_t cma_min_nbytes;         // all-gather / broadcast of plain buffers this big: single copy by CMA (-1: never)
  int64_t cma_reduce_min_nbytes;  // ... and all-reduce / reduce-scatter (their CMA path reads through pieces)
  int64_t p2p_slot_nbytes;        // point-to-point: staging bytes per slot of a channel (shm_p2p.h)
  int p2p_num_slots;              // ... slots per channel
  int64_t p2p_cma_min_nbytes;     // ... sends this big (with CMA on): the receiver reads the sender's buffer (-1: never)
};

// Where a wait is, for error messages: op, step within the op, deadline.
struct StepInfo {
  const char* op;
  int64_t step;
  int64_t num_steps;
  std::chrono::steady_clock::time_point deadline;
  double timeout_s;
};

// This process's pid namespace (inode of /proc/self/ns/pid; 0 where unknown).
uint64_t own_pid_namespace();

// Reads `nbytes` at `remote` in process `pid` into `local` by process_vm_readv
// (shm_cma.cpp); 0 or an errno.
int read_process(int64_t pid, void* local, const void* remote, int64_t nbytes);

class P2pChannels;  // shm_p2p.h

constexpr int64_t kDefaultCmaPieceBytes = 128 << 10;  // setup_cma: per peer, for reductions
constexpr int64_t kMinCmaPieceBytes = 4 << 10;

// One op in progress on a group, for the length of a public call: a second
// thread that enters meanwhile gets a RuntimeError naming the thread inside
// (its kernel thread id), as [Note: one caller thread] in ringcomm/comm/group.py asks,
// and a call on a closed or aborted comm gets one saying so. close() waits
// until no OpScope is left ([Note: close and abort] in shm_lifecycle.cpp).
// A scope inside another on the same thread is admitted by the outer one: the
// lean calls admit theirs before they record the call as started (module_lean.cpp),
// so a call the flight recorder shows started is one that close() waits for.
class OpScope {
 public:
  OpScope(std::atomic<int64_t>& caller, const std::atomic<int32_t>& state, const char* op, int rank);
  ~OpScope() {
    if (owner_) caller_.store(0, std::memory_order_release);
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  std::atomic<int64_t>& caller_;
  bool owner_ = true;  // false inside an enclosing scope of this thread
};

class ShmComm {
 public:
  ShmComm(const std::string& name, int rank, int world_size, ShmConfig config, bool create);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  static void unlink(const std::string& name);
  static int64_t segment_nbytes(int world_size, const ShmConfig& config);

  void all_reduce(Output output, Input input, int64_t numel, int dtype, int redop, double timeout_s);
  void reduce_scatter(Output output, Input input, int64_t chunk_numel, int dtype, int redop, double timeout_s);
  // `key`: the caller's description of the call, compared with the rest (CallKey).
  void all_gather(Output output, Input input, int64_t chunk_numel, int dtype, double timeout_s,
                  const CallKey& key = CallKey{});
  void broadcast(uintptr_t buffer, int64_t numel, int dtype, int root, double timeout_s);
  // Chunk p of input goes to rank p, chunk p of output comes from rank p
  // (torch's all_to_all_single with equal splits); always staged. output != input.
  void all_to_all(Output output, Input input, int64_t chunk_numel, int dtype, double timeout_s,
                  const CallKey& key = CallKey{});
  void barrier(double timeout_s);
  // Every rank's call as this rank read it in its last check of the calls, by
  // rank: (kind, dtype, redop, root, numel, key...). After a CallMismatch: what differed.
  std::vector<std::vector<int64_t>> last_calls() const;

  // [Note: close and abort] in shm_lifecycle.cpp. close() refuses new calls,
  // waits up to timeout_s for the call in flight, aborts it past that, and
  // returns whether it ended by itself; abort() makes it fail at once. Both are
  // safe from any thread, and unmap the segment once no call is in flight.
  bool close(double timeout_s);
  void abort();
  CommState state() const { return static_cast<CommState>(state_.load(std::memory_order_acquire)); }
  // Why this comm refuses work after a failure ("" while it is usable).
  const std::string& broken() const { return broken_; }
  // Whether a peer aborted the group: "rank N aborted the group", else "". For a
  // caller busy elsewhere (the hierarchical transport's cross-host step polls
  // it), so a local peer's failure stops this rank before its next local call.
  std::string peer_aborted();

  // Collective: tests whether every rank can read every other's memory by CMA
  // (same user and pid namespace, no seccomp or ptrace rule against it); all
  // ranks agree on the answer. Returns "" when it is on, else the reason.
  // Reductions read each peer's data through a buffer of `piece_nbytes` (a
  // multiple of 64, at least kMinCmaPieceBytes), sized so that the pieces stay
  // in the CPU's L2 with the output (ringcomm/transport/shm.py chooses it).
  std::string setup_cma(double timeout_s, int64_t piece_nbytes = kDefaultCmaPieceBytes);
  bool cma_enabled() const { return cma_enabled_; }

  // Point-to-point messages (shm_p2p.h). Their calls may come from any threads,
  // also while a collective runs; each counts itself in flight between
  // enter_p2p (refused once the comm is closing) and leave_p2p, and close()
  // waits for them as for a collective.
  P2pChannels& p2p() { return *p2p_; }
  void enter_p2p(const char* op);
  void leave_p2p() { p2p_calls_.fetch_sub(1, std::memory_order_seq_cst); }
  // What the channels ask about a peer: "" while it is in the group, else how
  // it left ("rank 1 (pid 42) has exited", "rank 1 closed the group").
  std::string peer_gone(int peer) const;
  bool aborting() const;
  // The checked pid of `peer` when CMA is on ([Note: CMA trust]), else 0.
  int64_t cma_pid(int peer) const { return cma_enabled_ ? peer_pids_[peer] : 0; }

  void register_window(int64_t id, const std::vector<uintptr_t>& bases, const std::vector<int64_t>& nbytes);
  void unregister_window(int64_t id);

  // Test-only (shm_debug.cpp): post the next round with `desc` unchecked, or
  // store `value` into this rank's header field "posted", "consumed" or "pid".
  void debug_post(const OpDesc& desc);
  void debug_store(const std::string& field, int64_t value);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  uint64_t rounds() const { return seq_; }
  // The flight recorder's ring of lean calls (trace.h).
  TraceRing& trace() { return trace_; }
  // Admits a call of this thread into `scope` (see OpScope), or throws as OpScope does.
  void admit(std::optional<OpScope>& scope, const char* op) { scope.emplace(caller_, state_, op, rank_); }

 private:
  // One round: acquire_slot() -> write my slot -> post() -> wait_posted() ->
  // read peer slots -> release().
  char* acquire_slot(const StepInfo& step);
  void post(const OpDesc* desc);
  void wait_posted(const StepInfo& step);
  void check_descs(const StepInfo& step, const OpDesc& mine);
  void check_desc_range(const StepInfo& step, int peer, const OpDesc& theirs);
  void release();
  char* slot_data(int rank, uint64_t round) const;
  OpDesc* slot_desc(int rank, uint64_t round) const;
  RankHeader* header(int rank) const;

  enum class FlagKind { kPosted, kConsumed };
  uint64_t wait_for(int peer, FlagKind kind, uint64_t target, const StepInfo& step, const char* what);
  [[noreturn]] void fail_flag(int peer, FlagKind kind, uint64_t value, uint64_t limit, const StepInfo& step);
  [[noreturn]] void fail(const std::string& message);
  bool peer_exited(int peer) const;
  // "rank P (pid N) has exited", then every other peer that has exited too: the
  // first to die may be another than the one a rank was reading or waiting for.
  std::string exited_peers(int peer) const;
  void check_peer_left(int peer, const std::string& where, bool aborted_only = false);
  void check_aborted(const StepInfo& step, uint64_t round);
  bool leave(CommState how);
  bool wait_idle(std::chrono::steady_clock::time_point deadline) const;
  void unmap();
  void wake_all();
  std::unique_lock<std::mutex> lock_windows();
  void sleep_on(int peer, const Flag& flag, uint64_t seen, const StepInfo& step);
  void publish(Flag& flag, uint64_t value);
  void check_usable(const char* op) const;
  void barrier_round(const char* op, double timeout_s);
  StepInfo begin_op(const char* op, int64_t num_steps, double timeout_s) const;

  // The algorithms take (in, out) as const char* / char*: a swap does not compile.
  void all_reduce_oneshot(const char* in, char* out, const OpDesc& desc, StepInfo& step);
  void all_reduce_twoshot(const char* in, char* out, const OpDesc& desc, StepInfo& step);

  // Single copy: peers read each other's buffers directly, in windows or by
  // CMA (shm_window.cpp, shm_cma.cpp).
  bool locate(const void* ptr, int64_t nbytes, int64_t* window, int64_t* offset) const;
  OpDesc describe(OpKind kind, int dtype, int redop, int root, int64_t numel, const void* in, int64_t in_nbytes,
                  const void* out, int64_t out_nbytes, const CallKey& key = CallKey{}) const;
  void resolve_peers(const StepInfo& step, const OpDesc& mine);
  void fetch(const StepInfo& step, int peer, char* dst, const char* src, int64_t nbytes);
  void reduce_peers(const StepInfo& step, char* dst, const char* const* srcs, int64_t numel, const OpDesc& desc);
  void cma_read(const StepInfo& step, int peer, char* dst, const char* src, int64_t nbytes);
  const char* window_span(const StepInfo& step, int peer, int64_t id, int64_t offset, int64_t nbytes, const char* what);
  void wait_consumed(const StepInfo& step);
  void all_reduce_windows(const char* in, char* out, const OpDesc& desc, StepInfo& step);
  void reduce_scatter_windows(const char* in, char* out, const OpDesc& desc, StepInfo& step);
  void all_gather_windows(const char* in, char* out, const OpDesc& desc, StepInfo& step);
  void broadcast_windows(char* data, const OpDesc& desc, StepInfo& step);

  std::string name_;
  int rank_;
  int world_size_;
  ShmConfig config_;
  int64_t slot_stride_;  // desc header + data, rounded to a page
  char* base_ = nullptr;
  int64_t mapped_nbytes_ = 0;
  uint64_t pid_ns_ = 0;  // this process's pid namespace, as in RankHeader
  uint64_t seq_ = 0;  // rounds this rank has posted
  TraceRing trace_;
  // Registered and erased from Python (a tensor's finalizer, any thread); read by
  // the op in flight, which holds windows_mutex_ from its first round to its
  // end whenever a window exists, so a window is never unmapped under it.
  std::vector<WindowTable> windows_;
  std::atomic<int> num_windows_{0};
  std::mutex windows_mutex_;
  // Filled by check_descs in the first round of an op: every rank's OpDesc as
  // read once from the segment and checked, and (zero-copy ops) where each
  // peer's input and output lie in this process, checked against the windows.
  std::vector<OpDesc> descs_;
  std::vector<const char*> peer_inputs_;
  std::vector<const char*> peer_outputs_;
  Access access_ = Access::kStaged;  // of the op in progress
  std::vector<const void*> srcs_;    // scratch: one source per rank
  // The highest consumed flag seen (and checked) per peer: a peer's consumed
  // only grows, so acquire_slot reads it again only when this is too low.
  std::vector<uint64_t> seen_consumed_;
  std::vector<char> cma_pieces_;     // kCma reductions: (world_size - 1) pieces read from peers
  std::vector<int64_t> peer_pids_;   // checked by setup_cma (see [Note: CMA trust] in shm_cma.cpp)
  uint64_t cma_token_ = 0;
  bool cma_enabled_ = false;
  std::atomic<int64_t> caller_{0};   // see OpScope
  std::atomic<int64_t> p2p_calls_{0};  // point-to-point calls in flight (enter_p2p)
  std::unique_ptr<P2pChannels> p2p_;
  std::atomic<int32_t> state_{0};    // CommState
  std::mutex lifecycle_mutex_;       // one close or abort at a time
  std::atomic<bool> abort_requested_{false};  // set by abort() before it waits for lifecycle_mutex_
  std::string broken_;
};

}  // namespace ringcomm
