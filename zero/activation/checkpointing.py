"""Activation checkpointing, the counterpart of `deepspeed.checkpointing`:
configure, checkpoint, is_configured, and checkpoint_modules for chosen
submodules. Non-reentrant: recomputation runs from saved-tensor hooks.

[Note: recomputation from saved-tensor hooks]
    forward:   checkpoint(f, x): hold x (store.py), note the RNG state,
               run f(x) building the usual graph, but every tensor autograd saves
               is replaced by a (frame, index) token and dropped.
    backward:  the first token of a frame unpacked: start gathering the previous
               frame's inputs (the next one backward needs), fetch this frame's,
               restore the RNG state, re-run f under hooks that keep what it saves;
               each token then returns its recomputed tensor once.
The graph is the forward's own, so gradient hooks (bucket reduction, stage-3
gathering) fire as without checkpointing and in the same order: the
arithmetic is the same, only the saved values are produced twice.

[Note: whose checkpointing]
The state (options, stores, the running step's frames, stats) is an
ActivationCheckpointing. An engine whose config has an activation_checkpointing
section owns one, made current when the engine is built (as
deepspeed.initialize configures checkpointing), and active while its module
runs forward, so two engines never share a store, a frame or a stat; a frame
keeps the one it was made under for its recomputation in backward. The
module-level API (configure, checkpoint, stats, is_configured) acts on the
active one, else the current one: `configure(mpu, ...)` after initialize, as
Megatron calls it, reconfigures that engine's.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..parsing.values import load
from .config import Options, parse
from .stats import ActivationStats, forget, storage_nbytes
from .store import ActivationStore, Held, partition_comm

log = logging.getLogger("zero")


class ActivationCheckpointing:
    """One configuration's state: its options, stores, the frames of the
    running step and its stats ([Note: whose checkpointing])."""

    def __init__(self) -> None:
        self.configured = False
        self.options = Options()
        self.mpu: object | None = None
        self.stores: dict[torch.device, ActivationStore] = {}
        self.frames: list[weakref.ref] = []  # forward order, for the prefetch
        self.stats = ActivationStats()

    def configure(self, options: Options, mpu: object | None) -> None:
        """New options (and model-parallel group); the stores are made anew for them."""
        self.options, self.mpu, self.stores, self.configured = options, mpu, {}, True

    def store(self, device: torch.device) -> ActivationStore:
        if device not in self.stores:
            comm = partition_comm(self.mpu, device) if self.options.store.partition else None
            self.stores[device] = ActivationStore(self.options.store, comm)
        return self.stores[device]

    def add_frame(self, frame: _Frame) -> None:
        self.frames = [r for r in self.frames if r() is not None and r().held]
        self.frames.append(weakref.ref(frame))

    def prefetch_before(self, frame: _Frame) -> None:
        """Starts fetching the inputs of the frame backward reaches next."""
        alive = [r() for r in self.frames]
        if frame not in alive:
            return
        for earlier in reversed(alive[:alive.index(frame)]):
            if earlier is not None and earlier.held:
                earlier.start_fetch()
                return


_current = ActivationCheckpointing()
_active: contextvars.ContextVar[ActivationCheckpointing | None] = contextvars.ContextVar("zero_checkpointing",
                                                                                       default=None)


def current() -> ActivationCheckpointing:
    """The active engine's checkpointing, else the current one ([Note: whose checkpointing])."""
    return _active.get() or _current


@contextlib.contextmanager
def active(owner: ActivationCheckpointing):
    """`checkpoint` calls inside use `owner` (an engine's forward)."""
    token = _active.set(owner)
    try:
        yield
    finally:
        _active.reset(token)


