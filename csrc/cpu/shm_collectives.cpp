// The collectives of the shared-memory transport, as rounds (see [Note: shm
// rounds] in shm.cpp). Large payloads are cut into segments that fit a slot,
// so staging stays a few MB per rank whatever the tensor size.
//
// Reductions are direct: the owner of a chunk reads that chunk from every rank
// and reduces all of them at once, in rank order. Each element is therefore
// reduced once, with 16-bit floats accumulated in float32 and rounded once,
// and every rank ends with bitwise the same all-reduce result.
#include <cstring>
#include <vector>

#include "copy.h"
#include "reduce.h"
#include "shm.h"
#include "shm_plan.h"

namespace ringcomm {
namespace {

void check_numel(const char* op, int64_t numel) {
  if (numel < 0) throw std::invalid_argument(std::string(op) + ": numel=" + std::to_string(numel) + " < 0");
}

}  // namespace

void ShmComm::all_reduce(Output output, Input input, int64_t numel, int dtype, int redop, double timeout_s) {
  OpScope scope(caller_, state_, "all_reduce", rank_);
  const auto windows = lock_windows();
  check_numel("all_reduce", numel);
  const DType dt = to_dtype(dtype);
  to_redop(redop);
  const int64_t nbytes = numel * element_nbytes(dt);
  const auto* in = reinterpret_cast<const char*>(input.address);
  auto* out = reinterpret_cast<char*>(output.address);
  const OpDesc desc = describe(OpKind::kAllReduce, dtype, redop, -1, numel, in, nbytes, out, nbytes);
  if (desc.access != static_cast<int32_t>(Access::kStaged) && nbytes > config_.oneshot_max_nbytes) {
    StepInfo step = begin_op("all_reduce", 2, timeout_s);
    all_reduce_windows(in, out, desc, step);
  } else if (nbytes <= config_.oneshot_max_nbytes && nbytes <= config_.slot_nbytes) {
    StepInfo step = begin_op("all_reduce", 1, timeout_s);
    all_reduce_oneshot(in, out, desc, step);
  } else {
    StepInfo step = begin_op("all_reduce", 0, timeout_s);
    all_reduce_twoshot(in, out, desc, step);
  }
}

// One round: every rank stages the whole tensor and reduces all of it.
void ShmComm::all_reduce_oneshot(const char* in, char* out, const OpDesc& desc, StepInfo& step) {
  const DType dt = static_cast<DType>(desc.dtype);
  const int64_t nbytes = desc.numel * element_nbytes(dt);
  char* slot = acquire_slot(step);
  copy_bytes(slot, in, nbytes);
  post(&desc);
  wait_posted(step);
  check_descs(step, desc);
  for (int peer = 0; peer < world_size_; ++peer) srcs_[peer] = slot_data(peer, seq_);
  reduce_n(out, srcs_.data(), world_size_, desc.numel, dt, static_cast<RedOp>(desc.redop), world_size_);
  release();
}

// Two rounds per segment: (A) reduce-scatter, each rank stages its copy of the
// other ranks' chunks and reduces its own; (B) all-gather, each rank publishes
// its reduced segment and copies everyone else's.
void ShmComm::all_reduce_twoshot(const char* in, char* out, const OpDesc& desc, StepInfo& step) {
  const DType dt = static_cast<DType>(desc.dtype);
  const int64_t esize = element_nbytes(dt);
  const int64_t part_nbytes = config_.slot_nbytes / world_size_ / 64 * 64;
  const int64_t segment_numel = part_nbytes / esize;
  const Span mine = balanced_chunk(desc.numel, world_size_, rank_);
  const int64_t segments = num_segments(balanced_chunk(desc.numel, world_size_, 0).numel, segment_numel);
  step.num_steps = 2 * segments;
  std::vector<const void*>& srcs = srcs_;
  for (int64_t k = 0; k < segments; ++k) {
    step.step = 2 * k;
    char* slot = acquire_slot(step);
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer == rank_) continue;
      const Span seg = segment_of(balanced_chunk(desc.numel, world_size_, peer), k, segment_numel);
      copy_bytes(slot + peer * part_nbytes, in + seg.begin * esize, seg.numel * esize);
    }
    post(k == 0 ? &desc : nullptr);
    wait_posted(step);
    if (k == 0) check_descs(step, desc);
    const Span own = segment_of(mine, k, segment_numel);
    for (int peer = 0; peer < world_size_; ++peer)
      srcs[peer] = peer == rank_ ? in + own.begin * esize : slot_data(peer, seq_) + rank_ * part_nbytes;

