"""A point-to-point link over any torch.distributed process group (gloo on CPU,
NCCL on CUDA): the group's own send/recv between ring neighbours, each wait
bounded by the group's timeout, and the diagnosis that names the rank behind
a failure. algorithms/flat_ring.py runs the ring over it."""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.host import process_state
from ..plan import schedule
from .lifecycle import CallGate

EXPLAIN_WAIT_S = 0.5
EXPLAIN_STORE_S = 2.0


class PendingTransfer:
    def __init__(self, link: P2PLink, send_work, recv_work, op: str, step: int) -> None:
        self._link, self._send, self._recv, self._op, self._step = link, send_work, recv_work, op, step

    def wait_send(self) -> None:
        if self._send is not None:
            self._link.wait(self._send, self._op, self._step, self._link.sending)

    def wait_recv(self) -> None:
        if self._recv is not None:
            self._link.wait(self._recv, self._op, self._step, self._link.receiving)


class P2PLink:
    """ring.Link over a process group's send/recv (group-local ranks)."""

    def __init__(self, pg: dist.ProcessGroup, timeout_s: float, diagnosis: Diagnosis, gate: CallGate) -> None:
        self.pg = pg
        self.gate = gate
        self.rank, self.world_size = pg.rank(), pg.size()
        self.left = schedule.left(self.rank, self.world_size)
        self.right = schedule.right(self.rank, self.world_size)
        self.timeout = timedelta(seconds=timeout_s)
        self.diagnosis = diagnosis
        self.broken = ""  # after a failure, late messages could pair with new ones: refuse further work
        self.interrupt: Callable[[], str] | None = None  # see TorchDistTransport.stop_when
        self.name_peers()

    def name_peers(self) -> None:
        """What a failed transfer says it was doing, naming the peer's host when known."""
        where = self.diagnosis.where
        self.sending = f"sending to rank {self.right}{where(self.right)}"
        self.receiving = f"receiving from rank {self.left}{where(self.left)}"
        neighbours = ", ".join(f"rank {p}{where(p)}" for p in sorted({self.left, self.right} - {self.rank}))
        self.neighbours = f" (ring neighbours {neighbours})" if neighbours else ""

    def start(self, send: torch.Tensor | None, recv: torch.Tensor | None, *, op: str, step: int) -> PendingTransfer:
        tag = step
        recv_work = send_work = None
        if recv is not None:
            recv_work = self.run(lambda: self.pg.recv([recv], self.left, tag), op, step, self.receiving)
        if send is not None:
            send_work = self.run(lambda: self.pg.send([send], self.right, tag), op, step, self.sending)
        return PendingTransfer(self, send_work, recv_work, op, step)

    def exchange(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int, *, op: str, step: int) -> None:
        """One step of a pairwise exchange: `send` to rank `to` while `recv` comes from `source`."""
        where = self.diagnosis.where
        receiving, sending = f"receiving from rank {source}{where(source)}", f"sending to rank {to}{where(to)}"
        recv_work = self.run(lambda: self.pg.recv([recv], source, step), op, step, receiving)
        send_work = self.run(lambda: self.pg.send([send], to, step), op, step, sending)
        self.wait(recv_work, op, step, receiving)
        self.wait(send_work, op, step, sending)

    def wait(self, work: dist.Work, op: str, step: int, what: str) -> None:
        self.run(lambda: work.wait(self.timeout), op, step, what)

    def run(self, call, op: str, step: int, what: str):
        """Runs a process-group call; its failure becomes a RuntimeError naming op, step and peers."""
        self.gate.check(op, step, self.world_size - 1)
        if self.interrupt is not None and (why := self.interrupt()):
            self.broken = (f"{op}: rank {self.rank} at step {step}/{self.world_size - 1} stopped before {what}: "
                           f"{why}")
            raise RuntimeError(self.broken)
        try:
            return call()
        except Exception as err:  # gloo/NCCL raise RuntimeError or DistBackendError
            message = (f"{op}: rank {self.rank} at step {step}/{self.world_size - 1} failed {what} "
                       f"(timeout {self.timeout.total_seconds()} s): {err}")
            self.broken = message
            raise RuntimeError(message + self.diagnosis.explain(message)) from err


