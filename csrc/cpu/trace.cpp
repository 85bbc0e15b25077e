// The flight recorder's ring of lean calls (trace.h).
#include "trace.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <ctime>
#include <memory>
#include <stdexcept>
#include <tuple>

#include "module_lean.h"
#include "shm.h"

namespace ringcomm {
namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

TraceRing& ring_of(pybind11::capsule handle) {
  auto* comm = static_cast<std::shared_ptr<ShmComm>*>(PyCapsule_GetPointer(handle.ptr(), kCommCapsule));
  if (comm == nullptr) throw pybind11::error_already_set();
  return (*comm)->trace();
}

}  // namespace

void TraceRing::resize(int64_t capacity) {
  if (capacity < 0) throw std::invalid_argument("trace: capacity " + std::to_string(capacity) + " < 0");
  ring_.assign(static_cast<size_t>(capacity), TraceEntry{0, 0, 0, -1, TraceState::kStarted, 0, 0, 0, 0});
}

int64_t TraceRing::begin(int32_t kind, int32_t dtype, int32_t redop, int64_t input_numel, int64_t output_numel) {
  if (ring_.empty()) return -1;
  const int64_t seq = ++seq_;
  const int64_t slot = seq % static_cast<int64_t>(ring_.size());
  ring_[slot] = TraceEntry{seq, kind, dtype, redop, TraceState::kStarted, input_numel, output_numel, now_ns(), 0};
  return slot;
}

void TraceRing::end(int64_t slot, bool ok) {
  if (slot < 0) return;
  TraceEntry& entry = ring_[slot];
  entry.state = ok ? TraceState::kCompleted : TraceState::kFailed;
  entry.ended_ns = now_ns();
}

std::vector<TraceEntry> TraceRing::entries() const {
  std::vector<TraceEntry> kept;
  for (const TraceEntry& entry : ring_)
    if (entry.seq > 0) kept.push_back(entry);
  std::sort(kept.begin(), kept.end(), [](const TraceEntry& a, const TraceEntry& b) { return a.seq < b.seq; });
  return kept;
}

void add_trace_functions(pybind11::module_& m) {
  m.def("_trace_resize", [](pybind11::capsule handle, int64_t capacity) { ring_of(handle).resize(capacity); },
        "keeps the last `capacity` lean calls of the comm (0: none)");
  m.def("_trace_next_seq", [](pybind11::capsule handle) { return ring_of(handle).next_seq(); },
        "the comm's next sequence number, for a call the Python recorder records");
  m.def(
      "_trace_entries",
      [](pybind11::capsule handle) {
        std::vector<std::tuple<int64_t, int32_t, int32_t, int32_t, int32_t, int64_t, int64_t, int64_t, int64_t>> out;
        for (const TraceEntry& e : ring_of(handle).entries())
          out.emplace_back(e.seq, e.kind, e.dtype, e.redop, static_cast<int32_t>(e.state), e.input_numel,
                           e.output_numel, e.started_ns, e.ended_ns);
        return out;
      },
      "(seq, kind, dtype, redop, state, input_numel, output_numel, started_ns, ended_ns) of the lean calls kept");
}

}  // namespace ringcomm
