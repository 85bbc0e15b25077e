// Receiving on the point-to-point channels: draining what peers posted,
// matching messages with receives, and the rendezvous reads ([Note: p2p
// channels] in shm_p2p.cpp).
#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>

#include "copy.h"
#include "shm_p2p.h"

namespace ringcomm {
namespace {

std::string size_mismatch(int rank, int src, int64_t tag, int64_t message_nbytes, int64_t buffer_nbytes) {
  return "recv: rank " + std::to_string(rank) + " got a message of " + std::to_string(message_nbytes) +
         " bytes from rank " + std::to_string(src) + " (tag " + std::to_string(tag) + ") for a buffer of " +
         std::to_string(buffer_nbytes) + " bytes; sender and receiver must pass the same number of bytes";
}

}  // namespace

Request P2pChannels::irecv(char* buffer, int64_t nbytes, int src, int64_t tag) {
  if (src < -1 || src >= world_size_ || nbytes < 0)
    throw std::invalid_argument("recv: rank " + std::to_string(rank_) + ": src=" + std::to_string(src) +
                                " outside world_size " + std::to_string(world_size_) + " or nbytes=" +
                                std::to_string(nbytes) + " < 0");
  auto recv = std::make_shared<P2pRequest>();
  recv->kind = P2pRequest::Kind::kRecv;
  recv->peer = src;
  recv->any_source = src < 0;
  recv->tag = tag;
  recv->buffer = buffer;
  recv->nbytes = nbytes;
  const P2pCall call(comm_, src < 0 ? "recv_anysource" : "recv");
  const std::lock_guard<std::mutex> lock(mutex_);
  check_usable(src < 0 ? "recv_anysource" : "recv");
  for (int peer = 0; peer < world_size_; ++peer)  // what has arrived first, so that it matches in order
    if (peer != rank_ && (src < 0 || peer == src)) drain(peer);
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    if ((src < 0 || it->src == src) && it->tag == tag) {
      match_unexpected(recv, it);
      flush_rings();
      return recv;
    }
  }
  posted_.push_back(recv);
  flush_rings();
  return recv;
}

// Handles every piece that `peer` has posted to this rank.
void P2pChannels::drain(int peer) {
  ChannelHeader* from = channel(peer, rank_);
  Incoming& in = in_[peer];
  const uint64_t sent = from->sent.value.load(std::memory_order_acquire);
  if (sent == in.taken) return;
  if (sent < in.taken || sent - in.taken > static_cast<uint64_t>(num_slots_))
    corrupt(peer, "sent=" + std::to_string(sent) + " with taken=" + std::to_string(in.taken));
  while (in.taken < sent) {
    const char* at = slot(from, in.taken);
    PieceHeader piece;
    std::memcpy(&piece, at, sizeof(piece));  // read once: the peer may write it again
    take_piece(peer, piece, at + sizeof(PieceHeader));
    ++in.taken;
    from->taken.value.store(in.taken, std::memory_order_release);
    to_ring_[peer] = 1;
  }
}

void P2pChannels::take_piece(int peer, const PieceHeader& piece, const char* data) {
  Incoming& in = in_[peer];
  if (piece.nbytes < 0 || piece.nbytes > slot_nbytes_) corrupt(peer, "a piece of " + std::to_string(piece.nbytes) + " bytes");
  if (in.sink == Sink::kNone) {
    if (piece.kind == static_cast<int32_t>(PieceKind::kRendezvous)) return take_rendezvous(peer, piece);
    if (piece.kind != static_cast<int32_t>(PieceKind::kFirst) || piece.message_nbytes < 0)
      corrupt(peer, "piece kind " + std::to_string(piece.kind) + " where a message starts");
    start_message(peer, piece);
  } else if (piece.kind != static_cast<int32_t>(PieceKind::kMore)) {
    corrupt(peer, "piece kind " + std::to_string(piece.kind) + " inside a message");
  }
  if (piece.nbytes != std::min(in.remaining, slot_nbytes_))
    corrupt(peer, "a piece of " + std::to_string(piece.nbytes) + " bytes with " + std::to_string(in.remaining) + " to come");
  if (in.sink == Sink::kRequest) {
    P2pRequest& recv = *in.request;
    copy_bytes(recv.buffer + recv.moved, data, piece.nbytes);
    recv.moved += piece.nbytes;
  } else if (in.sink == Sink::kUnexpected) {
    Unexpected& message = *in.unexpected;
    copy_bytes(message.data.data() + message.arrived, data, piece.nbytes);
    message.arrived += piece.nbytes;
  }
  in.remaining -= piece.nbytes;
  if (in.remaining > 0) return;
  if (in.sink == Sink::kRequest) complete(*in.request);
  in.sink = Sink::kNone;
  in.request.reset();
}

