// Single-copy collectives of the shared-memory transport: ranks read each
// other's buffers directly instead of staging copies, either in windows
// (tensors from ringcomm.empty, mapped by all ranks: plain loads) or, for any
// other buffer, by cross-memory attach (shm_cma.cpp: the kernel copies from
// the peer's memory). The algorithms below are the same for both; fetch() and
// reduce_peers() are where they differ.
//
// [Note: window hazards] A rank's buffer may be read by peers from the round
// in which it posts until every peer has consumed that round, so: a rank posts
// only once its buffer holds the data peers need; it overwrites a part of its
// buffer that a peer reads only after that peer posted the next round; and it
// returns only after every peer consumed its last round (wait_consumed), since
// the caller may then change the buffer.
#include <cstring>
#include <vector>

#include "copy.h"
#include "reduce.h"
#include "shm.h"
#include "shm_plan.h"

namespace ringcomm {

void ShmComm::register_window(int64_t id, const std::vector<uintptr_t>& bases, const std::vector<int64_t>& nbytes) {
  if (static_cast<int>(bases.size()) != world_size_ || static_cast<int>(nbytes.size()) != world_size_)
    throw std::invalid_argument("shm: register_window needs one base and size per rank");
  WindowTable table{id, std::vector<char*>(world_size_), nbytes};
  for (int r = 0; r < world_size_; ++r) table.bases[r] = reinterpret_cast<char*>(bases[r]);
  const std::lock_guard<std::mutex> lock(windows_mutex_);
  windows_.push_back(std::move(table));
  num_windows_.fetch_add(1, std::memory_order_release);
}

// Waits for the op in flight, if it may read windows (it holds windows_mutex_).
void ShmComm::unregister_window(int64_t id) {
  const std::lock_guard<std::mutex> lock(windows_mutex_);
  for (size_t i = 0; i < windows_.size(); ++i) {
    if (windows_[i].id == id) {
      windows_.erase(windows_.begin() + static_cast<long>(i));
      num_windows_.fetch_sub(1, std::memory_order_release);
      return;
    }
  }
}

bool ShmComm::locate(const void* ptr, int64_t nbytes, int64_t* window, int64_t* offset) const {
  const char* p = static_cast<const char*>(ptr);
  for (const WindowTable& table : windows_) {
    const char* base = table.bases[rank_];
    if (nbytes > 0 && p >= base && p + nbytes <= base + table.nbytes[rank_]) {
      *window = table.id;
      *offset = p - base;
      return true;
    }
  }
  *window = -1;
  *offset = 0;
  return false;
}

OpDesc ShmComm::describe(OpKind kind, int dtype, int redop, int root, int64_t numel, const void* in, int64_t in_nbytes,
                         const void* out, int64_t out_nbytes, const CallKey& key) const {
  OpDesc desc{static_cast<int32_t>(kind), dtype, redop, root, numel, 0, -1, 0, -1, 0,
              reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(out), key};
  if (kind == OpKind::kBarrier || (windows_.empty() && !cma_enabled_)) return desc;
  const bool in_window = locate(in, in_nbytes, &desc.in_window, &desc.in_offset);
  const bool out_window = locate(out, out_nbytes, &desc.out_window, &desc.out_offset);
  const bool windows = kind == OpKind::kAllReduce ? in_window && (out == in || out_window) : in_window;
  const int64_t nbytes = in_nbytes > out_nbytes ? in_nbytes : out_nbytes;
  if (windows) {
    desc.access = static_cast<int32_t>(Access::kWindows);
  } else if (const int64_t least = kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter
                                       ? config_.cma_reduce_min_nbytes
                                       : config_.cma_min_nbytes;
             cma_enabled_ && least >= 0 && nbytes >= least) {
    desc.access = static_cast<int32_t>(Access::kCma);
  }
  return desc;
}

// Where `nbytes` at `offset` of `peer`'s window `id` lie in this process, after
// checking them against that window (see [Note: shm trust] in shm_trust.cpp).
const char* ShmComm::window_span(const StepInfo& step, int peer, int64_t id, int64_t offset, int64_t nbytes,
                                 const char* what) {
  for (const WindowTable& table : windows_) {
    if (table.id != id) continue;
    const int64_t window_nbytes = table.nbytes[peer];
    if (offset >= 0 && nbytes <= window_nbytes && offset <= window_nbytes - nbytes) return table.bases[peer] + offset;
    fail(std::string(step.op) + ": rank " + std::to_string(rank_) + ": rank " + std::to_string(peer) + " passed its " +
         what + " at offset " + std::to_string(offset) + " of window " + std::to_string(id) + " for " +
         std::to_string(nbytes) + " bytes, outside that window's " + std::to_string(window_nbytes) +
         " bytes: the shared segment is corrupt");
  }
  fail(std::string(step.op) + ": rank " + std::to_string(rank_) + ": rank " + std::to_string(peer) + " passed its " +
       what + " in window " + std::to_string(id) +
       ", which this rank does not have (freed its ringcomm.empty tensor, or the shared segment is corrupt)");
}

// Fills peer_inputs_ / peer_outputs_ from descs_ for the bytes `mine` makes
// peers read (all ranks' descs agree with it on kind, dtype, numel and access
// by now): pointers into windows mapped here, or addresses in the peers' own
// processes for CMA (checked by the kernel when read).
void ShmComm::resolve_peers(const StepInfo& step, const OpDesc& mine) {
  const int64_t nbytes = mine.numel * element_nbytes(static_cast<DType>(mine.dtype));
  const bool is_all_reduce = mine.kind == static_cast<int32_t>(OpKind::kAllReduce);
  const int64_t in_nbytes = mine.kind == static_cast<int32_t>(OpKind::kReduceScatter) ? world_size_ * nbytes : nbytes;
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    const OpDesc& theirs = descs_[peer];
    if (access_ == Access::kCma) {
      peer_inputs_[peer] = reinterpret_cast<const char*>(theirs.in_addr);
      peer_outputs_[peer] = reinterpret_cast<const char*>(is_all_reduce ? theirs.out_addr : theirs.in_addr);
      continue;
    }
    peer_inputs_[peer] = window_span(step, peer, theirs.in_window, theirs.in_offset, in_nbytes, "input");
    peer_outputs_[peer] = is_all_reduce && theirs.out_window >= 0
                              ? window_span(step, peer, theirs.out_window, theirs.out_offset, nbytes, "output")
                              : peer_inputs_[peer];
  }
}

