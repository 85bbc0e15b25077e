// The point-to-point protocol of the shared-memory transport: the channels,
// posting sends and moving their pieces (receiving: shm_p2p_recv.cpp).
//
// [Note: p2p channels] Each ordered pair (src, dst) of ranks has a channel in
// the segment: num_slots slots of one PieceHeader and slot_nbytes of data,
// used in turn, and two counters, `sent` (written by src) and `taken`
// (written by dst). src writes slot sent % num_slots while sent - taken <
// num_slots, then publishes sent + 1 (release); dst reads the slots below
// `sent` (acquire), handles each and publishes taken + 1, which frees it.
//
//   src: isend(A, tag 3) isend(B, tag 0)        dst: irecv(tag 0) irecv(tag 3)
//        | first A | more A | first B |  ->  drain: A matches no receive: kept
//        sent = 3               taken = 3          as unexpected; B fills irecv(tag 0);
//                                                  irecv(tag 3) then takes A.
//
// A message is a first piece (tag, message bytes, its first data) and as many
// `more` pieces as its data needs. The sends of a channel go out in post order,
// whole message after whole message, so each channel is FIFO; dst matches each
// arriving message with its earliest posted receive of that source (or of any
// source) and that tag, or keeps it as unexpected (its bytes copied to the heap
// as they arrive), and a new receive first takes the earliest unexpected message
// that matches. That is MPI's and gloo's order: per (src, dst, tag), first sent,
// first received. Sizes must agree: a message of another size than the receive's
// buffer fails that receive (a ValueError) and is discarded.
//
// Two ways to move the data, chosen by the sender:
//   eager       the data is copied into the slots. The send ends once its last
//               piece is in the channel, so isends that fit never wait for the
//               receiver; a message longer than the free slots waits for them
//               and is written as this rank makes progress (any wait or post).
//   rendezvous  (CMA on, messages of at least p2p_cma_min_nbytes) one slot with
//               the buffer's address and a ticket; once matched, dst reads the
//               data straight from src's memory (process_vm_readv, one copy) and
//               stores ticket + 1 into done[ticket % kMaxRendezvous], which ends
//               the send. The sender needs to do nothing more once it posted.
// Both ways, a send ends when its data is in the channel or the receiver took
// it, and a receive may be posted before or after its message arrived, so two
// ranks that both send first (isend, isend, irecv, irecv, waits) never deadlock.
// A rank that publishes a counter rings the peer's bell (Bell: an increment and
// a futex wake when someone sleeps on it), once per progress call.
#include "shm_p2p.h"

#include <algorithm>
#include <cstring>

#include "copy.h"

namespace ringcomm {
namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

int64_t slot_stride_of(const ShmConfig& config) {
  return static_cast<int64_t>(sizeof(PieceHeader)) + round_up(config.p2p_slot_nbytes, 64);
}

int64_t channel_stride_of(const ShmConfig& config) {
  return static_cast<int64_t>(sizeof(ChannelHeader)) + config.p2p_num_slots * slot_stride_of(config);
}

}  // namespace

P2pChannels::P2pChannels(ShmComm& comm, char* region, const ShmConfig& config)
    : comm_(comm),
      region_(region),
      rank_(comm.rank()),
      world_size_(comm.world_size()),
      slot_nbytes_(config.p2p_slot_nbytes),
      num_slots_(config.p2p_num_slots),
      slot_stride_(slot_stride_of(config)),
      channel_stride_(channel_stride_of(config)),
      cma_min_nbytes_(config.p2p_cma_min_nbytes),
      spin_ns_(config.spin_ns),
      out_(comm.world_size()),
      in_(comm.world_size()),
      to_ring_(comm.world_size(), 0) {}

int64_t P2pChannels::region_nbytes(int world_size, const ShmConfig& config) {
  const int64_t pairs = static_cast<int64_t>(world_size) * (world_size - 1);
  return world_size * static_cast<int64_t>(sizeof(Bell)) + pairs * channel_stride_of(config);
}

Bell* P2pChannels::bell(int rank) const { return reinterpret_cast<Bell*>(region_) + rank; }

// Channels of the pairs src != dst, by src then dst.
ChannelHeader* P2pChannels::channel(int src, int dst) const {
  const int64_t index = static_cast<int64_t>(src) * (world_size_ - 1) + (dst < src ? dst : dst - 1);
  char* first = region_ + world_size_ * static_cast<int64_t>(sizeof(Bell));
  return reinterpret_cast<ChannelHeader*>(first + index * channel_stride_);
}

char* P2pChannels::slot(ChannelHeader* channel, uint64_t piece) const {
  return reinterpret_cast<char*>(channel + 1) + static_cast<int64_t>(piece % num_slots_) * slot_stride_;
}

Request P2pChannels::isend(const char* buffer, int64_t nbytes, int dst, int64_t tag) {
  if (dst < 0 || dst >= world_size_ || nbytes < 0)
    throw std::invalid_argument("send: rank " + std::to_string(rank_) + ": dst=" + std::to_string(dst) +
                                " outside world_size " + std::to_string(world_size_) + " or nbytes=" +
                                std::to_string(nbytes) + " < 0");
  auto send = std::make_shared<P2pRequest>();
  send->kind = P2pRequest::Kind::kSend;
  send->peer = dst;
  send->tag = tag;
  send->buffer = const_cast<char*>(buffer);
  send->nbytes = nbytes;
  const P2pCall call(comm_, "send");
  const std::lock_guard<std::mutex> lock(mutex_);
  check_usable("send");
  if (dst == rank_) {
    send_to_self(send);
  } else {
    out_[dst].queue.push_back(send);
    push_sends(dst);
    flush_rings();
  }
  return send;
}

