"""What a ParamGroup saves and loads (its state_dict): every fp32 master
slice this rank updates, named by parameter and element range, with the
optimizer's states for it, as checkpoint/format.py's NamedShard."""
from __future__ import annotations

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


def load_state_dict(group: ParamGroup, state: dict[str, dict[str, object]], *, optimizer_states: bool) -> None:
    """Copies each saved master slice ("master", by shard key) into this rank's
    and, with `optimizer_states`, makes the saved optimizer states (the other
    kinds) the optimizer's whole state; then publishes the masters into the
    parameters and zeroes the gradients. Keys this rank does not hold are
    ignored. A saved value is a tensor or a saved range (checkpoint/load.py's
    SavedRange), read straight into the master or into the parameter's new
    optimizer state as the old one goes: no second copy of the rank's states."""
    with torch.no_grad(), group.offloaded_states():  # written back where they are offloaded on exit
        loaded = {}
        for shard, view in master_slices(group):
            saved = state.get(shard.key)
            if saved is None:
                continue
            fill(view, saved["master"])
            loaded[view] = {kind: value for kind, value in saved.items() if kind != "master"}
        if optimizer_states:
            load_optimizer_state(group.optimizer, loaded)
    group.publish_masters()
    group.zero_grads()


def fill(out: torch.Tensor, value: object) -> torch.Tensor:
    """`out` takes `value`: a tensor, or a saved range read into it."""
    if isinstance(value, torch.Tensor):
        out.copy_(value.view(out.shape))
    else:
        value.read_into(out)
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, states: dict[torch.Tensor, dict[str, object]]) -> None:
    """Makes `states` (per parameter: kind -> tensor or saved range) the
    optimizer's whole state, as its load_state_dict would, one parameter at a
    time: elementwise states in the parameter's dtype and device; "step" as saved (on the parameter's device for fused
    or capturable optimizers); parameters without saved states lose theirs."""
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            saved = states.get(param)
            if not saved:
                optimizer.state.pop(param, None)
                continue
            optimizer.state.pop(param, None)  # the old state goes before the new one comes
            optimizer.state[param] = {kind: restore(param, kind, value, on_device) for kind, value in saved.items()}


def restore(param: torch.Tensor, kind: str, value: object, on_device: bool) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or (value.dim() > 0 and value.numel() == param.numel()):
        return fill(torch.empty_like(param, memory_format=torch.contiguous_format), value)
    if kind == "step":
        return value.to(dtype=torch.float32, device=param.device) if on_device else value
    return value.to(dtype=param.dtype, device=param.device) if value.is_floating_point() else value.to(param.device)
