// Point-to-point messages between the ranks of one host (send, recv, recv from
// any source) in a region of the group's shared segment: one channel per
// ordered pair of ranks. The protocol is explained once, at [Note: p2p
// channels] in shm_p2p.cpp (posting, sending); shm_p2p_recv.cpp receives and
// matches; waits, failures and liveness are in shm_p2p_wait.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shm.h"

namespace ringcomm {

// Rendezvous sends a channel may have outstanding (posted, not yet read); the
// next one waits, and the channel's later sends behind it (1 KiB a channel).
constexpr int kMaxRendezvous = 128;

// One send or receive from its post to its end. Python holds it (a
// ringcomm._C.P2pRequest), and the channels hold it until it ends.
struct P2pRequest {
  enum class Kind : int { kSend = 0, kRecv = 1 };
  enum class Status : int { kPending = 0, kDone = 1, kFailed = 2 };

  Kind kind = Kind::kSend;
  int peer = -1;  // a send's dst; a recv's src (-1: any source, until a message matched it)
  bool any_source = false;
  int64_t tag = 0;
  char* buffer = nullptr;  // a send only reads it
  int64_t nbytes = 0;
  int64_t moved = 0;    // bytes written into the channel (send) or into buffer (recv)
  int64_t pieces = 0;   // pieces written (send)
  int64_t ticket = -1;  // a rendezvous send's ticket
  bool caller_error = false;  // failed by a caller's mistake (a ValueError), not a transport failure
  std::string error;          // why it failed
  std::atomic<int> source{-1};  // a recv's sender, once matched
  std::atomic<int> status{static_cast<int>(Status::kPending)};

  Status state() const { return static_cast<Status>(status.load(std::memory_order_acquire)); }
};

using Request = std::shared_ptr<P2pRequest>;

// A point-to-point call in flight, for its length: refused once the comm is
// closing, and waited for by close() ([Note: close and abort]).
class P2pCall {
 public:
  P2pCall(ShmComm& comm, const char* op) : comm_(comm) { comm.enter_p2p(op); }
  ~P2pCall() { comm_.leave_p2p(); }
  P2pCall(const P2pCall&) = delete;
  P2pCall& operator=(const P2pCall&) = delete;

 private:
  ShmComm& comm_;
};

enum class PieceKind : int32_t { kFirst = 1, kMore = 2, kRendezvous = 3 };

// The head of a slot: one piece of a message (data follows it), or a
// rendezvous descriptor (no data: the receiver reads the sender's buffer).
struct alignas(64) PieceHeader {
  int32_t kind;            // PieceKind
  int32_t reserved;
  int64_t tag;             // kFirst, kRendezvous
  int64_t message_nbytes;  // kFirst, kRendezvous: the whole message
  int64_t nbytes;          // data bytes in this slot
  uint64_t address;        // kRendezvous: the buffer, in the sender's process
  uint64_t ticket;         // kRendezvous: its number among the channel's rendezvous sends
};

struct alignas(64) ChannelHeader {
  Flag sent;   // pieces the sender has posted
  Flag taken;  // pieces the receiver has consumed
  alignas(64) std::atomic<uint64_t> done[kMaxRendezvous];  // by the receiver: ticket + 1 once read
};

// A rank's doorbell: every peer that publishes something this rank may wait
// for (a piece for it, a slot or a rendezvous read of its own) rings it.
struct alignas(64) Bell {
  std::atomic<uint32_t> rings;  // the futex word
  alignas(64) std::atomic<uint32_t> sleepers;
};

// The channels of one ShmComm, over its region of the segment. Any thread may
// post or wait; one mutex guards the state below.
class P2pChannels {
 public:
  P2pChannels(ShmComm& comm, char* region, const ShmConfig& config);

  // Bytes of the region for a group of `world_size` ranks.
  static int64_t region_nbytes(int world_size, const ShmConfig& config);

  // Post a send or a receive; either may end at once (eager sends that fit the
  // channel, receives whose message has arrived). src -1: any source.
  Request isend(const char* buffer, int64_t nbytes, int dst, int64_t tag);
  Request irecv(char* buffer, int64_t nbytes, int src, int64_t tag);
  // Makes progress until `request` ends or `timeout_s` passes; raises its error.
  void wait(P2pRequest& request, double timeout_s);
  // One round of progress without waiting; whether `request` has ended.
  bool test(P2pRequest& request);
  // Rings this rank's bell and its peers': sleepers look at the comm's state.
  void wake();

 private:
  struct Outgoing {                   // this rank -> a peer
    std::deque<Request> queue;        // sends in post order; the front may be partly written
    std::vector<Request> reading;     // rendezvous sends posted, until the receiver read them
    uint64_t sent = 0;                // pieces posted
    uint64_t taken = 0;               // the receiver's `taken`, as last read
    uint64_t next_ticket = 0;
  };
  struct Unexpected {                 // arrived before any receive matched it
    int src;
    int64_t tag;
    int64_t nbytes;
    std::vector<char> data;           // eager: its bytes so far
    int64_t arrived = 0;
    bool rendezvous = false;
    uint64_t address = 0, ticket = 0;
  };
  enum class Sink { kNone, kRequest, kUnexpected, kDiscard };
  struct Incoming {                   // a peer -> this rank
    uint64_t taken = 0;               // pieces consumed
    uint64_t next_ticket = 0;         // the ticket its next rendezvous must carry
    Sink sink = Sink::kNone;          // where the pieces of the message arriving go
    Request request;                  // kRequest
    std::list<Unexpected>::iterator unexpected;  // kUnexpected
    int64_t remaining = 0;            // bytes of it still to come
  };

  // The protocol (shm_p2p.cpp: sending; shm_p2p_recv.cpp: receiving); callers hold mutex_.
  void progress();
  void push_sends(int peer);
  bool rendezvous_send(const P2pRequest& send, int peer) const;
  bool slot_free(int peer);
  bool ticket_free(int peer) const;
  void post_piece(int peer, const PieceHeader& piece, const char* data);
  void finish_rendezvous(int peer);
  void drain(int peer);
  void take_piece(int peer, const PieceHeader& piece, const char* data);
  void take_rendezvous(int peer, const PieceHeader& piece);
  void start_message(int peer, const PieceHeader& piece);
  Request match_posted(int src, int64_t tag);
  void match_unexpected(const Request& recv, std::list<Unexpected>::iterator message);
  bool fits(P2pRequest& recv, int src, int64_t nbytes);
  void read_rendezvous(int peer, P2pRequest& recv, uint64_t address, uint64_t ticket);
  void release_ticket(int peer, uint64_t ticket);
  void send_to_self(const Request& send);
  void flush_rings();
  void complete(P2pRequest& request);

  // Waits and failures (shm_p2p_wait.cpp).
  void wait_pending(P2pRequest& request, double timeout_s);
  void check_usable(const char* op) const;
  std::string where(const P2pRequest& request) const;
  std::string check_peers(const P2pRequest& request) const;
  [[noreturn]] void break_channels(const std::string& message);
  [[noreturn]] void corrupt(int peer, const std::string& what);
  void sleep_on_bell(uint32_t seen, std::chrono::steady_clock::time_point deadline);
  void ring(int rank);

  ChannelHeader* channel(int src, int dst) const;
  char* slot(ChannelHeader* channel, uint64_t piece) const;
  Bell* bell(int rank) const;

  ShmComm& comm_;
  char* region_;
  int rank_;
  int world_size_;
  int64_t slot_nbytes_;
  int num_slots_;
  int64_t slot_stride_;     // PieceHeader + data
  int64_t channel_stride_;  // ChannelHeader + slots
  int64_t cma_min_nbytes_;  // rendezvous from this size (-1: never)
  int64_t spin_ns_;

  std::mutex mutex_;
  std::vector<Outgoing> out_;         // by dst
  std::vector<Incoming> in_;          // by src
  std::list<Unexpected> unexpected_;  // in arrival order
  std::list<Request> posted_;         // unmatched receives, in post order
  std::vector<char> to_ring_;         // by rank: ring its bell when this progress ends
  std::string broken_;                // why the channels refuse work after a failure
};

}  // namespace ringcomm
