// What a process on this host is doing: the one judgement of a peer's pid,
// used by the shared-memory transport (shm_trust.cpp) and, through
// ringcomm._C.process_state, by ringcomm/core/host.py.
#pragma once

#include <cstdint>

namespace ringcomm {

// The values are ringcomm.core.host.PROCESS_STATES' indices.
enum class ProcessState : int { kRunning = 0, kStopped = 1, kExited = 2 };

// kExited: gone (ESRCH) or a zombie its parent has not reaped; kStopped:
// SIGSTOP or traced; kRunning otherwise, also where /proc does not say, and
// for a value that is not a pid (not judged).
ProcessState process_state(int64_t pid);

}  // namespace ringcomm
