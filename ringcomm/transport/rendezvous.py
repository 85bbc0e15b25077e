"""Waiting on a group's store during set-up: every wait has a deadline, and a
failed one names the ranks that did not answer."""
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

FAILED = b"failed"  # a check-in's value where the rank's step failed


def get(store: dist.Store, key: str, timeout_s: float, what: str) -> bytes:
    """The value of `key` once some rank set it; `what` says who is awaited."""
    wait_for(store, [key], timeout_s, what)
    return store.get(key)


def wait_for(store: dist.Store, keys: Sequence[str], timeout_s: float, what: str) -> None:
    """Waits until every key is set; raises RuntimeError naming the missing ones."""
    try:
        store.wait(list(keys), timedelta(seconds=timeout_s))
    except Exception as err:  # the store raises its own error type on timeout
        missing = [key for key in keys if not store.check([key])]
        raise RuntimeError(f"{what}: no answer within {timeout_s} s (missing {missing}: {err})") from err


def check_in(store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float, what: str,
             *, waiting: bool = True) -> None:
    """Sets `prefix/rank`; with `waiting`, waits until every rank of the group
    set its own, naming the ranks that did not."""
    store.set(f"{prefix}/{rank}", "1")
    if not waiting:
        return
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        wait_for(store, keys, timeout_s, what)
    except RuntimeError as err:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"{what}: rank {rank} waited {timeout_s} s for ranks {missing} (of {world_size}); "
                           f"they did not answer") from err


def fail_naming_the_silent(store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float,
                           what: str, error: BaseException) -> NoReturn:
    """For a step of set-up that connects the ranks to each other (gloo's full
    mesh), each rank checks in at `prefix` when its step succeeded. Where it
    failed here, this names the ranks that never checked in within `timeout_s`
    (killed or stuck mid-step: a peer closing its end of a half-open connection
    is all gloo sees of them), or else the ranks whose step failed too."""
    store.set(f"{prefix}/{rank}", FAILED)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    if timeout_s > 0:  # else the step itself used the set-up's time: who checked in by now is the answer
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception:  # the store's own error type on timeout; the ranks are named below
            pass
    silent = [r for r, key in enumerate(keys) if not store.check([key])]
    failed = [r for r, key in enumerate(keys) if r not in silent and store.get(key) == FAILED]
    who = (f"ranks {silent} (of {world_size}) never finished it: they died or hang" if silent
           else f"it failed on ranks {failed} (of {world_size})")
    raise RuntimeError(f"{what}: rank {rank}: {error}; {who}") from error
