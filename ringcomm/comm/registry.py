"""The registry of groups: new_group (every rank, in the same order), the
default group that calls with group=None use, and resolve_group, which maps a
caller's `group` to a Group."""
from __future__ import annotations

import itertools
import weakref
from datetime import timedelta

import torch.distributed as dist

from ..algorithms.flat_ring import TorchDistOptions
from ..core import arguments, compat
from ..transport import rendezvous
from ..transport.shm import ShmOptions
from .group import DEFAULT_TIMEOUT_S, Group, GroupOptions, GroupState, create_group


def new_group(ranks: list[int] | None = None, *, transport: str = "auto", timeout: float | timedelta = DEFAULT_TIMEOUT_S,
              shm: ShmOptions | None = None, torch_dist: TorchDistOptions | None = None) -> Group | None:
    """A ringcomm group over `ranks` (global ranks; default: all) of the
    initialized default torch.distributed group. Like dist.new_group, every
    rank must call it, in the same order, with the same `ranks`; ranks outside
    `ranks` get None. `timeout` (seconds) bounds every wait of the group's
    set-up and of each of its collectives."""
    if not dist.is_initialized():
        raise RuntimeError("ringcomm.new_group: call torch.distributed.init_process_group first")
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not 0 < timeout_s < float("inf"):  # every wait has a bound (and NaN is no bound)
        raise ValueError(f"ringcomm.new_group: timeout={timeout_s} s must be a finite number > 0")
    world_size = dist.get_world_size()
    members = tuple(range(world_size)) if ranks is None else tuple(sorted(set(ranks)))
    if not members or members[0] < 0 or members[-1] >= world_size or (ranks is not None and len(ranks) != len(members)):
        raise ValueError(f"ringcomm.new_group: ranks={ranks} must be distinct ranks of the world "
                         f"(world_size {world_size}) on rank {dist.get_rank()}")
    index = next(_new_group_calls)
    if dist.get_rank() not in members:
        return None
    options = GroupOptions(transport, timeout_s, shm or ShmOptions(), torch_dist or TorchDistOptions())
    store = dist.PrefixStore(f"ringcomm/new_group/{index}/", compat.default_store())
    rank = members.index(dist.get_rank())
    _check_members(store, rank, members, timeout_s)
    return create_group(store, rank, len(members), options=options, global_ranks=members)


_new_group_calls = itertools.count()  # the n-th call names one group: every rank calls in the same order


def _check_members(store: dist.Store, rank: int, members: tuple[int, ...], timeout_s: float) -> None:
    """Every member must pass the same ranks: compare with the group's rank 0."""
    if rank == 0:
        store.set("members", repr(members))
        return
    what = f"ringcomm.new_group: global rank {members[rank]} waiting for global rank {members[0]} to create group {members}"
    theirs = rendezvous.get(store, "members", timeout_s, what).decode()
    if theirs != repr(members):
        raise ValueError(f"ringcomm.new_group: global rank {members[rank]} called it with ranks {members}, global rank "
                         f"{members[0]} with {theirs}: every rank must create the same groups in the same order")


# [Note: default groups] The group that ringcomm's calls with group=None use
# belongs to the torch.distributed world it was made for. It is closed when that
# world's process group goes away (a weakref finalizer: destroy_process_group
# drops torch's references to it), and it is never returned for another world,
# even one whose object reuses the address (the key). A group closed by hand
# detaches its finalizer, so a long-lived world holds no closed groups.
_default_groups: dict[int, tuple[weakref.ref, Group, weakref.finalize]] = {}


def default_group() -> Group:
    """The ringcomm group over the whole default torch.distributed group, made on
    first use (by the first collective every rank calls with group=None). Its
    timeout is RINGCOMM_TIMEOUT (seconds) when set, else 300 s."""
    if not dist.is_initialized():
        raise RuntimeError("ringcomm: torch.distributed is not initialized; call init_process_group or pass group=")
    world = dist.group.WORLD
    key = id(world)
    entry = _default_groups.get(key)
    if entry is not None:
        made_for, group, _ = entry
        if made_for() is world and group.state is GroupState.OPEN:
            return group
        _close_default(key, group)  # made for a destroyed world, or closed by hand
    group = new_group(timeout=arguments.seconds_from_env("RINGCOMM_TIMEOUT", DEFAULT_TIMEOUT_S))
    _default_groups[key] = (weakref.ref(world), group, weakref.finalize(world, _close_default, key, group))
    return group


def _close_default(key: int, group: Group) -> None:
    entry = _default_groups.get(key)
    if entry is not None and entry[1] is group:
        del _default_groups[key]
        entry[2].detach()
    group.close()


def resolve_group(group: object, op: str) -> Group:
    """`group` itself, or the default group for None; anything else is refused."""
    if group is None:
        return default_group()
    if isinstance(group, Group):
        return group
    hint = ("; a torch.distributed group runs on ringcomm when made with backend='ringcomm' and used through "
            "torch.distributed's own calls" if isinstance(group, dist.ProcessGroup) else "")
    raise TypeError(f"{op}: group must be a ringcomm.Group (from ringcomm.new_group) or None, "
                    f"got {type(group).__name__}{hint}")


def destroy_default_group() -> None:
    """Closes the default group now (see [Note: default groups]: destroying torch's
    world closes it too); the next call with group=None makes a new one."""
    for key, (_, group, _) in list(_default_groups.items()):
        _close_default(key, group)
