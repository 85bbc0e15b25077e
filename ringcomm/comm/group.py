"""Groups: a set of ranks, the transport that connects them, and the comm
thread that runs their asynchronous collectives in launch order."""
from __future__ import annotations

import concurrent.futures
import enum
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..algorithms.choice import open_transport
from ..algorithms.flat_ring import TorchDistOptions
from ..core.ops import ReduceOp
from ..observe import profiling, recorder as recorder_mod
from ..transport.base import Transport
from ..transport.placement import Placement, exchange_hosts, plan_placement
from ..transport.shm import ShmOptions
from .work import Work

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class GroupOptions:
    transport: str = "auto"  # RINGCOMM_TRANSPORT in the environment overrides it
    timeout_s: float = DEFAULT_TIMEOUT_S
    shm: ShmOptions = field(default_factory=ShmOptions)
    torch_dist: TorchDistOptions = field(default_factory=TorchDistOptions)


class GroupState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    ABORTED = "aborted"


class Group:
    """Ranks 0..world_size-1 of a ringcomm group and how they talk.

    [Note: one caller thread] A group's collectives must be issued in the same
    order on every rank, so one thread at a time issues them (as with NCCL
    communicators). A call from a second thread while the first one's calls are
    still in flight (inline or queued on the comm thread) is refused with a
    RuntimeError; handing a group from one thread to another between calls is
    fine. Races that leave no call in flight on this rank cannot be seen here.
    """

    def __init__(self, transport: Transport, global_ranks: tuple[int, ...], placement: Placement, *,
                 owned_pg: dist.ProcessGroup | None = None) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.timeout_s = transport.timeout_s
        self.global_ranks = global_ranks
        self.placement = placement  # the host of each group rank, exchanged once at set-up
        self._owned_pg = owned_pg  # shut down with the group
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._comm_thread: int | None = None  # its thread's ident, once it ran a call
        self._last: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._state = GroupState.OPEN
        self._caller = 0  # the ident of the thread with calls in flight: see [Note: one caller thread]
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)  # notified when _in_flight drops to 0 (close waits on it)
        # The transport's handle for lean calls (collectives.py), or None while
        # they must not run inline: the transport has none, work is queued on the
        # comm thread, or the group is closed.
        self.lean_handle = transport.handle
        self._idle_handle = self.lean_handle
        self.recorder = recorder_mod.for_group(self.rank, self.world_size, global_ranks, transport.kind,
                                               self.timeout_s, self._idle_handle)
        if self.recorder is not None and self.recorder.stacks:  # the lean path records no Python stack
            self.lean_handle = self._idle_handle = None

    def run(self, op: str, fn: Callable[[], None], async_op: bool, *, inputs: Sequence[torch.Tensor] = (),
            outputs: Sequence[torch.Tensor] = (), redop: ReduceOp | None = None) -> Work | None:
        """Runs a collective: inline when nothing is queued and the caller waits,
        else on the group's comm thread after everything launched before it.
        `inputs`, `outputs` and `redop` describe it to the flight recorder and
        the profiler ([Note: flight recorder], [Note: profiler events])."""
        inline = self._enter(op, async_op)
        entry = self.recorder and self.recorder.record(op, inputs, outputs, redop, "started" if inline else "queued")
        event = profiling.Event(op, inputs, seq=entry[recorder_mod.SEQ] if entry else 0, group_size=self.world_size) \
            if profiling.active() else None
        if inline:
            try:
                fn()
            except Exception as err:
                raise self.failed(entry, err) from None
            finally:
                with self._lock:
                    self._left()
                if event is not None:
                    event.end()
            if entry is not None:
                recorder_mod.completed(entry)
            return None
        work = self._submit(op, fn, entry, event)
        if not async_op:
            work.wait()
            return None
        return work

    def run_lean(self, op: str, fn: Callable[[], None], inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor]) -> bool:
        """The lean path's inline call ([Note: lean path]): `fn` here, with run()'s
        bookkeeping (in flight, the flight recorder); False, running nothing, when
        the group takes no lean calls now (work queued, closed, a profiler on)."""
        if self.lean_handle is None or profiling.active():
            return False
        with self._lock:
            if self.lean_handle is None:  # work queued or the group closed since the read above
                return False
            self._claim(op)
        entry = None if self.recorder is None else self.recorder.record(op, inputs, outputs, None, "started")
        try:
            fn()
        except Exception as err:
            raise self.failed(entry, err) from None
        finally:
            # No lock: while this call is in flight nothing else changes the count
            # (other threads are refused above, nothing is queued to finish). A
            # close that began meanwhile waits for it: wake it (the decrement
            # comes first, so a close that sets the state later sees it).
            self._in_flight -= 1
            if self._state is not GroupState.OPEN:
                with self._lock:
                    self._idle.notify_all()
        if entry is not None:
            recorder_mod.completed(entry)
        return True

    def _submit(self, op: str, fn: Callable[[], None], entry: list | None, event: profiling.Event | None) -> Work:
        """Queues `fn` on the comm thread; its entry and event follow it there."""
        timing: list[float] = []

        def timed() -> None:
            self._comm_thread = threading.get_ident()
            timing.append(time.perf_counter())
            if entry is not None:
                recorder_mod.started(entry)
            try:
                if self._state is GroupState.ABORTED:
                    raise RuntimeError(f"{op}: rank {self.rank}: aborted before it started ({self!r})")
                fn()
            except BaseException as err:
                self.failed(entry, err)
                raise
            finally:
                timing.append(time.perf_counter())
                if event is not None:
                    event.end()
            if entry is not None:
                recorder_mod.completed(entry)

        with self._lock:
            if self._executor is None:
                if self._state is not GroupState.OPEN:
                    # close() or abort() took the comm thread while this call passed
                    # _enter: a second comm thread would race the first one's calls.
                    self._left()
                    raise self.failed(entry, RuntimeError(f"{op}: rank {self.rank}: the group is "
                                                          f"{self._state.value} ({self!r})"))
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ringcomm-r{self.rank}")
            future = self._executor.submit(timed)
            self._last = future
            self.lean_handle = None
        future.add_done_callback(self._finished)
        return Work(future, op, self.rank, timing)

    def failed(self, entry: list | None, err: BaseException) -> BaseException:
        """Marks `entry` failed, dumps the flight recorder; returns `err` (explained)."""
        if isinstance(err, RuntimeError):
            err = self.explain(err)
        if entry is not None:
            recorder_mod.failed(entry, err)
        if self.recorder is not None:
            recorder_mod.dump(f"failed on group rank {self.rank}: {str(err).splitlines()[0][:200]}")
        return err

    def explain(self, err: RuntimeError) -> RuntimeError:
        """`err` with the kernel thread ids the transport names (its check of
        [Note: one caller thread]) replaced by thread names."""
        message = str(err)
        if "thread id" not in message:
            return err
        names = {t.native_id: t.name for t in threading.enumerate()}
        def name(match: re.Match) -> str:
            return f"thread {names[int(match[1])]!r}" if int(match[1]) in names else match[0]

        return RuntimeError(re.sub(r"thread id (\d+)", name, message))

    def _enter(self, op: str, async_op: bool) -> bool:
        """Checks that the group is open and not in use by another thread; counts
        the call in flight. Returns whether it runs inline."""
        with self._lock:
            if self._state is not GroupState.OPEN:
                raise RuntimeError(f"{op}: rank {self.rank}: the group is {self._state.value} ({self!r})")
            self._claim(op)
            return not async_op and self._last is None

    def _claim(self, op: str) -> None:
        """Under the lock: refuses a call from a second thread while the first
        has calls in flight ([Note: one caller thread]); counts this one."""
        caller = threading.get_ident()
        if self._in_flight and self._caller != caller:
            names = {t.ident: t.name for t in threading.enumerate()}
            raise RuntimeError(
                f"{op}: rank {self.rank}: called from thread {names.get(caller, caller)!r} while thread "
                f"{names.get(self._caller, self._caller)!r} has {self._in_flight} collective(s) in flight on {self!r}; "
                f"a group's collectives must come from one thread at a time, in the same order on every rank (use "
                f"one group per thread)")
        self._caller = caller
        self._in_flight += 1

    def _left(self) -> None:
        """Under the lock: a call left; wakes a close waiting for the last one."""
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.notify_all()

    def _finished(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._left()
            if self._last is future:
                self._last = None
                if self._state is GroupState.OPEN:
                    self.lean_handle = self._idle_handle

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Collective: a 1-D tensor that this group's collectives can use without
        staging copies (shared memory on the shm transport; plain memory elsewhere)."""
        result: list[torch.Tensor] = []
        self.run("allocate", lambda: result.append(self.transport.allocate(numel, dtype)), async_op=False)
        return result[0]

    # [Note: group lifetime] close, abort and the default groups.
    # close(t): new calls are refused ("closed"); the calls queued on the comm
    #   thread and the one in flight inline (every call past the open check,
    #   which the flight recorder shows started) may finish, for up to t seconds
    #   (the group's timeout by default); what is left then is aborted. Then the
    #   transport, the comm thread and any process group made for the group are
    #   released. As ProcessGroup.shutdown.
    # abort(): new calls are refused ("aborted"); the call in flight fails at once
    #   (shm: at its next wait; torch_dist: at its next transfer, see [Note:
    #   torch_dist abort]) and queued calls fail without starting, each Work with
    #   a RuntimeError naming its op and "aborted". As ProcessGroup.abort.
    # Both may come from any thread, at any moment, more than once; a running
    # call keeps what it uses alive ([Note: close and abort] in shm_lifecycle.cpp).
    # A peer waiting on a rank that closed or aborted fails at once, naming it.
    def close(self, timeout_s: float | None = None) -> None:
        """See [Note: group lifetime]. Idempotent; safe from any thread."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self._stop(GroupState.CLOSED)
        on_comm_thread = threading.get_ident() == self._comm_thread  # from a Work's callback, say
        if not on_comm_thread:
            # The transport and the comm thread are closed only once the calls past
            # _enter have left: closed first, they would refuse one not yet queued.
            with self._lock:
                drained = self._idle.wait_for(lambda: not self._in_flight, timeout_s)
            if not drained:
                self._abort_transport()
        executor = self._take_executor()
        if executor is not None:
            executor.shutdown(wait=not on_comm_thread)
        self.transport.close(max(deadline - time.monotonic(), 0.0))
        self._release_pg()

    def abort(self) -> None:
        """See [Note: group lifetime]. Idempotent; safe from any thread."""
        self.transport.abort()  # first: a group seen aborted has its call in flight failing
        self._stop(GroupState.ABORTED)
        executor = self._take_executor()
        if executor is not None:
            executor.shutdown(wait=False)  # the rest fails without starting; the thread then ends
        self._release_pg()

    @property
    def state(self) -> GroupState:
        return self._state

    def _stop(self, state: GroupState) -> None:
        """Refuses new calls."""
        with self._lock:
            if self._state is GroupState.OPEN or state is GroupState.ABORTED:
                self._state = state
            self.lean_handle = self._idle_handle = None

    def _take_executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """Hands over the comm thread; calls not yet queued are refused from now on."""
        with self._lock:
            executor, self._executor = self._executor, None
            return executor

    def _abort_transport(self) -> None:
        self.transport.abort()
        with self._lock:
            self._state = GroupState.ABORTED

    def _release_pg(self) -> None:
        with self._lock:
            pg, self._owned_pg = self._owned_pg, None
        if pg is not None:
            pg.shutdown()

    def __repr__(self) -> str:
        state = "" if self._state is GroupState.OPEN else f", {self._state.value}"
        return (f"ringcomm.Group(rank={self.rank}, world_size={self.world_size}, "
                f"transport={self.transport.kind}{state})")


def create_group(store: dist.Store, rank: int, world_size: int, *, options: GroupOptions,
                 global_ranks: tuple[int, ...] | None = None) -> Group:
    """Collective: the group's hosts, then its transport, through `store` (private to this group)."""
    recorder_mod.agree_run_id(store)  # [Note: run id]
    placement = plan_placement(exchange_hosts(store, rank, world_size, options.timeout_s))
    transport, pg = open_transport(store, rank, placement, kind=options.transport, timeout_s=options.timeout_s,
                                   shm=options.shm, torch_dist=options.torch_dist)
    return Group(transport, global_ranks or tuple(range(world_size)), placement, owned_pg=pg)
