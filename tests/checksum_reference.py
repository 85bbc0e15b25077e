"""The word sum of csrc/cpu/checksum.h ([Note: word sums]) as its note defines
it, in numpy: the oracle of the kernel's sums (test_host_step.py, cpu_check.py)."""
from __future__ import annotations

import numpy as np


def word_sum(data: bytes, first: int = 0) -> int:
    """Little-endian 32-bit words (the last zero-padded), word i weighted 2i + 1."""
    words = np.frombuffer(data + bytes(-len(data) % 4), dtype="<u4").astype(np.uint64)
    weights = (2 * (np.arange(len(words), dtype=np.uint64) + np.uint64(first)) + np.uint64(1)) % np.uint64(1 << 32)
    plain = int(words.sum()) % (1 << 32)
    weighted = int(((words * weights) % np.uint64(1 << 32)).sum()) % (1 << 32)
    return weighted << 32 | plain
