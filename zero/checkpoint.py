"""DeepSpeed-style checkpoints: save_dir/tag/ holds one file per rank (its fp32
master shard, optimizer state, loss scaler, counters) and, from rank 0, the whole
model in its training dtype; save_dir/latest names the last tag."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_file(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"zero_rank{rank}_of{world_size}.pt")


def save(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> str:
    """Collective: every rank writes its shard; rank 0 the whole model and `latest`."""
    group, comm = engine.parts.group, engine.parts.comm
    tag = tag or f"global_step{engine.global_steps}"
    directory = os.path.join(save_dir, tag)
    os.makedirs(directory, exist_ok=True)
    scheduler = engine.lr_scheduler
    with group.offloaded_states():  # offloaded masters and states as ordinary tensors while saved
        state = {
            "masters": [bucket.master.clone() for bucket in group.buckets],  # a view would save its whole buffer
            "optimizer": engine.optimizer.state_dict(),
            "scaler": engine.parts.scaler.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
            "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                         "skipped_steps": engine.skipped_steps},
            "client_state": client_state or {},
        }
        torch.save(state, rank_file(directory, comm.rank, comm.world_size))
    full = engine.full_params_fp32()  # collective
    if comm.rank == 0:
        names = engine.parts.param_names
        torch.save({name: p.to(engine.parts.dtype) for name, p in zip(names, full)},
                   os.path.join(directory, "model_states.pt"))
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write(tag)
    if dist.is_initialized():
        dist.barrier()
    return directory


def load(engine, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
    """Restores what save() wrote, on the same world size and stage; returns
    (path, client_state) like DeepSpeed."""
    comm, group = engine.parts.comm, engine.parts.group
    if tag is None:
        with open(os.path.join(load_dir, "latest")) as f:
            tag = f.read().strip()
    directory = os.path.join(load_dir, tag)
    path = rank_file(directory, comm.rank, comm.world_size)
    if not os.path.exists(path):
        raise ValueError(f"load_checkpoint: no {os.path.basename(path)} in {directory} (rank {comm.rank}); "
                         f"checkpoints load on the world size they were saved with")
    state = torch.load(path, weights_only=False)
    if len(state["masters"]) != len(group.buckets):
        raise ValueError(f"load_checkpoint: {directory} has {len(state['masters'])} buckets, this engine "
                         f"{len(group.buckets)} (another stage or bucket size?) on rank {comm.rank}")
    with torch.no_grad(), group.offloaded_states():  # written back to where they are offloaded on exit
        for bucket, master in zip(group.buckets, state["masters"]):
            bucket.master.copy_(master)
        engine.optimizer.load_state_dict(state["optimizer"])
    engine.parts.scaler.load_state_dict(state["scaler"])
    if state["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    for key, value in state["counters"].items():
        setattr(engine, key, value)
    group.publish_masters()
    group.zero_grads()
    return directory, state["client_state"]


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    """Collective: rank 0 writes the whole module's state_dict in the training
    dtype (stage 3 gathers the shards), as DeepSpeed's save_16bit_model."""
    full = engine.full_params_fp32()
    if engine.parts.comm.rank != 0:
        return True
    index = {id(p): i for i, p in enumerate(engine.parts.trainable)}
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    state = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        param = params.get(name)
        if param is not None and id(param) in index:
            tensor = full[index[id(param)]].to(engine.parts.dtype)
        state[name] = tensor.detach().clone()
    os.makedirs(save_dir, exist_ok=True)
    torch.save(state, os.path.join(save_dir, save_filename))
    return True