    step.step = 2 * k + 1;
    char* result = acquire_slot(step);
    reduce_n(result, srcs.data(), world_size_, own.numel, dt, static_cast<RedOp>(desc.redop), world_size_);
    release();
    post(nullptr);
    copy_bytes(out + own.begin * esize, result, own.numel * esize);
    wait_posted(step);
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer == rank_) continue;
      const Span seg = segment_of(balanced_chunk(desc.numel, world_size_, peer), k, segment_numel);
      copy_bytes(out + seg.begin * esize, slot_data(peer, seq_), seg.numel * esize);
    }
    release();
  }
}

void ShmComm::reduce_scatter(Output output, Input input, int64_t chunk_numel, int dtype, int redop, double timeout_s) {
  OpScope scope(caller_, state_, "reduce_scatter", rank_);
  const auto windows = lock_windows();
  check_numel("reduce_scatter", chunk_numel);
  const DType dt = to_dtype(dtype);
  to_redop(redop);
  const auto* in = reinterpret_cast<const char*>(input.address);
  auto* out = reinterpret_cast<char*>(output.address);
  const int64_t esize = element_nbytes(dt);
  const OpDesc desc = describe(OpKind::kReduceScatter, dtype, redop, -1, chunk_numel, in,
                               world_size_ * chunk_numel * esize, out, chunk_numel * esize);
  if (desc.access != static_cast<int32_t>(Access::kStaged)) {
    StepInfo step = begin_op("reduce_scatter", 1, timeout_s);
    return reduce_scatter_windows(in, out, desc, step);
  }
  const int64_t part_nbytes = config_.slot_nbytes / world_size_ / 64 * 64;
  const int64_t segment_numel = part_nbytes / esize;
  const int64_t segments = num_segments(chunk_numel, segment_numel);
  StepInfo step = begin_op("reduce_scatter", segments, timeout_s);
  std::vector<const void*>& srcs = srcs_;
  for (int64_t k = 0; k < segments; ++k) {
    step.step = k;
    char* slot = acquire_slot(step);
    const Span seg = segment_of(Span{0, chunk_numel}, k, segment_numel);
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer != rank_)
        copy_bytes(slot + peer * part_nbytes, in + (peer * chunk_numel + seg.begin) * esize, seg.numel * esize);
    }
    post(k == 0 ? &desc : nullptr);
    wait_posted(step);
    if (k == 0) check_descs(step, desc);
    for (int peer = 0; peer < world_size_; ++peer)
      srcs[peer] = peer == rank_ ? in + (rank_ * chunk_numel + seg.begin) * esize : slot_data(peer, seq_) + rank_ * part_nbytes;
    reduce_n(out + seg.begin * esize, srcs.data(), world_size_, seg.numel, dt, static_cast<RedOp>(redop), world_size_);
    release();
  }
}

void ShmComm::all_gather(Output output, Input input, int64_t chunk_numel, int dtype, double timeout_s,
                         const CallKey& key) {
  OpScope scope(caller_, state_, "all_gather", rank_);
  const auto windows = lock_windows();
  check_numel("all_gather", chunk_numel);
  const DType dt = to_dtype(dtype);
  const auto* in = reinterpret_cast<const char*>(input.address);
  auto* out = reinterpret_cast<char*>(output.address);
  const int64_t esize = element_nbytes(dt);
  const OpDesc desc = describe(OpKind::kAllGather, dtype, -1, -1, chunk_numel, in, chunk_numel * esize, out,
                               world_size_ * chunk_numel * esize, key);
  if (desc.access != static_cast<int32_t>(Access::kStaged)) {
    StepInfo step = begin_op("all_gather", 1, timeout_s);
    return all_gather_windows(in, out, desc, step);
  }
  const int64_t segment_numel = config_.slot_nbytes / esize;
  const int64_t segments = num_segments(chunk_numel, segment_numel);
  char* own_out = out + rank_ * chunk_numel * esize;
  StepInfo step = begin_op("all_gather", segments, timeout_s);
  for (int64_t k = 0; k < segments; ++k) {
    step.step = k;
    const Span seg = segment_of(Span{0, chunk_numel}, k, segment_numel);
    char* slot = acquire_slot(step);
    copy_bytes(slot, in + seg.begin * esize, seg.numel * esize);
    post(k == 0 ? &desc : nullptr);
    if (own_out != in) copy_bytes(own_out + seg.begin * esize, in + seg.begin * esize, seg.numel * esize);
    wait_posted(step);
    if (k == 0) check_descs(step, desc);
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer != rank_)
        copy_bytes(out + (peer * chunk_numel + seg.begin) * esize, slot_data(peer, seq_), seg.numel * esize);
    }
    release();
  }
}

