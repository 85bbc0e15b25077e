"""Handles of asynchronous collectives."""
from __future__ import annotations

import concurrent.futures

import torch


class Work:
    """The result of a collective called with async_op=True (or a finished one).

    Works of one group complete in the order they were launched."""

    def __init__(self, future: concurrent.futures.Future, op: str, rank: int, timing: list[float] | None = None) -> None:
        self._future = future
        self.op = op
        self.rank = rank
        self._timing = timing if timing is not None else []

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
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def get_future(self, value: object = None) -> torch.futures.Future:
        """A torch.futures.Future completed with `value` when this work finishes."""
        fut: torch.futures.Future = torch.futures.Future()

        def forward(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        self._future.add_done_callback(forward)
        return fut
