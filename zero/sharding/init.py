"""deepspeed.zero for zero: Init (each module's parameters sharded across the
ranks as its __init__ returns, so a model larger than one rank's memory can be
built) and GatheredParameters (gather, optionally modify on one rank, re-shard).

[Note: a partitioned parameter]
    Built under Init, a parameter keeps `ds_shape`, `ds_numel` and `ds_tensor`,
    this rank's chunk of the flattened value: ceil(numel / world_size) elements,
    the last rank's zero-padded (remote_device="nvme": on the host, mapped from a
    file under offload_param.nvme_path, unlinked at once); its `.data` is empty. The engine
    copies these chunks into its buckets (fill.build_buckets, one parameter
    gathered at a time) and drops `ds_tensor`. At stage 3 each parameter then carries
    `ds_bucket` = (ParamGroup, ZeroBucket) so that GatheredParameters gathers
    and re-shards through the engine, and a modification reaches its fp32 master.

[Note: leaving GatheredParameters]
    On a clean exit with a modifier rank, that rank's values are broadcast and
    every rank stores its chunk and folds it into its fp32 master through the
    ParamGroup (ParamGroup.adopt_owned_values: in memory, on the host, or read,
    modified and written back in an NVMe swap file). When the body raised, the
    modification is dropped and nothing is broadcast (the body may have failed
    on some ranks only, which then would not join). Whatever happens, every
    bucket this context gathered is re-sharded before the exception propagates.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..parsing.values import load


def is_partitioned(param: torch.Tensor) -> bool:
    """Sharded by Init and not yet taken over by an engine."""
    return hasattr(param, "ds_tensor")


def full_shape(param: torch.Tensor) -> torch.Size:
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def full_numel(param: torch.Tensor) -> int:
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


def _chunk_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


class NvmeShards:
    """remote_device="nvme": each shard is written to a file in `folder` (under
    the config's offload_param.nvme_path), mapped and unlinked at once. Its pages
    belong to the page cache, not to the process, until the engine reads the
    shard; the file's space is freed with the tensor, also when the process dies."""

    def __init__(self, nvme_path: str) -> None:
        self.folder = os.path.join(nvme_path, "zero_init", f"pid{os.getpid()}")
        self._written = 0

    def place(self, shard: torch.Tensor) -> torch.Tensor:
        if shard.numel() == 0:
            return shard
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"shard{self._written}.swp")
        self._written += 1
        with open(path, "wb") as file:
            shard.cpu().view(torch.uint8).numpy().tofile(file)  # any dtype, bf16 included, as its bytes
        mapped = torch.from_file(path, shared=True, size=shard.numel(), dtype=shard.dtype)
        os.unlink(path)
        return mapped

    def close(self) -> None:
        """Removes the folder and, when no other process's is in it, its parent
        (the files are unlinked already)."""
        for folder in (self.folder, os.path.dirname(self.folder)):
            with contextlib.suppress(OSError):  # never made, or another Init's files are being written
                os.rmdir(folder)


