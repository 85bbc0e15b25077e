// Cross-memory attach (CMA) for the shared-memory transport: a rank reads a
// peer's plain buffers straight from the peer's memory with process_vm_readv,
// one kernel copy instead of staging through a slot (two copies), as Open MPI's
// shared-memory transport does. The kernel allows it between processes of one
// user unless a security rule forbids it (Yama ptrace_scope >= 2, seccomp, a
// pid namespace apart), so setup_cma tests it between every pair of ranks and
// the group uses it only if every test passed.
//
// [Note: CMA trust] The pids come from the segment, so setup_cma checks each
// by reading the peer's random token at the address the peer published: a pid
// that names some other process of this user does not hold that token. The
// checked pids are kept here; later ops read only the buffer addresses from
// the segment, and the kernel checks that they are mapped in the peer.
#include <errno.h>
#include <sys/uio.h>

#include <cstring>

#include "shm.h"

namespace ringcomm {

int read_process(int64_t pid, void* local, const void* remote, int64_t nbytes) {
  int64_t done = 0;
  while (done < nbytes) {
    iovec to{static_cast<char*>(local) + done, static_cast<size_t>(nbytes - done)};
    iovec from{const_cast<char*>(static_cast<const char*>(remote)) + done, static_cast<size_t>(nbytes - done)};
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), &to, 1, &from, 1, 0);
    if (n > 0) {
      done += n;
    } else if (n < 0 && errno != EINTR) {
      return errno;
    } else if (n == 0) {
      return EFAULT;
    }
  }
  return 0;
}

std::string ShmComm::setup_cma(double timeout_s, int64_t piece_nbytes) {
  OpScope scope(caller_, state_, "setup_cma", rank_);
  if (piece_nbytes < kMinCmaPieceBytes || piece_nbytes % 64 != 0)
    throw std::invalid_argument("setup_cma: piece_nbytes=" + std::to_string(piece_nbytes) +
                                " must be a multiple of 64, at least " + std::to_string(kMinCmaPieceBytes));
  std::string reason;
  peer_pids_.assign(world_size_, 0);
  for (int peer = 0; peer < world_size_ && reason.empty(); ++peer) {
    if (peer == rank_) continue;
    const RankHeader* theirs = header(peer);
    if (pid_ns_ == 0 || theirs->pid_ns != pid_ns_) {
      reason = "rank " + std::to_string(peer) + " is in another pid namespace";
      break;
    }
    uint64_t token = 0;
    const int err = read_process(theirs->pid, &token, reinterpret_cast<const void*>(theirs->cma_token_addr), 8);
    if (err != 0) {
      reason = "process_vm_readv from rank " + std::to_string(peer) + ": " + std::strerror(err);
    } else if (token != theirs->cma_token) {
      reason = "rank " + std::to_string(peer) + "'s pid names another process";
    }
    peer_pids_[peer] = theirs->pid;
  }
  header(rank_)->cma_ok = reason.empty() ? 1 : 0;
  barrier_round("setup_cma", timeout_s);  // every rank's cma_ok is written now, and stays as it is
  for (int peer = 0; peer < world_size_ && reason.empty(); ++peer)
    if (header(peer)->cma_ok != 1) reason = "rank " + std::to_string(peer) + " cannot read its peers' memory";
  cma_enabled_ = reason.empty() && world_size_ > 1;
  if (cma_enabled_) cma_pieces_.resize(static_cast<size_t>((world_size_ - 1) * piece_nbytes));
  return reason;
}

void ShmComm::cma_read(const StepInfo& step, int peer, char* dst, const char* src, int64_t nbytes) {
  const int err = read_process(peer_pids_[peer], dst, src, nbytes);
  if (err == 0) return;
  check_peer_left(peer, std::string(step.op) + ": rank " + std::to_string(rank_) + " reading rank " +
                            std::to_string(peer) + "'s buffer");
  fail(std::string(step.op) + ": rank " + std::to_string(rank_) + " at step " + std::to_string(step.step) + "/" +
       std::to_string(step.num_steps) + ": reading " + std::to_string(nbytes) + " bytes of rank " +
       std::to_string(peer) + "'s buffer (pid " + std::to_string(peer_pids_[peer]) + ") by process_vm_readv failed: " +
       std::strerror(err) + (err == ESRCH ? " (" + exited_peers(peer) + ")" : ""));
}

}  // namespace ringcomm