// The first piece of an eager message: where its bytes go.
void P2pChannels::start_message(int peer, const PieceHeader& piece) {
  Incoming& in = in_[peer];
  in.remaining = piece.message_nbytes;
  if (Request recv = match_posted(peer, piece.tag)) {
    in.sink = fits(*recv, peer, piece.message_nbytes) ? Sink::kRequest : Sink::kDiscard;
    in.request = std::move(recv);
    return;
  }
  Unexpected message{peer, piece.tag, piece.message_nbytes, std::vector<char>(piece.message_nbytes)};
  unexpected_.push_back(std::move(message));
  in.sink = Sink::kUnexpected;
  in.unexpected = std::prev(unexpected_.end());
}

void P2pChannels::take_rendezvous(int peer, const PieceHeader& piece) {
  Incoming& in = in_[peer];
  if (comm_.cma_pid(peer) == 0 || piece.message_nbytes <= 0 || piece.nbytes != 0 || piece.ticket != in.next_ticket)
    corrupt(peer, "a rendezvous of " + std::to_string(piece.message_nbytes) + " bytes, ticket " +
                      std::to_string(piece.ticket) + " (expected " + std::to_string(in.next_ticket) + ")");
  ++in.next_ticket;
  if (Request recv = match_posted(peer, piece.tag)) {
    if (fits(*recv, peer, piece.message_nbytes)) {
      read_rendezvous(peer, *recv, piece.address, piece.ticket);
    } else {
      release_ticket(peer, piece.ticket);
    }
    return;
  }
  Unexpected message{peer, piece.tag, piece.message_nbytes, {}};
  message.rendezvous = true;
  message.address = piece.address;
  message.ticket = piece.ticket;
  unexpected_.push_back(std::move(message));
}

// The earliest posted receive that takes a message from `src` with `tag`, taken off the list.
Request P2pChannels::match_posted(int src, int64_t tag) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    P2pRequest& recv = **it;
    if ((recv.any_source || recv.peer == src) && recv.tag == tag) {
      Request matched = std::move(*it);
      posted_.erase(it);
      matched->peer = src;
      matched->source.store(src, std::memory_order_release);
      return matched;
    }
  }
  return nullptr;
}

// A new receive takes an unexpected message (which leaves the list).
void P2pChannels::match_unexpected(const Request& recv, std::list<Unexpected>::iterator message) {
  const int src = message->src;
  recv->peer = src;
  recv->source.store(src, std::memory_order_release);
  const bool ok = fits(*recv, src, message->nbytes);
  if (message->rendezvous) {
    if (ok) {
      read_rendezvous(src, *recv, message->address, message->ticket);
    } else {
      release_ticket(src, message->ticket);
    }
    unexpected_.erase(message);
    return;
  }
  if (ok) {
    copy_bytes(recv->buffer, message->data.data(), message->arrived);
    recv->moved = message->arrived;
  }
  if (message->arrived == message->nbytes) {
    if (ok) complete(*recv);
  } else {  // still arriving: the rest goes straight to the receive (or nowhere)
    Incoming& in = in_[src];
    in.sink = ok ? Sink::kRequest : Sink::kDiscard;
    in.request = recv;
  }
  unexpected_.erase(message);
}

// Whether a message of `nbytes` from `src` fits `recv`; if not, `recv` fails (ValueError).
bool P2pChannels::fits(P2pRequest& recv, int src, int64_t nbytes) {
  if (nbytes == recv.nbytes) return true;
  recv.error = size_mismatch(rank_, src, recv.tag, nbytes, recv.nbytes);
  recv.caller_error = true;
  recv.status.store(static_cast<int>(P2pRequest::Status::kFailed), std::memory_order_release);
  return false;
}

void P2pChannels::read_rendezvous(int peer, P2pRequest& recv, uint64_t address, uint64_t ticket) {
  const int err = read_process(comm_.cma_pid(peer), recv.buffer, reinterpret_cast<const void*>(address), recv.nbytes);
  if (err != 0) {
    const std::string gone = comm_.peer_gone(peer);
    break_channels(where(recv) + ": reading " + std::to_string(recv.nbytes) + " bytes of rank " +
                   std::to_string(peer) + "'s buffer by process_vm_readv failed: " + std::strerror(err) +
                   (gone.empty() ? "" : " (" + gone + ")"));
  }
  recv.moved = recv.nbytes;
  release_ticket(peer, ticket);
  complete(recv);
}

// Ends the sender's rendezvous send `ticket` (read, or refused by a receive of another size).
void P2pChannels::release_ticket(int peer, uint64_t ticket) {
  channel(peer, rank_)->done[ticket % kMaxRendezvous].store(ticket + 1, std::memory_order_release);
  to_ring_[peer] = 1;
}

}  // namespace ringcomm
