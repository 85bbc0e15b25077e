"""The internal gloo group that runs a ProcessGroupRingcomm's forwarded
collectives, and its release before the interpreter finalizes."""
from __future__ import annotations

import weakref
from datetime import timedelta

import torch.distributed as dist

# [Note: forwarded works at exit]
# A gloo worker thread frees each collective's work after completing it. When
# the caller has already dropped the work's tensors, freeing them takes the GIL;
# once the interpreter finalizes, a thread that takes the GIL is ended with
# pthread_exit, whose unwinding through gloo's noexcept destructor calls
# std::terminate: "terminate called without an active exception", SIGABRT,
# after the script's last line (plain gloo does the same: pytorch/pytorch#190489).
# ProcessGroupGloo has no shutdown: only its destructor stops and joins its
# workers, and the gloo backend registered for "cpu" lives as long as the C++
# process group. So forwarded collectives run on a gloo group that only this
# object holds, and `release` drops it: on shutdown and abort, and at exit
# through weakref.finalize (an atexit hook, run while the interpreter is whole).
# The destructor releases the GIL while it joins, so a worker still freeing a
# work takes the GIL, finishes and ends:
#
#   main thread                          gloo worker
#   work.wait() returns <--------------- marks the work completed
#   drops the tensors                    (not yet run again)
#   script ends; atexit: release()
#     ~ProcessGroupGloo, GIL released -> frees the work (takes the GIL), stops
#     join returns <-------------------- ends
#   Py_FinalizeEx                        (no gloo worker left)
#
# Point-to-point stays on the registered backend: gloo runs send and recv on the
# caller's thread, not on its workers.


class ForwardingGloo:
    """The gloo group of one ProcessGroupRingcomm's forwarded collectives; released
    with `release()`, or at exit or when `owner` is collected, whichever is first."""

    def __init__(self, owner: object, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        self._rank = rank
        self._held = [dist.ProcessGroupGloo(store, rank, world_size, timeout)]  # the only reference
        self._release = weakref.finalize(owner, self._held.clear)  # atexit=True: runs at exit too

    @property
    def backend(self) -> dist.ProcessGroup:
        if not self._held:
            raise RuntimeError(f"forwarded collective: rank {self._rank}: the process group is shut down "
                               f"(its internal gloo group was released)")
        return self._held[0]

    def abort(self) -> None:
        """Aborts the gloo group's calls in flight, then releases it."""
        if self._held:
            self._held[0].abort()
        self.release()

    def release(self) -> None:
        """Drops the gloo group: its destructor joins its workers (see [Note:
        forwarded works at exit]). Idempotent."""
        self._release()
