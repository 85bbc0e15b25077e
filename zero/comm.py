"""deepspeed.comm for zero: the collectives and queries a training script calls,
on torch.distributed's groups. A group created on backend "ringcomm" runs them
on ringcomm; the default group is the one init_distributed made."""
from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import ringcomm  # noqa: F401  (registers the torch.distributed backend "ringcomm")

from .monitor import comms
from .monitor.comms import log_summary  # noqa: F401  (deepspeed.comm.log_summary)

ReduceOp = dist.ReduceOp  # DeepSpeed's ReduceOp has the same members and maps onto this one
DEFAULT_TIMEOUT = timedelta(minutes=30)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: object = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """deepspeed.init_distributed: joins the default process group (env:// under a
    launcher, or init_method/rank/world_size); a no-op when one exists. Without
    a launcher's variables nor init_method it starts a one-process group.
    dist_backend: "gloo", "nccl", "ringcomm", ...; default nccl on a CUDA
    machine, else gloo. MPI discovery is not done: start under torchrun or the
    deepspeed launcher."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError("zero.init_distributed: dist_init_required=False but no process group is initialized")
    if not isinstance(timeout, timedelta):
        raise TypeError(f"zero.init_distributed: timeout must be a datetime.timedelta, got {timeout!r}")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ  # env:// names what else is missing
    if launched or init_method is not None:
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
    elif rank > 0 or world_size > 1:
        raise ValueError(f"zero.init_distributed: rank {rank} of world_size {world_size} needs init_method= or a "
                         f"launcher's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    return dist.new_group(ranks)


def get_world_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group)


def get_global_rank(group: dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def get_local_rank() -> int:
    """The launcher's LOCAL_RANK (or Open MPI's); 0 in a job without either, as DeepSpeed."""
    if not dist.is_initialized():
        raise RuntimeError("zero.comm.get_local_rank: call zero.init_distributed() first")
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_backend(group: dist.ProcessGroup | None = None) -> str:
    return dist.get_backend(group)


def configure(enabled: bool | None = None, prof_all: bool | None = None, prof_ops: list[str] | None = None,
              verbose: bool | None = None, debug: bool | None = None) -> None:
    """deepspeed.comm.configure: the comms logger's settings ([Note: comms logger])."""
    for name, value in (("enabled", enabled), ("prof_all", prof_all), ("prof_ops", prof_ops), ("verbose", verbose),
                        ("debug", debug)):
        if value is not None:
            setattr(comms.LOGGER, name, value)


def reset_log() -> None:
    """deepspeed.comm.reset_log: forgets what the comms logger recorded."""
    comms.LOGGER.records.clear()


def barrier(group: dist.ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None):
    return comms.timed("barrier", None, dist.barrier, group, async_op, device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None, async_op: bool = False):
    return comms.timed("all_reduce", tensor, dist.all_reduce, tensor, op, group, async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: dist.ProcessGroup | None = None,
           async_op: bool = False):
    return dist.reduce(tensor, dst, op, group, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False):
    return comms.timed("broadcast", tensor, dist.broadcast, tensor, src, group, async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False):
    return dist.all_gather(tensor_list, tensor, group, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: dist.ProcessGroup | None = None, async_op: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return comms.timed("all_gather_into_tensor", input_tensor, dist.all_gather_into_tensor,
                           output_tensor, input_tensor, group, async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return comms.timed("reduce_scatter_tensor", input_tensor, dist.reduce_scatter_tensor,
                           output_tensor, input_tensor, op, group, async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group: dist.ProcessGroup | None = None, async_op: bool = False):
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group, async_op)


def broadcast_object_list(object_list: list, src: int, group: dist.ProcessGroup | None = None, device=None):
    return dist.broadcast_object_list(object_list, src, group, device)


def all_gather_object(object_list: list, obj: object, group: dist.ProcessGroup | None = None):
    return dist.all_gather_object(object_list, obj, group)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    return dist.send(tensor, dst, group, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None, tag: int = 0):
    return dist.recv(tensor, src, group, tag)
