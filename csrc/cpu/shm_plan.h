// Chunk and segment arithmetic of the shared-memory collectives (the C++
// side of ringcomm/plan/schedule.py).
#pragma once

#include <cstdint>

namespace ringcomm {

struct Span {
  int64_t begin;
  int64_t numel;
};

// Chunk `index` of `numel` elements split over `parts` (the first numel %
// parts chunks get one more element); matches ringcomm.plan.schedule.chunk_bounds.
inline Span balanced_chunk(int64_t numel, int parts, int index) {
  const int64_t base = numel / parts, extra = numel % parts;
  return Span{index * base + (index < extra ? index : extra), base + (index < extra ? 1 : 0)};
}

// Segment k of a chunk, `segment_numel` elements each (the last may be short or empty).
inline Span segment_of(Span chunk, int64_t k, int64_t segment_numel) {
  const int64_t offset = k * segment_numel;
  const int64_t left = chunk.numel - offset;
  return Span{chunk.begin + offset, left <= 0 ? 0 : (left < segment_numel ? left : segment_numel)};
}

// Segments needed for `numel` elements; at least one, so that every op has a round.
inline int64_t num_segments(int64_t numel, int64_t segment_numel) {
  return numel <= 0 ? 1 : (numel + segment_numel - 1) / segment_numel;
}

}  // namespace ringcomm
