"""How a transport written in Python stops: the calls in flight, close and abort
(the shm transport does the same in C++: [Note: close and abort] in
csrc/cpu/shm_lifecycle.cpp)."""
from __future__ import annotations

import contextlib
import enum
import threading
import traceback
from collections.abc import Callable, Iterator


class State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    ABORTED = "aborted"


class CallGate:
    """Counts a transport's calls in flight and refuses new ones once it closes.

    close(t) refuses new calls and waits up to t seconds for those in flight,
    then aborts them; abort() makes each fail at its next check (a transfer
    boundary: a blocked gloo send/recv cannot be interrupted, see [Note: torch_dist
    abort] in algorithms/flat_ring.py). `release` (given to close/abort) runs once no call
    is in flight: at once, or when the last one leaves.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._cond = threading.Condition()
        self._in_flight = 0
        self._state = State.OPEN
        self._release: Callable[[], None] | None = None
        self._released = False

    @contextlib.contextmanager
    def call(self, op: str) -> Iterator[None]:
        with self._cond:
            if self._state is not State.OPEN:
                raise RuntimeError(f"{op}: rank {self.rank}: the group is {self._state.value}")
            self._in_flight += 1
        try:
            yield
        except BaseException as err:
            # The failed call's frames hold its process-group Works, which keep the
            # group's connections open after close releases it: a peer blocked on
            # this rank would wait for its timeout instead of failing at once.
            _clear_frames(err)
            raise
        finally:
            with self._cond:
                self._in_flight -= 1
                release = self._take_release()
                self._cond.notify_all()
            if release is not None:
                release()

    def check(self, op: str, step: int, num_steps: int) -> None:
        """Raises once the transport was aborted: between the transfers of a call."""
        if self._state is State.ABORTED:
            raise RuntimeError(f"{op}: rank {self.rank} at step {step}/{num_steps}: aborted (the group was aborted, "
                               f"or closed past its timeout, from another thread)")

    def close(self, timeout_s: float, release: Callable[[], None]) -> bool:
        """Returns whether the calls in flight ended by themselves within timeout_s."""
        with self._cond:
            if self._state is State.OPEN:
                self._state = State.CLOSING
            drained = self._cond.wait_for(lambda: self._in_flight == 0, timeout_s)
            if self._state is State.CLOSING:
                self._state = State.CLOSED if drained else State.ABORTED
        self._release_when_idle(release)
        return drained

    def abort(self, release: Callable[[], None]) -> None:
        with self._cond:
            if self._state is not State.CLOSED:
                self._state = State.ABORTED
        self._release_when_idle(release)

    def _release_when_idle(self, release: Callable[[], None]) -> None:
        with self._cond:
            if self._release is None and not self._released:
                self._release = release
            now = self._take_release()
        if now is not None:
            now()

    def _take_release(self) -> Callable[[], None] | None:
        """The release to run now (once, with no call in flight); call with the lock held."""
        if self._in_flight or self._release is None:
            return None
        release, self._release = self._release, None
        self._released = True
        return release


def _clear_frames(err: BaseException) -> None:
    """Drops the locals of the finished frames in `err`'s traceback and in those of
    its causes (the traceback still names every line)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
