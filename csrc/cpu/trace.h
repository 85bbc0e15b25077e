// The C++ part of the flight recorder (ringcomm/observe/recorder.py, [Note: flight
// recorder]): the lean calls of one comm, recorded here because Python cannot
// record them within their budget, and the comm's sequence numbers, which the
// Python recorder draws from too so that both parts number one series.
#pragma once

#include <cstdint>
#include <vector>

namespace ringcomm {

enum class TraceState : int32_t { kStarted = 1, kCompleted = 2, kFailed = 3 };

struct TraceEntry {
  int64_t seq;
  int32_t kind;  // OpKind
  int32_t dtype;
  int32_t redop;  // -1: none
  TraceState state;
  int64_t input_numel;
  int64_t output_numel;
  int64_t started_ns;  // CLOCK_REALTIME, as Python's time.time_ns()
  int64_t ended_ns;
};

// Callers hold the GIL (the lean calls record before releasing it and after
// taking it back), so no lock is needed.
class TraceRing {
 public:
  void resize(int64_t capacity);  // 0: off
  int64_t next_seq() { return ++seq_; }
  int64_t seq() const { return seq_; }
  // Records a started call; returns its slot, or -1 when off.
  int64_t begin(int32_t kind, int32_t dtype, int32_t redop, int64_t input_numel, int64_t output_numel);
  void end(int64_t slot, bool ok);
  std::vector<TraceEntry> entries() const;  // oldest first

 private:
  std::vector<TraceEntry> ring_;
  int64_t seq_ = 0;
};

}  // namespace ringcomm