// Copies `nbytes` of `peer`'s buffer at `src` (from resolve_peers) to `dst`.
void ShmComm::fetch(const StepInfo& step, int peer, char* dst, const char* src, int64_t nbytes) {
  if (access_ == Access::kCma) return cma_read(step, peer, dst, src, nbytes);
  copy_bytes(dst, src, nbytes);
}

// dst = the reduction of srcs (one per rank, in rank order; srcs[rank_] is this
// rank's own memory, the others are peers' buffers from resolve_peers).
void ShmComm::reduce_peers(const StepInfo& step, char* dst, const char* const* srcs, int64_t numel,
                           const OpDesc& desc) {
  const DType dt = static_cast<DType>(desc.dtype);
  const RedOp op = static_cast<RedOp>(desc.redop);
  if (access_ != Access::kCma) {
    for (int r = 0; r < world_size_; ++r) srcs_[r] = srcs[r];
    return reduce_n(dst, srcs_.data(), world_size_, numel, dt, op, world_size_);
  }
  // CMA: read the peers' parts piece by piece into cache-sized buffers, then reduce.
  const int64_t esize = element_nbytes(dt);
  const int64_t piece_nbytes = static_cast<int64_t>(cma_pieces_.size()) / (world_size_ > 1 ? world_size_ - 1 : 1);
  const int64_t piece_numel = piece_nbytes / esize;
  for (int64_t begin = 0; begin < numel; begin += piece_numel) {
    const int64_t len = numel - begin < piece_numel ? numel - begin : piece_numel;
    char* piece = cma_pieces_.data();
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) {
        srcs_[r] = srcs[r] + begin * esize;
        continue;
      }
      cma_read(step, r, piece, srcs[r] + begin * esize, len * esize);
      srcs_[r] = piece;
      piece += piece_nbytes;
    }
    reduce_n(dst + begin * esize, srcs_.data(), world_size_, len, dt, op, world_size_);
  }
}