class Diagnosis:
    """Names the rank behind a failure: each rank leaves its host and pid in the
    group's store at start-up and a line there when it fails, so a rank whose
    neighbour merely stopped answering can still name the rank that died."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.host = socket.gethostname()
        self.peer_hosts: dict[int, str] = {}
        if store is not None:
            store.set(f"proc/{rank}", f"{self.host}:{os.getpid()}")

    def learn_hosts(self, peers: list[int]) -> None:
        """Reads the hosts of `peers` now, while the store answers (set-up, after
        every rank checked in), so that a failure names them without the store."""
        if self.store is not None:
            for peer in peers:
                self.peer_hosts[peer] = self.store.get(f"proc/{peer}").decode().rsplit(":", 1)[0]

    def where(self, peer: int) -> str:
        """ " on host 'name'" for a peer whose host is known, else ""."""
        return f" on host {self.peer_hosts[peer]!r}" if peer in self.peer_hosts else ""

    def explain(self, message: str, wait_s: float = EXPLAIN_WAIT_S, store_s: float = EXPLAIN_STORE_S) -> str:
        """Notes naming the peers behind a failure. A killed peer's sockets close
        while the kernel is still tearing it down, and a peer blocked on a third
        rank reports later, so the notes are polled for up to `wait_s` before
        nothing is said. The store may sit across the link that failed, where its
        calls block: they run on a thread of their own, waited for at most
        `store_s` more."""
        if self.store is None:
            return ""
        notes: list[list[str]] = []
        thread = self.start(message, wait_s, notes)
        thread.join(wait_s + store_s)
        if not notes:
            return (f"; (the store did not answer within {wait_s + store_s} s: its host may be "
                    f"unreachable)")
        return "; " + "; ".join(notes[0]) if notes[0] else ""

    def start(self, message: str, wait_s: float = 0.0, notes: list | None = None) -> threading.Thread:
        """Leaves `message` in the store and polls for notes, on a thread of its
        own (its store calls may block); appends them to `notes`."""
        found = [] if notes is None else notes
        thread = threading.Thread(target=lambda: found.append(self._poll_notes(message, wait_s)), daemon=True,
                                  name=f"ringcomm-diagnosis-r{self.rank}")
        thread.start()
        return thread

    def _poll_notes(self, message: str, wait_s: float) -> list[str]:
        try:
            self.store.set(f"failure/{self.rank}", message)
            deadline = time.monotonic() + wait_s
            while True:
                notes = self._notes()
                if notes:
                    return notes
                if time.monotonic() > deadline:
                    return [self._silence()] if self.world_size > 1 else []
                time.sleep(0.01)
        except Exception as err:  # the store may have died with its host rank
            return [f"(store unreachable: {err})"]

    def _silence(self) -> str:
        """The note when no peer said anything: who could be unreachable or dead."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        where = ", ".join(f"rank {p} on host {h!r} (pid {pid})" for p in peers
                          for h, pid in [self.store.get(f"proc/{p}").decode().rsplit(":", 1)])
        return f"no peer reported a failure: {where} may be unreachable, stopped or dead"

    def _notes(self) -> list[str]:
        notes = []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            host, pid = self.store.get(f"proc/{peer}").decode().rsplit(":", 1)
            state = process_state(int(pid)) if host == self.host else None
            if state == "exited":
                notes.append(f"rank {peer} (pid {pid}) has exited")
            elif self.store.check([f"failure/{peer}"]):
                notes.append(f"rank {peer} reported: {self.store.get(f'failure/{peer}').decode()}")
            elif state == "stopped":
                notes.append(f"rank {peer} (pid {pid}) is stopped")
        return notes