void ShmComm::broadcast(uintptr_t buffer, int64_t numel, int dtype, int root, double timeout_s) {
  OpScope scope(caller_, state_, "broadcast", rank_);
  const auto windows = lock_windows();
  check_numel("broadcast", numel);
  const DType dt = to_dtype(dtype);
  if (root < 0 || root >= world_size_)
    throw std::invalid_argument("broadcast: root=" + std::to_string(root) + " outside world_size " + std::to_string(world_size_));
  auto* data = reinterpret_cast<char*>(buffer);
  const int64_t esize = element_nbytes(dt);
  const OpDesc desc = describe(OpKind::kBroadcast, dtype, -1, root, numel, data, numel * esize, nullptr, 0);
  if (desc.access != static_cast<int32_t>(Access::kStaged)) {
    StepInfo step = begin_op("broadcast", 1, timeout_s);
    return broadcast_windows(data, desc, step);
  }
  const int64_t segment_numel = config_.slot_nbytes / esize;
  const int64_t segments = num_segments(numel, segment_numel);
  StepInfo step = begin_op("broadcast", segments, timeout_s);
  for (int64_t k = 0; k < segments; ++k) {
    step.step = k;
    const Span seg = segment_of(Span{0, numel}, k, segment_numel);
    char* slot = acquire_slot(step);
    if (rank_ == root) copy_bytes(slot, data + seg.begin * esize, seg.numel * esize);
    post(k == 0 ? &desc : nullptr);
    wait_posted(step);
    if (k == 0) check_descs(step, desc);
    if (rank_ != root) copy_bytes(data + seg.begin * esize, slot_data(root, seq_), seg.numel * esize);
    release();
  }
}

// Staged like reduce_scatter: each rank writes the chunk for peer p into part p
// of its slot; every rank then copies part `rank_` of each peer's slot.
void ShmComm::all_to_all(Output output, Input input, int64_t chunk_numel, int dtype, double timeout_s,
                         const CallKey& key) {
  OpScope scope(caller_, state_, "all_to_all", rank_);
  const auto windows = lock_windows();
  check_numel("all_to_all", chunk_numel);
  const DType dt = to_dtype(dtype);
  const auto* in = reinterpret_cast<const char*>(input.address);
  auto* out = reinterpret_cast<char*>(output.address);
  const int64_t esize = element_nbytes(dt);
  const int64_t nbytes = world_size_ * chunk_numel * esize;
  if (chunk_numel > 0 && in < out + nbytes && out < in + nbytes)
    throw std::invalid_argument("all_to_all: output and input overlap");
  const OpDesc desc{static_cast<int32_t>(OpKind::kAllToAll), dtype, -1, -1, chunk_numel, 0, -1, 0, -1, 0, 0, 0, key};
  const int64_t part_nbytes = config_.slot_nbytes / world_size_ / 64 * 64;
  const int64_t segment_numel = part_nbytes / esize;
  const int64_t segments = num_segments(chunk_numel, segment_numel);
  StepInfo step = begin_op("all_to_all", segments, timeout_s);
  for (int64_t k = 0; k < segments; ++k) {
    step.step = k;
    char* slot = acquire_slot(step);
    const Span seg = segment_of(Span{0, chunk_numel}, k, segment_numel);
    const int64_t at = seg.begin * esize, seg_nbytes = seg.numel * esize;
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer != rank_) copy_bytes(slot + peer * part_nbytes, in + peer * chunk_numel * esize + at, seg_nbytes);
    }
    post(k == 0 ? &desc : nullptr);
    copy_bytes(out + rank_ * chunk_numel * esize + at, in + rank_ * chunk_numel * esize + at, seg_nbytes);
    wait_posted(step);
    if (k == 0) check_descs(step, desc);
    for (int peer = 0; peer < world_size_; ++peer) {
      if (peer != rank_)
        copy_bytes(out + peer * chunk_numel * esize + at, slot_data(peer, seq_) + rank_ * part_nbytes, seg_nbytes);
    }
    release();
  }
}

void ShmComm::barrier(double timeout_s) {
  OpScope scope(caller_, state_, "barrier", rank_);
  barrier_round("barrier", timeout_s);
}

// One round with no data: every rank has posted everything it wrote before it.
void ShmComm::barrier_round(const char* op, double timeout_s) {
  const OpDesc desc = describe(OpKind::kBarrier, -1, -1, -1, 0, nullptr, 0, nullptr, 0);
  StepInfo step = begin_op(op, 1, timeout_s);
  acquire_slot(step);
  post(&desc);
  wait_posted(step);
  check_descs(step, desc);
  release();
}

}  // namespace ringcomm
