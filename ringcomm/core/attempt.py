"""Which attempt of a run this process belongs to, for the keys it writes in a
store that outlives an attempt ([Note: attempt-scoped keys])."""
from __future__ import annotations

import os
import warnings

import torch.distributed as dist

# [Note: attempt-scoped keys]
# torchrun restarts the workers of a failed attempt (--max-restarts), and the new
# attempt's workers meet in the same TCPStore as the old ones wherever torchrun
# shares its rendezvous store with them (TORCHELASTIC_USE_AGENT_STORE=True: the
# static rendezvous always, the c10d one by default). torch writes no attempt into
# the workers' keys, so a restarted rank may read a key a dead one wrote: gloo then
# connects to a port of the old attempt ("Connection refused", or a hang of ~100 s
# past its timeout), and shm opens a segment already unlinked (pytorch/pytorch#135712).
# Measured here with plain gloo, 2 ranks, one killed per attempt: 2 or 3 of 6
# attempts joined with the static or --standalone rendezvous, 6 of 6 with a store
# of its own per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
#
# So ringcomm's keys in a shared store go under "attempt<TORCHELASTIC_RESTART_COUNT>/".
# The count is the agent's: every worker of one host's agent has the same, and so
# has a run of one agent. Agents on several hosts count only their own failures
# (a healthy host restarts for a peer's without counting it), so there the scope
# would split the ranks: for restarts on several hosts, give every attempt a store
# of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with --rdzv-backend c10d; the
# workers' keys then die with it), and ringcomm says so once.


def scope() -> str:
    """The prefix of this attempt's keys in the store ("" where no store outlives
    an attempt, or where torchrun's agents may disagree on the attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    if os.environ.get("LOCAL_WORLD_SIZE", "") != os.environ.get("WORLD_SIZE", ""):
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            _warn_once()
        return ""
    return f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def scoped(store: dist.Store) -> dist.Store:
    """`store`, its keys under this attempt's scope."""
    prefix = scope()
    return dist.PrefixStore(prefix, store) if prefix else store


_warned: list[bool] = []


def _warn_once() -> None:
    if not _warned:
        _warned.append(True)
        warnings.warn("ringcomm: torchrun shares its rendezvous store with the workers across restarts, on several "
                      "hosts: a restarted rank may read a dead one's keys (pytorch/pytorch#135712). For restarts, "
                      "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d "
                      "([Note: attempt-scoped keys] in ringcomm/core/attempt.py)", stacklevel=3)