class _Frame:
    """One checkpoint call: its held inputs, RNG state, and (in backward) the
    tensors its recomputation saved, by pack index."""

    def __init__(self, owner: ActivationCheckpointing, recompute: Callable, args: list, held: dict[int, Held],
                 store: ActivationStore, rng: tuple) -> None:
        self.owner = owner
        self.recompute_fn = recompute
        self.args = args  # non-tensor and non-floating arguments as given; held ones are None
        self.held = held
        self.store = store
        self.rng = rng
        self.stats = owner.stats
        self.num_packed = 0
        self.saved: list | None = None
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> tuple[_Frame, int]:
        self.num_packed += 1
        return self, self.num_packed - 1

    def start_fetch(self) -> None:
        for held in self.held.values():
            self.store.start_fetch(held)

    def unpack(self, index: int) -> torch.Tensor:
        if self.saved is None:
            self._recompute()
        tensor = self.saved[index]
        if tensor is None:
            raise RuntimeError("zero.checkpointing: a saved tensor was used twice (backward through a "
                               "checkpointed graph a second time, or torch.autograd.grad); not supported")
        self.saved[index] = None
        self.stats.add("recomputed_nbytes", -forget(tensor, self.seen))
        return tensor

    def _recompute(self) -> None:
        self.owner.prefetch_before(self)
        args = list(self.args)
        for position, held in self.held.items():
            nbytes, self.stats.num_prefetched = held.nbytes, self.stats.num_prefetched + (held.handle is not None)
            args[position] = self.store.fetch(held).detach().requires_grad_(held.requires_grad)
            self.stats.add("held_nbytes", -nbytes)
        self.held.clear()
        self.saved = []

        def keep(tensor: torch.Tensor) -> None:
            self.saved.append(tensor.detach())
            self.stats.add("recomputed_nbytes", storage_nbytes(tensor, self.seen))

        def never(_: None) -> torch.Tensor:
            raise RuntimeError("zero.checkpointing: the recomputed graph is not meant for backward")

        with _boundary("recompute", self.owner.options), _restored_rng(self.rng, args), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(keep, never):
            self.recompute_fn(*args)
        if len(self.saved) != self.num_packed:
            raise RuntimeError(f"zero.checkpointing: the recomputation saved {len(self.saved)} tensors, the forward "
                               f"{self.num_packed}: the checkpointed function must run the same ops both times")


def _release(held: dict[int, Held], store: ActivationStore, stats: ActivationStats) -> None:
    """A frame died without a backward (evaluation with grad on, a dropped
    loss): give back what it still holds."""
    for item in held.values():
        stats.add("held_nbytes", -item.nbytes)
        store.release(item)
    held.clear()


def _unpack(token: tuple[_Frame, int]) -> torch.Tensor:
    frame, index = token
    return frame.unpack(index)


@contextlib.contextmanager
def _boundary(what: str, options: Options):
    """synchronize_checkpoint_boundary and profile around a forward or a recompute."""
    if options.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if options.synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    if options.profile:
        log.info("zero.checkpointing: %s %.3f ms", what, 1e3 * (time.perf_counter() - start))


def _rng_state(args: list) -> tuple:
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    return torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}


@contextlib.contextmanager
def _restored_rng(state: tuple, args: list):
    """Runs the recomputation with the forward's RNG state (dropout draws the
    same masks) and puts the current state back afterwards."""
    current = _rng_state(args)
    torch.set_rng_state(state[0])
    for device, cuda_state in state[1].items():
        torch.cuda.set_rng_state(cuda_state, device)
    try:
        yield
    finally:
        torch.set_rng_state(current[0])
        for device, cuda_state in current[1].items():
            torch.cuda.set_rng_state(cuda_state, device)


def _checkpoint(forward: Callable, recompute: Callable, args: tuple):
    """Runs forward(*args) keeping only the floating-point tensor arguments
    (held by the store); recompute(*args) rebuilds the saved tensors in backward."""
    if not torch.is_grad_enabled():
        return forward(*args)
    tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()}
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    owner = current()
    store = owner.store(device)
    rng = _rng_state(list(args))
    held = {}
    for position, tensor in tensors.items():
        held[position] = store.hold(position, tensor)
        owner.stats.add("held_nbytes", held[position].nbytes)
    kept = [None if i in tensors else a for i, a in enumerate(args)]
    frame = _Frame(owner, recompute, kept, held, store, rng)
    weakref.finalize(frame, _release, held, store, owner.stats)
    owner.add_frame(frame)
    with _boundary("forward", owner.options), torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        return forward(*args)