def partition(param: nn.Parameter, dtype: torch.dtype | None = None, nvme: NvmeShards | None = None) -> None:
    """Rank 0's value, cut into chunks; this rank keeps its own (a collective),
    in memory or, with `nvme`, in a mapped file."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    value = param.data.detach()
    if dtype is not None:
        value = value.to(dtype)
    dist.broadcast(value, 0)  # every rank must shard the same values (as DeepSpeed's Init)
    chunk = _chunk_numel(value.numel(), world_size)
    shard = torch.zeros(chunk, dtype=value.dtype, device=value.device)
    mine = value.reshape(-1)[rank * chunk:(rank + 1) * chunk]
    shard[:mine.numel()].copy_(mine)
    param.ds_shape, param.ds_numel = value.shape, value.numel()
    param.ds_tensor = nvme.place(shard) if nvme is not None else shard
    param.data = torch.empty(0, dtype=value.dtype, device=value.device)


def gather(param: nn.Parameter) -> torch.Tensor:
    """The whole flat value of a partitioned parameter (a collective)."""
    shard = param.ds_tensor
    whole = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(whole, shard)
    return whole[:param.ds_numel]


def release(param: nn.Parameter) -> None:
    """The engine owns the value now (its bucket)."""
    del param.ds_tensor


def attach(group) -> None:
    """Stage 3: each parameter learns its bucket, for GatheredParameters."""
    for bucket in group.buckets:
        for param in bucket.params:
            param.ds_bucket = (group, bucket)


def _config_dtype(config) -> torch.dtype | None:
    """The training dtype a DeepSpeed config names (the shards are kept in it, as DeepSpeed's Init does)."""
    if config is None:
        return None
    raw = load(config)
    if raw.get("bf16", {}).get("enabled") is True:
        return torch.bfloat16
    if raw.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return None


def _remote_device(remote_device: str | None, config) -> str | None:
    """Where the shards go: the config's offload_param.device when the config has
    that section (it wins over the argument, as in DeepSpeed's Init), else the argument."""
    section = (load(config) if config is not None else {}).get("zero_optimization", {}).get("offload_param")
    if isinstance(section, dict) and section.get("device") is not None:
        return section["device"]
    return remote_device


def _nvme_path(config) -> str:
    """Where remote_device="nvme" puts the shards: offload_param.nvme_path, as DeepSpeed's Init."""
    path = (load(config) if config is not None else {}).get("zero_optimization", {}).get(
        "offload_param", {}).get("nvme_path")
    if not path:
        raise ValueError("zero.Init: remote_device='nvme' needs zero_optimization.offload_param.nvme_path in the "
                         "config (config_dict_or_path=...)")
    return str(path)


def _all_subclasses(cls: type) -> list[type]:
    out, stack = [], [cls]
    while stack:
        for sub in stack.pop().__subclasses__():
            out.append(sub)
            stack.append(sub)
    return out


class Init:
    """with zero.Init(): model = Model()  - every module's parameters are
    partitioned when its outermost __init__ returns (so a subclass may still
    initialize what its parent built). A parent's __init__ that re-initializes
    a child's parameters afterwards needs GatheredParameters, as in DeepSpeed.
    `module=`: partition an existing model now."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype: torch.dtype | None = None, mpu=None, **kwargs) -> None:
        if data_parallel_group not in (None, dist.group.WORLD) or mpu is not None:
            raise ValueError("zero.Init: only the default process group is supported (data_parallel_group, mpu)")
        remote_device = _remote_device(remote_device, config_dict_or_path or config)
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"zero.Init: remote_device {remote_device!r} is not one of None, 'cpu', 'nvme'")
        self.enabled = enabled
        self.dtype = dtype if dtype is not None else _config_dtype(config_dict_or_path or config)
        self._nvme = NvmeShards(_nvme_path(config_dict_or_path or config)) if remote_device == "nvme" and enabled \
            else None
        self._building: set[int] = set()  # ids of modules inside their outermost __init__
        self._originals: dict[type, object] = {}
        self._had_init_subclass = False
        if module is not None and enabled:
            self._partition_module(module)

    def _partition_module(self, module: nn.Module) -> None:
        if not dist.is_initialized():
            raise RuntimeError("zero.Init: call zero.init_distributed() before building the model")
        for param in module.parameters():
            if not is_partitioned(param) and not hasattr(param, "ds_bucket"):
                partition(param, self.dtype, self._nvme)
        if self._nvme is not None:
            self._nvme.close()

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__["__init__"]

        @functools.wraps(original)
        def init(module, *args, **kwargs):
            outermost = self.enabled and id(module) not in self._building
            if outermost:
                self._building.add(id(module))
            try:
                original(module, *args, **kwargs)
            finally:
                if outermost:
                    self._building.discard(id(module))
            if outermost and self._originals:  # still inside the context
                self._partition_module(module)
        self._originals[cls] = original
        cls.__init__ = init

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in _all_subclasses(nn.Module):
            if "__init__" in cls.__dict__ and cls not in self._originals:
                self._wrap(cls)
        self._had_init_subclass = "__init_subclass__" in nn.Module.__dict__
        previous = nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):  # classes defined inside the context
            if previous is not None:
                previous.__func__(cls, **kwargs)
            if "__init__" in cls.__dict__ and init._originals:
                init._wrap(cls)
        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._previous_init_subclass = previous
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for cls, original in self._originals.items():
            cls.__init__ = original
        self._originals = {}
        if self._had_init_subclass:
            nn.Module.__init_subclass__ = self._previous_init_subclass
        else:
            del nn.Module.__init_subclass__


class GatheredParameters:
    """with zero.GatheredParameters(params, modifier_rank=r): the parameters are
    whole on every rank inside; on exit, rank r's values (when r is not None)
    are broadcast and re-sharded, else changes are dropped. Parameters that are
    not partitioned (not built under Init, or an engine below stage 3) are left
    alone, as DeepSpeed does. See [Note: leaving GatheredParameters]."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True) -> None:
        if fwd_module is not None:
            raise ValueError("zero.GatheredParameters: fwd_module (external parameters) is not supported")
        params = [params] if isinstance(params, torch.Tensor) or not isinstance(params, Iterable) else list(params)
        unique = {id(p): p for p in params if isinstance(p, torch.Tensor)}
        self.standalone = [p for p in unique.values() if is_partitioned(p)]
        owned = {}
        for p in unique.values():
            if hasattr(p, "ds_bucket"):
                group, bucket = p.ds_bucket
                owned[id(bucket)] = (group, bucket)
        self.buckets = list(owned.values())
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._gathered: list = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        self._gathered = [(g, b) for g, b in self.buckets if b.full is None]
        try:
            for param in self.standalone:
                param.data = gather(param).view(param.ds_shape)
            for group, bucket in self.buckets:
                group.unshard(bucket)
        except BaseException:
            self._release()  # __exit__ does not run when __enter__ raised
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                for param in self.standalone:
                    dist.broadcast(param.data, self.modifier_rank)
                    partition_local(param)
                for group, bucket in self.buckets:
                    _publish_modified(group, bucket, self.modifier_rank)
        finally:
            self._release()

    def _release(self) -> None:
        """Re-shards what this context gathered (local: no communication)."""
        for param in self.standalone:
            if param.data.numel():
                param.data = torch.empty(0, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
        errors = []
        for group, bucket in self._gathered:
            try:
                group.reshard(bucket)
            except Exception as error:  # noqa: BLE001 (reshard the others, then raise the first)
                errors.append(error)
        self._gathered = []
        if errors:
            raise errors[0]


def partition_local(param: nn.Parameter) -> None:
    """Re-cuts this rank's chunk from the whole value in `.data` (no communication)."""
    chunk = param.ds_tensor.numel()
    mine = param.data.reshape(-1)[dist.get_rank() * chunk:(dist.get_rank() + 1) * chunk]
    param.ds_tensor.zero_()
    param.ds_tensor[:mine.numel()].copy_(mine)


def _publish_modified(group, bucket, src: int) -> None:
    """Rank `src`'s bucket values become every rank's: the chunk, and the fp32
    master (wherever the group keeps it) where the value differs from the master
    rounded (the master keeps its precision where nothing changed)."""
    group.comm.broadcast(bucket.full, src)
    chunk = bucket.span.local_chunk(bucket.rank)
    group.adopt_owned_values(bucket, bucket.full[chunk.begin:chunk.end])
