"""What a ParamGroup saves and loads (its state_dict): every fp32 master
slice this rank updates, named by parameter and element range, with the
optimizer's states for it, as checkpoint/format.py's NamedShard."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..checkpoint.format import NamedShard

if TYPE_CHECKING:
    from .param_group import ParamGroup


def master_slices(group: ParamGroup) -> list[tuple[NamedShard, torch.Tensor]]:
    """Every fp32 master slice this rank updates (the optimizer's parameters),
    named, with its optimizer param group; the shards' tensors are left empty."""
    names, optimizer = group.param_names, group.optimizer
    group_of = {id(p): g for g, pg in enumerate(optimizer.param_groups) for p in pg["params"]}
    out = []
    for bucket in group.buckets:
        slices = bucket.layout.local_slices(bucket.span.index, bucket.owned)
        for (view, _, _), (index, _, in_param) in zip(bucket.master_views, slices, strict=True):
            out.append((NamedShard(names[index], in_param.begin, in_param.numel, group_of.get(id(view))), view))
    return out


def param_shapes(group: ParamGroup) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's whole shape, by name (stage-3 parameters are empty between uses)."""
    return {group.param_names[index]: tuple(shape) for b in group.buckets
            for index, shape in zip(b.indices, b.shapes)}


def state_dict(group: ParamGroup) -> dict[str, NamedShard]:
    """Every fp32 master slice this rank holds and its optimizer states, as
    named shards by key (views, not copies: offloaded states are tensors to
    read inside group.offloaded_states())."""
    shards = {}
    for shard, view in master_slices(group):
        shard.tensors["master"] = view.detach()
        for kind, value in group.optimizer.state.get(view, {}).items():
            if isinstance(value, torch.Tensor):
                shard.tensors[kind] = value.detach()
        shards[shard.key] = shard
    return shards


def load_state_dict(group: ParamGroup, state: dict[str, dict[str, torch.Tensor]], *, optimizer_states: bool) -> None:
    """Copies each saved master slice ("master", by shard key) into this rank's
    and, with `optimizer_states`, makes the saved optimizer states (the other
    kinds) the optimizer's whole state; then publishes the masters into the
    parameters and zeroes the gradients. Keys this rank does not hold are ignored."""
    with torch.no_grad(), group.offloaded_states():  # written back where they are offloaded on exit
        states = {}
        for shard, view in master_slices(group):
            saved = state.get(shard.key)
            if saved is None:
                continue
            view.copy_(saved["master"])
            kinds = {kind: value for kind, value in saved.items() if kind != "master"}
            if kinds:
                states[view] = kinds
        if optimizer_states:
            load_optimizer_state(group.optimizer, states)
    group.publish_masters()
    group.zero_grads()


def load_optimizer_state(optimizer: torch.optim.Optimizer, states: dict[torch.Tensor, dict]) -> None:
    """Hands per-parameter states to the optimizer through its own
    load_state_dict (which moves them to each parameter's device)."""
    state_dict = optimizer.state_dict()
    params: Sequence[torch.Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
    state_dict["state"] = {i: states[p] for i, p in enumerate(params) if states.get(p)}
    optimizer.load_state_dict(state_dict)