// Also the end of a direct-access op: a peer that aborted meanwhile may have let
// its caller change the buffer this rank read, so the result is refused.
void ShmComm::wait_consumed(const StepInfo& step) {
  for (int peer = 0; peer < world_size_; ++peer)
    if (peer != rank_)
      seen_consumed_[peer] = wait_for(peer, FlagKind::kConsumed, seq_, step, "finish reading this rank's buffer");
  for (int peer = 0; peer < world_size_; ++peer)
    if (peer != rank_)
      check_peer_left(peer, std::string(step.op) + ": rank " + std::to_string(rank_) + " at the end", true);
}

// Round 1: each rank reduces its chunk from every rank's input into its output.
// Round 2: each rank copies the other chunks from their owners' outputs.
// (Cut into segments with two rounds each, this measured slower here: the
// extra rounds cost more than the cache locality gained.)
void ShmComm::all_reduce_windows(const char* in, char* out, const OpDesc& desc, StepInfo& step) {
  const DType dt = static_cast<DType>(desc.dtype);
  const int64_t esize = element_nbytes(dt);
  step.num_steps = 2;
  acquire_slot(step);
  post(&desc);
  wait_posted(step);
  check_descs(step, desc);
  std::vector<const char*> srcs(world_size_);
  const Span mine = balanced_chunk(desc.numel, world_size_, rank_);
  for (int peer = 0; peer < world_size_; ++peer)
    srcs[peer] = (peer == rank_ ? in : peer_inputs_[peer]) + mine.begin * esize;
  reduce_peers(step, out + mine.begin * esize, srcs.data(), mine.numel, desc);
  release();

  step.step = 1;
  acquire_slot(step);
  post(nullptr);
  wait_posted(step);
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    const Span chunk = balanced_chunk(desc.numel, world_size_, peer);
    fetch(step, peer, out + chunk.begin * esize, peer_outputs_[peer] + chunk.begin * esize, chunk.numel * esize);
  }
  release();
  wait_consumed(step);
}

void ShmComm::reduce_scatter_windows(const char* in, char* out, const OpDesc& desc, StepInfo& step) {
  const DType dt = static_cast<DType>(desc.dtype);
  const int64_t chunk_nbytes = desc.numel * element_nbytes(dt);
  step.num_steps = 1;
  acquire_slot(step);
  post(&desc);
  wait_posted(step);
  check_descs(step, desc);
  std::vector<const char*> srcs(world_size_);
  for (int peer = 0; peer < world_size_; ++peer)
    srcs[peer] = (peer == rank_ ? in : peer_inputs_[peer]) + rank_ * chunk_nbytes;
  reduce_peers(step, out, srcs.data(), desc.numel, desc);
  release();
  wait_consumed(step);
}

void ShmComm::all_gather_windows(const char* in, char* out, const OpDesc& desc, StepInfo& step) {
  const int64_t chunk_nbytes = desc.numel * element_nbytes(static_cast<DType>(desc.dtype));
  step.num_steps = 1;
  acquire_slot(step);
  post(&desc);
  char* own = out + rank_ * chunk_nbytes;
  if (own != in) copy_bytes(own, in, chunk_nbytes);
  wait_posted(step);
  check_descs(step, desc);
  for (int peer = 0; peer < world_size_; ++peer)
    if (peer != rank_) fetch(step, peer, out + peer * chunk_nbytes, peer_inputs_[peer], chunk_nbytes);
  release();
  wait_consumed(step);
}

void ShmComm::broadcast_windows(char* data, const OpDesc& desc, StepInfo& step) {
  step.num_steps = 1;
  acquire_slot(step);
  post(&desc);
  wait_posted(step);
  check_descs(step, desc);
  if (rank_ != desc.root)
    fetch(step, desc.root, data, peer_inputs_[desc.root], desc.numel * element_nbytes(static_cast<DType>(desc.dtype)));
  release();
  if (rank_ == desc.root) wait_consumed(step);
}

}  // namespace ringcomm
