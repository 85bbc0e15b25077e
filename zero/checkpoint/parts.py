"""What a checkpoint is made of, as the engine hands it to save.py and
load.py: its stateful parts, each saving and loading itself
(state_dict / load_state_dict), composed as torchtitan's checkpointer
composes Stateful objects, and the facts the files record about them."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .format import NamedShard


class Stateful(Protocol):
    """torch.distributed.checkpoint's Stateful: the loss scaler, the LR scheduler, the counters."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ShardedStates(Protocol):
    """The fp32 master slices a rank holds and their optimizer states: a
    ParamGroup (and its offload variants) with its optimizer attached."""

    def saved_shards(self) -> contextlib.AbstractContextManager[list[NamedShard]]: ...

    def load_state_dict(self, saved: dict[str, dict[str, torch.Tensor]], *, optimizer_states: bool = True) -> None: ...


@dataclass(frozen=True, slots=True)
class CheckpointParts:
    """An engine's checkpointed parts, and what the checkpointer needs to know of it."""

    rank: int
    world_size: int
    stage: int  # 0-3: at stage 0 every rank holds every master; rank 0 saves them
    dtype: torch.dtype  # the model's training dtype
    module: nn.Module
    param_names: list[str]  # the trainable parameters' names, by parameter index
    trainable: list[nn.Parameter]  # by parameter index
    param_shapes: Callable[[], dict[str, tuple[int, ...]]]  # whole shapes by name (stage 3 empties them)
    shards: ShardedStates
    optimizer: torch.optim.Optimizer  # its hyperparameters are saved by param group
    scaler: Stateful
    scheduler: object | None  # Stateful when it has state_dict (a client's may not)
    progress: Stateful
    # collective: read(index) of whole fp32 masters, one bucket gathered at a time (ParamGroup.whole_masters)
    whole_masters: Callable[[], contextlib.AbstractContextManager[Callable[[int], torch.Tensor]]]
    layout: dict[str, int]  # world_size, micro_batch_size, gradient_accumulation_steps, train_batch_size
    config: object  # the engine's parsed config (runtime/config.py's EngineConfig), for DeepSpeed's facts

    @property
    def accumulation_steps(self) -> int:
        return self.layout["gradient_accumulation_steps"]


@dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """How the ranks agree while saving and loading ([Note: atomic save] in save.py)."""

    timeout_s: float = 600.0  # the longest a rank waits for the others (to write, to validate)
    on_phase: Callable[[str, int], None] | None = None  # called with (phase, rank) at each phase of a save

    def phase(self, phase: str, rank: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, rank)
