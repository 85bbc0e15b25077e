// What this rank reads from the shared segment, checked before use.
//
// [Note: shm trust] Peers write the segment, so whatever this rank reads from
// it is checked before use, in O(world_size) integer compares per wait or op:
// flags against what the protocol allows (a peer posts at most num_slots
// rounds past this rank's last post, since it waits for this rank's consumed
// before reusing a slot, and consumes only rounds this rank posted), OpDescs
// against the ranges of their fields and, for zero-copy ops, window ids and
// offsets against the windows this rank mapped (shm_window.cpp). Each OpDesc
// is read once into descs_, so a peer rewriting it later changes nothing. A
// violation breaks the group, as a dead peer does.
#include <sys/stat.h>

#include <sstream>

#include "process.h"
#include "shm.h"

namespace ringcomm {

// The pid namespace of this process (0 where /proc does not say): pids of
// processes in other namespaces (containers sharing /dev/shm) mean nothing here.
uint64_t own_pid_namespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Judged by pid only for a peer in this pid namespace; any other peer is waited
// for until the deadline.
bool ShmComm::peer_exited(int peer) const {
  const RankHeader* theirs = header(peer);
  return pid_ns_ != 0 && theirs->pid_ns == pid_ns_ && process_state(theirs->pid) == ProcessState::kExited;
}

std::string ShmComm::exited_peers(int peer) const {
  auto exited = [this](int rank) {
    return "rank " + std::to_string(rank) + " (pid " + std::to_string(header(rank)->pid) + ") has exited";
  };
  std::string message = exited(peer);
  for (int other = 0; other < world_size_; ++other)
    if (other != peer && other != rank_ && peer_exited(other)) message += "; " + exited(other);
  return message;
}

void ShmComm::fail_flag(int peer, FlagKind kind, uint64_t value, uint64_t limit, const StepInfo& step) {
  std::ostringstream message;
  message << step.op << ": rank " << rank_ << " at step " << step.step << "/" << step.num_steps << " (round " << seq_
          << ") read rank " << peer << "'s " << (kind == FlagKind::kPosted ? "posted" : "consumed") << "=" << value
          << ", which the protocol never reaches (at most " << limit << "): the shared segment is corrupt";
  fail(message.str());
}

// Fields out of their ranges are a corrupt segment, not a caller mistake.
void ShmComm::check_desc_range(const StepInfo& step, int peer, const OpDesc& theirs) {
  if (theirs.kind >= 0 && theirs.kind <= static_cast<int32_t>(OpKind::kAllToAll) && theirs.dtype >= -1 &&
      theirs.dtype <= static_cast<int32_t>(DType::kInt64) && theirs.redop >= -1 &&
      theirs.redop <= static_cast<int32_t>(RedOp::kMax) && theirs.root >= -1 && theirs.root < world_size_ &&
      theirs.numel >= 0 && theirs.access >= static_cast<int32_t>(Access::kStaged) &&
      theirs.access <= static_cast<int32_t>(Access::kCma))
    return;
  std::ostringstream message;
  message << step.op << ": rank " << rank_ << " read an impossible op descriptor from rank " << peer
          << " (kind=" << theirs.kind << ", dtype=" << theirs.dtype << ", op=" << theirs.redop << ", root=" << theirs.root
          << ", numel=" << theirs.numel << ", access=" << theirs.access << "): the shared segment is corrupt";
  fail(message.str());
}

namespace {

bool same_key(const CallKey& a, const CallKey& b) {
  for (int i = 0; i < kCallKeyLen; ++i)
    if (a.values[i] != b.values[i]) return false;
  return true;
}

bool same_call(const OpDesc& a, const OpDesc& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.redop == b.redop && a.root == b.root && a.numel == b.numel &&
         a.access == b.access && same_key(a.key, b.key);
}

void describe_call(std::ostream& out, const OpDesc& desc) {
  static const char* const kAccess[] = {"staged", "ringcomm.empty windows", "single copy (CMA)"};
  out << "(kind=" << desc.kind << ", dtype=" << desc.dtype << ", op=" << desc.redop << ", root=" << desc.root
      << ", numel=" << desc.numel << ", buffers=" << kAccess[desc.access];
  if (desc.key.values[0] != 0) {
    out << ", caller's key=[";
    for (int i = 0; i < kCallKeyLen; ++i) out << (i ? ", " : "") << desc.key.values[i];
    out << "]";
  }
  out << ")";
}

}  // namespace

void ShmComm::check_descs(const StepInfo& step, const OpDesc& mine) {
  bool agree = true;
  for (int peer = 0; peer < world_size_; ++peer) {
    descs_[peer] = *slot_desc(peer, seq_);
    check_desc_range(step, peer, descs_[peer]);
    agree = agree && same_call(descs_[peer], mine);
  }
  if (agree) {
    access_ = static_cast<Access>(mine.access);
    if (access_ != Access::kStaged) resolve_peers(step, mine);
    return;
  }
  release();  // every rank sees the mismatch in this round, so all stay in step
  std::ostringstream message;
  message << step.op << ": ranks disagree on the call: rank " << rank_ << " called ";
  describe_call(message, mine);
  message << " but";
  for (int peer = 0; peer < world_size_; ++peer) {
    if (same_call(descs_[peer], mine)) continue;
    message << " rank " << peer << " called ";
    describe_call(message, descs_[peer]);
    message << ";";
  }
  message << " every rank must pass the same op, dtype and sizes, and either all or no tensors from ringcomm.empty";
  throw CallMismatch(message.str());
}

std::vector<std::vector<int64_t>> ShmComm::last_calls() const {
  std::vector<std::vector<int64_t>> calls;
  for (const OpDesc& desc : descs_) {
    std::vector<int64_t> call{desc.kind, desc.dtype, desc.redop, desc.root, desc.numel};
    call.insert(call.end(), desc.key.values, desc.key.values + kCallKeyLen);
    calls.push_back(std::move(call));
  }
  return calls;
}

}  // namespace ringcomm
