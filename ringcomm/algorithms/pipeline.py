"""The hierarchical transport's pipeline: a large call in pieces, each piece's
cross-host step on a thread of its own while the local steps of the pieces
around it run on the caller's thread.

[Note: hierarchical pipeline] The link across hosts is the bottleneck; run
before and after it, the local steps would add their time to the link's. So a
call runs in pieces, and piece k's cross-host step (C) runs on the cross
thread while this thread does the local steps before (B) of the next pieces
(up to AHEAD of them) and after (A) of the last ones:

  this thread:  B0 B1 B2 .. A0 B3 .. A1 ... A2 ... A3
  cross thread:    C0.......C1.......C2.......C3.......

Every rank does its local steps in that same order, and each ring runs its
pieces in order on one thread, so the two levels never wait on each other in
a cycle. The cross thread holds the next pieces, so the link does not wait
for this thread even when it is scheduled late (cores shared with other
work). A failure at either level still aborts both (the caller's step
context); the call returns only once the cross thread is done with its
buffers.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

PIECE_NBYTES = 1 << 20  # a pipelined call's pieces: at least this much of the full buffer each
MAX_PIECES = 64
AHEAD = 2  # pieces whose local steps before may run ahead of the cross thread


@dataclass(frozen=True, slots=True)
class Stages:
    """One call's steps per piece k: before(k) and after(k) here (local steps),
    across(k) on the cross thread; failures named `op` step `cross_step`."""

    op: str
    cross_step: int
    cross_what: str
    before: Callable[[int], None] | None
    across: Callable[[int], None]
    after: Callable[[int], None]


def num_pieces(nbytes: int) -> int:
    """How many pieces a call on a full buffer of `nbytes` runs in."""
    return max(1, min(MAX_PIECES, nbytes // PIECE_NBYTES))


def pieces(numel: int, count: int) -> list[tuple[int, int]]:
    """`count` element ranges covering 0..numel, the first ones one longer."""
    base, extra = divmod(numel, count)
    starts = [k * base + min(k, extra) for k in range(count + 1)]
    return [(starts[k], starts[k + 1]) for k in range(count)]


class Pipeline:
    """Runs Stages over a call's pieces ([Note: hierarchical pipeline]).
    `step(op, step, what)` is the caller's failure context for one step;
    `abort()` makes the cross thread's calls fail at their next transfer."""

    def __init__(self, rank: int, step: Callable[[str, int, str], contextlib.AbstractContextManager],
                 abort: Callable[[], None], timeout_s: float) -> None:
        self.rank, self._step, self._abort, self.timeout_s = rank, step, abort, timeout_s
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, stages: Stages, count: int, bound_s: float) -> None:
        """All `count` pieces; a cross-host step of one piece may take bound_s."""
        if count == 1:  # nothing to overlap: no thread hop
            if stages.before:
                stages.before(0)
            with self._step(stages.op, stages.cross_step, stages.cross_what):
                stages.across(0)
            stages.after(0)
            return
        pending: list[concurrent.futures.Future] = []  # a piece leaves it once its cross step is done
        try:
            for k in range(count):
                if stages.before:
                    stages.before(k)
                pending.append(self._thread().submit(stages.across, k))
                if k >= AHEAD:
                    self._finish(stages, k - AHEAD, pending, bound_s)
            for k in range(max(0, count - AHEAD), count):
                self._finish(stages, k, pending, bound_s)
        except BaseException:
            _, running = concurrent.futures.wait(pending, timeout=len(pending) * (self.timeout_s + 1))
            if running:  # the cross thread still uses this call's buffers: make its calls fail
                self._abort()
                concurrent.futures.wait(running, timeout=len(running) * (self.timeout_s + 1))
            raise

    def _finish(self, stages: Stages, k: int, pending: list[concurrent.futures.Future], bound_s: float) -> None:
        """Waits for piece k's cross step (pending[0]) and runs its step after. The
        piece leaves `pending` only once its cross step is done: one that fails
        or times out stays there, for run()'s cleanup to wait for or abort."""
        what = f"{stages.cross_what} of piece {k}"
        with self._step(stages.op, stages.cross_step, what):
            try:
                pending[0].result(timeout=bound_s)
            except concurrent.futures.TimeoutError as err:
                raise RuntimeError(f"{stages.op}: rank {self.rank}: {what} took over {bound_s} s") from err
        pending.pop(0)
        stages.after(k)

    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ringcomm-cross-r{self.rank}")
        return self._pool

    def shutdown(self) -> None:
        """No more pieces; the thread ends with its last one."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
