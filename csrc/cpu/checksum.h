// The checksum of the in-memory snapshots' shard files.
#pragma once

#include <cstdint>

namespace ringcomm {

// [Note: word sums]
// The in-memory snapshots checksum each tensor of their shard files while the
// optimizer step writes it, from the values in registers
// (zero/checkpoint/snapshot.py): a CRC cannot be cut into parts that threads
// compute apart and add, and no library offers one inside another kernel. The
// word sum can: with w_i the i-th little-endian 32-bit word of the bytes (the
// last zero-padded),
//   plain    = sum of w_i           mod 2^32
//   weighted = sum of (2i + 1) w_i  mod 2^32
//   value    = weighted * 2^32 + plain.
// Each sum adds terms that depend only on a word and its index, so any split
// of the bytes gives the same value. Any change within one word (a flipped
// bit or byte) changes plain; two words swapped change weighted (its weights
// are odd, so invertible mod 2^32). It is a check against damage, as crc32 is
// in the disk checkpoints, not against an adversary.
struct WordSum {
  uint32_t plain = 0, weighted = 0;

  void add(const WordSum& other) {
    plain += other.plain;
    weighted += other.weighted;
  }
  uint64_t value() const { return (static_cast<uint64_t>(weighted) << 32) | plain; }
};

// The word sum of nbytes at data (any size), whose first word is word `first`
// of what is summed: the sums of consecutive pieces add up (WordSum::add) to
// the sum of the whole.
uint64_t word_sum(const void* data, int64_t nbytes, int64_t first);

}  // namespace ringcomm