# ---- public surface (deepspeed.checkpointing) -----------------------------------------
def checkpoint(function: Callable, *args, **kwargs):
    """deepspeed.checkpointing.checkpoint: function(*args, **kwargs) whose
    activations are recomputed in backward. Floating-point tensor positional
    arguments are the checkpointed inputs; keyword arguments are kept as given."""
    run = functools.partial(function, **kwargs) if kwargs else function
    return _checkpoint(run, run, args)


def configure(mpu_: object | None = None, deepspeed_config: str | dict | None = None,
              partition_activations: bool | None = None, contiguous_checkpointing: bool | None = None,
              num_checkpoints: int | None = None, checkpoint_in_cpu: bool | None = None,
              synchronize: bool | None = None, profile: bool | None = None) -> None:
    """deepspeed.checkpointing.configure, of the current checkpointing ([Note:
    whose checkpointing]): the config's activation_checkpointing section, then
    the keyword overrides. `mpu_` names the model-parallel group that
    partition_activations splits across (store.py's Note)."""
    section = {}
    if deepspeed_config is not None:
        section = load(deepspeed_config).get("activation_checkpointing") or {}
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints,
                 "cpu_checkpointing": checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize,
                 "profile": profile}
    section = {**section, **{k: v for k, v in overrides.items() if v is not None}}
    current().configure(parse(section), mpu_)


def for_engine(options: Options | None) -> ActivationCheckpointing | None:
    """An engine's own checkpointing from its config's activation_checkpointing
    section (config.py), made current; None without a section (the engine then
    uses whichever is current)."""
    global _current
    if options is None:
        return None
    _current = ActivationCheckpointing()
    _current.configure(options, None)
    return _current


def is_configured() -> bool:
    return current().configured


def reset() -> None:
    """A new, unconfigured current checkpointing (an engine keeps its own)."""
    global _current
    _current = ActivationCheckpointing()


def stats() -> ActivationStats:
    return current().stats


def checkpoint_modules(model: nn.Module, select: type | tuple[type, ...] | Callable[[str, nn.Module], bool]) -> int:
    """Checkpoints every submodule chosen by `select` (module classes, or a
    predicate on (name, module)), as `gradient_checkpointing_enable()` does
    for its blocks; returns how many. The recomputation calls the module
    with its hooks (stage 3 gathers its parameters again)."""
    chosen = [m for name, m in model.named_modules()
              if (isinstance(m, select) if isinstance(select, (type, tuple)) else select(name, m))]
    for module in chosen:
        if "forward" in module.__dict__:
            raise ValueError(f"checkpoint_modules: {type(module).__name__} already has an instance forward "
                             "(checkpointed twice?)")
        module.forward = functools.partial(_module_forward, module, type(module).forward.__get__(module))
    return len(chosen)


def _module_forward(module: nn.Module, original: Callable, *args, **kwargs):
    def recompute(*again):
        wrapper = module.__dict__.pop("forward")  # call the module itself: its hooks run as in forward
        try:
            return module(*again, **kwargs)
        finally:
            module.forward = wrapper
    run = functools.partial(original, **kwargs) if kwargs else original
    return _checkpoint(run, recompute, args)


class measure:
    """Counts every tensor autograd saves outside checkpoints (parameters
    excepted) into stats(): `with checkpointing.measure() as s: ...; s.peak_nbytes`."""

    def __init__(self) -> None:
        self.stats = current().stats
        self.seen: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.stats.add("saved_nbytes", storage_nbytes(tensor, self.seen))
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.stats.add("saved_nbytes", -forget(tensor, self.seen))
        return tensor

    def __enter__(self) -> ActivationStats:
        self.stats.reset()
        self.hooks.__enter__()
        return self.stats

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)
