"""Shared-memory transport: all ranks of the group on one host (csrc/cpu/shm*.cpp).

Segment lifetime: rank 0 creates the segment (mode 0600, a name unique per
group and run), every rank maps it, and rank 0 unlinks the name as soon as all
ranks have mapped it. From then on the memory lives only in the mappings, so
nothing is left in /dev/shm however the processes end. A segment left by a
creator that died during set-up is removed by the next group created on the host.
"""
from __future__ import annotations

import glob
import os
import secrets
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _C
from .process import pid_alive
from ..ops import ReduceOp, dtype_code

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ringcomm-"


@dataclass(frozen=True, slots=True)
class ShmOptions:
    slot_nbytes: int = 1 << 20
    num_slots: int = 4
    oneshot_max_nbytes: int = 64 << 10
    spin_before_yield: int = 4096


class ShmTransport:
    kind = "shm"

    def __init__(self, comm: _C.ShmComm, timeout_s: float) -> None:
        self._comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout_s = timeout_s

    @classmethod
    def create(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float, options: ShmOptions) -> ShmTransport:
        """Collective over the group's ranks: rendezvous through `store`."""
        spin = options.spin_before_yield if world_size <= (os.cpu_count() or 1) else 16
        args = (rank, world_size, options.slot_nbytes, options.num_slots, options.oneshot_max_nbytes, spin)
        if rank != 0:
            name = store.get("shm/name").decode()
            comm = _C.ShmComm(name, *args, create=False)
            store.set(f"shm/attached/{rank}", "1")
            return cls(comm, timeout_s)
        remove_stale_segments()
        name = f"/{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        comm = _C.ShmComm(name, *args, create=True)
        try:
            store.set("shm/name", name)
            _wait_attached(store, world_size, timeout_s)
        finally:
            _C.ShmComm.unlink(name)
        return cls(comm, timeout_s)

    def supports(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def all_reduce(self, input: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> None:
        code = dtype_code(input.dtype, where="all_reduce")
        self._comm.all_reduce(input.data_ptr(), output.data_ptr(), input.numel(), code, int(op), self.timeout_s)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> None:
        code = dtype_code(input.dtype, where="reduce_scatter")
        self._comm.reduce_scatter(input.data_ptr(), output.data_ptr(), output.numel(), code, int(op), self.timeout_s)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> None:
        code = dtype_code(input.dtype, where="all_gather")
        self._comm.all_gather(input.data_ptr(), output.data_ptr(), input.numel(), code, self.timeout_s)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        code = dtype_code(tensor.dtype, where="broadcast")
        self._comm.broadcast(tensor.data_ptr(), tensor.numel(), code, root, self.timeout_s)

    def barrier(self) -> None:
        self._comm.barrier(self.timeout_s)

    def close(self) -> None:
        self._comm = None


def _wait_attached(store: dist.Store, world_size: int, timeout_s: float) -> None:
    keys = [f"shm/attached/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [int(k.rsplit("/", 1)[1]) for k in keys if not store.check([k])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"shm: rank 0 timed out after {timeout_s} s waiting for ranks {missing} to map the segment")
        time.sleep(0.001)


def remove_stale_segments() -> list[str]:
    """Unlink ringcomm segments whose creating process no longer exists."""
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, NAME_PREFIX + "*")):
        pid_text = os.path.basename(path)[len(NAME_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed

