"""NVMe swap files and their I/O: one private file per rank and run, read and
written from page-aligned host buffers by a pool of threads (direct I/O where
the filesystem allows it).

[Note: swap files]
A swap file is created 0600 and exclusive under nvme_path, named with the rank,
the pid and a random run id, and unlinked at once: from then on it exists only
as this process's open descriptor, so the kernel frees its blocks when the
process exits, however it exits (a clean exit, an exception, SIGKILL). A killed
run leaves no file behind, so nothing a new run could take for valid state;
state meant to outlive a run goes to checkpoints. Space is reserved up front
(posix_fallocate), so a full or read-only nvme_path fails at start-up, with the
key and the path in the message, and never in the middle of a step.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .config import AioOptions


ALIGN = 4096  # direct I/O alignment of offsets, sizes and buffer addresses (the page size covers every device)


def round_up(nbytes: int, multiple: int = ALIGN) -> int:
    return -(-nbytes // multiple) * multiple


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 host tensor of round_up(nbytes) bytes (anonymous
    mmap: direct I/O needs aligned addresses, and the memory goes back to the OS
    when the tensor dies)."""
    buffer = mmap.mmap(-1, max(ALIGN, round_up(nbytes)))
    return torch.frombuffer(buffer, dtype=torch.uint8)  # holds a reference to the mmap


class SwapFile:
    """A private, already-unlinked file of `nbytes` reserved bytes; see [Note: swap files]."""

    def __init__(self, directory: str, label: str, nbytes: int, *, key: str) -> None:
        self.key, self.directory, self.nbytes = key, directory, round_up(nbytes)
        if not os.path.isdir(directory):
            raise ValueError(f"zero config: {key} {directory!r} is not a directory")
        path = os.path.join(directory, f"zero-swap-{label}-pid{os.getpid()}-{secrets.token_hex(6)}.bin")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd, self.direct = os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as error:
            if error.errno != errno.EINVAL:  # EINVAL: the filesystem has no direct I/O (tmpfs)
                raise ValueError(f"zero config: {key} {directory!r}: cannot create a swap file: "
                                 f"{error.strerror} (errno {error.errno})") from None
            self.fd, self.direct = os.open(path, flags, 0o600), False
        os.unlink(path)
        try:
            if self.nbytes:
                os.posix_fallocate(self.fd, 0, self.nbytes)
            self._probe_direct_io()
        except OSError as error:
            os.close(self.fd)
            raise ValueError(f"zero config: {key} {directory!r}: cannot reserve {self.nbytes} bytes for "
                             f"{label}: {error.strerror} (errno {error.errno})") from None

    def _probe_direct_io(self) -> None:
        """Some filesystems accept O_DIRECT at open and refuse it at the first
        transfer: find out now, and fall back to buffered I/O."""
        if not self.direct or not self.nbytes:
            return
        probe = aligned_empty(ALIGN).numpy()
        try:
            os.preadv(self.fd, [probe], 0)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class Transfer:
    """The requests of one read or write; wait() raises the first failure."""

    def __init__(self, futures: list[Future], what: str) -> None:
        self.futures, self.what = futures, what

    def wait(self) -> None:
        for future in self.futures:
            error = future.exception()
            if error is not None:
                raise RuntimeError(f"zero nvme: {self.what} failed: {error}") from error
        self.futures = []

    def done(self) -> bool:
        return all(future.done() for future in self.futures)


class IOPool:
    """aio.thread_count threads moving aio.block_size requests with
    pread/pwrite (the GIL is released in the system call)."""

    def __init__(self, aio: AioOptions) -> None:
        self.block_size = aio.block_size
        self.executor = ThreadPoolExecutor(aio.thread_count, thread_name_prefix="zero-nvme")

    def read(self, file: SwapFile, offset: int, buffer: torch.Tensor) -> Transfer:
        """Fills uint8 `buffer` from `file` at byte `offset`."""
        return self._submit(file, offset, buffer, os.preadv, "read")

    def write(self, file: SwapFile, offset: int, buffer: torch.Tensor) -> Transfer:
        return self._submit(file, offset, buffer, os.pwritev, "write")

    def _submit(self, file: SwapFile, offset: int, buffer: torch.Tensor, call, kind: str) -> Transfer:
        assert buffer.dtype == torch.uint8 and buffer.is_contiguous()
        if offset + buffer.numel() > file.nbytes:
            raise RuntimeError(f"zero nvme: {kind} of {buffer.numel()} bytes at {offset} beyond the "
                               f"{file.nbytes}-byte swap file in {file.directory}")
        view = memoryview(buffer.numpy())
        futures = [self.executor.submit(_transfer_all, call, file.fd, view[begin:begin + self.block_size],
                                        offset + begin)
                   for begin in range(0, buffer.numel(), self.block_size)]
        return Transfer(futures, f"{kind} of {buffer.numel()} bytes at offset {offset} in {file.directory}")

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _transfer_all(call, fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        moved = call(fd, [view[done:]], offset + done)
        if moved <= 0:
            raise OSError(errno.EIO, f"short transfer: {done} of {len(view)} bytes at offset {offset}")
        done += moved