bool P2pChannels::test(P2pRequest& request) {
  if (request.state() != P2pRequest::Status::kPending) return true;
  const P2pCall call(comm_, "test");
  const std::lock_guard<std::mutex> lock(mutex_);
  if (broken_.empty()) {
    progress();
    flush_rings();
  }
  return request.state() != P2pRequest::Status::kPending;
}

void P2pChannels::progress() {
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    drain(peer);
    push_sends(peer);
    finish_rendezvous(peer);
  }
}

void P2pChannels::complete(P2pRequest& request) {
  request.status.store(static_cast<int>(P2pRequest::Status::kDone), std::memory_order_release);
}

void P2pChannels::flush_rings() {
  for (int peer = 0; peer < world_size_; ++peer) {
    if (to_ring_[peer]) {
      to_ring_[peer] = 0;
      ring(peer);
    }
  }
}

// ---- sending ----

bool P2pChannels::rendezvous_send(const P2pRequest& send, int peer) const {
  return cma_min_nbytes_ >= 0 && send.nbytes > 0 && send.nbytes >= cma_min_nbytes_ && comm_.cma_pid(peer) != 0;
}

// Writes what the channel to `peer` has room for, sends in post order.
void P2pChannels::push_sends(int peer) {
  Outgoing& out = out_[peer];
  while (!out.queue.empty()) {
    P2pRequest& send = *out.queue.front();
    if (send.pieces == 0 && rendezvous_send(send, peer)) {
      if (!slot_free(peer) || !ticket_free(peer)) return;
      const PieceHeader piece{static_cast<int32_t>(PieceKind::kRendezvous), 0, send.tag, send.nbytes, 0,
                              reinterpret_cast<uint64_t>(send.buffer), out.next_ticket};
      post_piece(peer, piece, nullptr);
      send.ticket = static_cast<int64_t>(out.next_ticket++);
      send.pieces = 1;
      out.reading.push_back(std::move(out.queue.front()));
      out.queue.pop_front();
      continue;
    }
    while (send.pieces == 0 || send.moved < send.nbytes) {
      if (!slot_free(peer)) return;
      const int64_t nbytes = std::min(send.nbytes - send.moved, slot_nbytes_);
      const auto kind = send.pieces == 0 ? PieceKind::kFirst : PieceKind::kMore;
      const PieceHeader piece{static_cast<int32_t>(kind), 0, send.tag, send.nbytes, nbytes, 0, 0};
      post_piece(peer, piece, send.buffer + send.moved);
      send.moved += nbytes;
      ++send.pieces;
    }
    complete(send);
    out.queue.pop_front();
  }
}

bool P2pChannels::slot_free(int peer) {
  Outgoing& out = out_[peer];
  if (out.sent - out.taken < static_cast<uint64_t>(num_slots_)) return true;
  const uint64_t taken = channel(rank_, peer)->taken.value.load(std::memory_order_acquire);
  if (taken > out.sent) corrupt(peer, "taken=" + std::to_string(taken) + " beyond sent=" + std::to_string(out.sent));
  out.taken = taken;
  return out.sent - out.taken < static_cast<uint64_t>(num_slots_);
}

// Ticket t reuses done[t % kMaxRendezvous] once ticket t - kMaxRendezvous was read.
bool P2pChannels::ticket_free(int peer) const {
  const uint64_t ticket = out_[peer].next_ticket;
  if (ticket < static_cast<uint64_t>(kMaxRendezvous)) return true;
  const uint64_t done = channel(rank_, peer)->done[ticket % kMaxRendezvous].load(std::memory_order_acquire);
  return done == ticket - kMaxRendezvous + 1;
}

void P2pChannels::post_piece(int peer, const PieceHeader& piece, const char* data) {
  Outgoing& out = out_[peer];
  ChannelHeader* to = channel(rank_, peer);
  char* at = slot(to, out.sent);
  std::memcpy(at, &piece, sizeof(piece));
  if (piece.nbytes > 0) copy_bytes(at + sizeof(PieceHeader), data, piece.nbytes);
  ++out.sent;
  to->sent.value.store(out.sent, std::memory_order_release);
  to_ring_[peer] = 1;
}

void P2pChannels::finish_rendezvous(int peer) {
  std::vector<Request>& reading = out_[peer].reading;
  const ChannelHeader* to = channel(rank_, peer);
  for (auto it = reading.begin(); it != reading.end();) {
    P2pRequest& send = **it;
    const auto ticket = static_cast<uint64_t>(send.ticket);
    if (to->done[ticket % kMaxRendezvous].load(std::memory_order_acquire) == ticket + 1) {
      send.moved = send.nbytes;
      complete(send);
      it = reading.erase(it);
    } else {
      ++it;
    }
  }
}

// A send to this rank: delivered at once, to a posted receive or as unexpected.
void P2pChannels::send_to_self(const Request& send) {
  if (Request recv = match_posted(rank_, send->tag)) {
    if (fits(*recv, rank_, send->nbytes)) {
      copy_bytes(recv->buffer, send->buffer, send->nbytes);
      recv->moved = send->nbytes;
      complete(*recv);
    }
  } else {
    Unexpected message{rank_, send->tag, send->nbytes, std::vector<char>(send->buffer, send->buffer + send->nbytes)};
    message.arrived = send->nbytes;
    unexpected_.push_back(std::move(message));
  }
  send->moved = send->nbytes;
  complete(*send);
}

}  // namespace ringcomm
