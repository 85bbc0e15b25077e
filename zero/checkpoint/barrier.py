"""A barrier with a deadline on every backend: the default process group's
store counts the ranks in, and a rank that waited too long names the ranks
that did not arrive (checkpoint save and load wait on it). store_agree is the
same barrier carrying each rank's error, so that every rank learns whether
all of them succeeded (store_gather: any value), and failure() is the error every rank then raises
(checkpoint save, and the logging set-up at zero.initialize).

[Note: store barrier]
Every rank counts its own barriers in the store (key count/rank{r}): ranks
pass the same barriers in the same order, so the n-th barrier has the same
number n on every rank, across engines and without any state in this
process. At barrier n a rank sets n/rank{r}, adds one to n/arrived, and the
rank that brings it to world_size sets n/done, which the others wait for with
the deadline. dist.barrier() has none on NCCL (it blocks until the process
group's watchdog, if any, aborts the process) and on ringcomm it is bounded by
the transport's timeout, not the checkpoint's; gloo's monitored_barrier is
gloo-only. The diagnosis after a timeout is one store.check per rank, bounded
by the store's own timeout (the store may sit across a dead link).
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ringcomm.core import compat

PREFIX = "zero/barrier"


def store_barrier(what: str, timeout_s: float) -> None:
    """Every rank of the default group reaches this point within `timeout_s`
    of this rank, or RuntimeError naming the missing ranks; see [Note: store barrier]."""
    store_agree(what, timeout_s, None)


def store_agree(what: str, timeout_s: float, error: str | None) -> list[tuple[int, str]]:
    """store_barrier where each rank brings its error (None: it succeeded);
    returns every rank's error, by rank, the same list on every rank
    ([] when all succeeded)."""
    values = store_gather(what, timeout_s, "ok" if error is None else "!" + error)
    return [(r, message[1:]) for r, message in enumerate(values) if message.startswith("!")]


def store_gather(what: str, timeout_s: float, value: str) -> list[str]:
    """store_barrier where each rank brings a value: returns every rank's, by
    rank, the same list on every rank. A rank's value is in the store before it
    counts itself in, so whoever sees the barrier done sees every value."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = compat.default_store()
    number = store.add(f"{PREFIX}/count/rank{rank}", 1)
    key = f"{PREFIX}/{number}"
    store.set(f"{key}/error{rank}", value)
    store.set(f"{key}/rank{rank}", what)
    if store.add(f"{key}/arrived", 1) == world_size:
        store.set(f"{key}/done", "1")
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError: the wait timed out (or the store is gone)
        missing = [r for r in range(world_size) if not store.check([f"{key}/rank{r}"])]
        raise RuntimeError(f"{what}: rank {rank} waited {timeout_s} s at barrier {number}: rank(s) {missing} of "
                           f"{world_size} did not arrive (failed, hung or gone)") from None
    return [store.get(f"{key}/error{r}").decode() for r in range(world_size)]


def failure(what: str, failures: list[tuple[int, str]]) -> Exception:
    """The error every rank raises when store_agree returned `failures` (each
    "Type: message"): the same message on every rank, naming each failed rank
    and its error; a ValueError when every failure was one (the caller's data
    or config), else a RuntimeError."""
    kind = ValueError if all(message.startswith("ValueError:") for _, message in failures) else RuntimeError
    return kind(f"{what}: failed on rank(s) {[r for r, _ in failures]}: " +
                "; ".join(f"rank {r}: {message}" for r, message in failures))
