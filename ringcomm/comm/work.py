"""Handles of asynchronous collectives."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch


class Work:
    """The result of a collective called with async_op=True (or a finished one).

    Works of one group complete in the order they were launched."""

    def __init__(self, future: concurrent.futures.Future, op: str, rank: int, timing: list[float] | None = None) -> None:
        self._future = future
        self.op = op
        self.rank = rank
        self._timing = timing if timing is not None else []
        self._torch_futures: list[torch.futures.Future] = []  # from get_future(), completed by callbacks

    @property
    def started_at(self) -> float | None:
        """time.perf_counter() when the comm thread began the collective (None before)."""
        return self._timing[0] if self._timing else None

    @property
    def finished_at(self) -> float | None:
        """time.perf_counter() when the collective ended (None before)."""
        return self._timing[1] if len(self._timing) > 1 else None

    @classmethod
    def completed(cls, op: str, rank: int) -> Work:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(None)
        return cls(future, op, rank)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the collective finished; re-raises its error. `timeout`
        in seconds (None: the group's own timeout bounds the wait)."""
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"{self.op}: rank {self.rank}: Work.wait timed out after {timeout} s") from None
        for future in self._torch_futures:
            future.wait()  # their done callbacks may still be running
        return True

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` once the collective finished, failed or not (on the
        comm thread; at once when it already has). Cheaper than get_future()."""
        self._future.add_done_callback(lambda _done: callback())

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        """False once the collective failed (and while it runs: True, as torch's Work)."""
        return self.exception() is None

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def get_future(self, value: object = None) -> torch.futures.Future:
        """A torch.futures.Future completed with `value` when this work finishes,
        or failed with its error (see [Note: torch futures])."""
        source: torch.futures.Future = torch.futures.Future()

        def forward(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is not None:
                source.set_exception(error)
            else:
                source.set_result(value)

        self._future.add_done_callback(forward)
        future = source.then(_value_or_raise)
        self._torch_futures.append(future)
        return future


# [Note: torch futures]
# torch.futures.Future.set_exception records the error on the Python side only
# (an unwrap function): C++ readers of that future (the Work made from it, DDP's
# reducer, FSDP) see success and an exception object for a value. A future
# completed by a `then` callback that raises carries a real error, which every
# reader sees.
def _value_or_raise(source: torch.futures.Future) -> object:
    return source.value()


def completed_future(value: object) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future
