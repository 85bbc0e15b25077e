"""The activation_checkpointing section, checked in one place: its keys,
their types and how they combine, into the Options checkpointing.py runs with
(StoreOptions: where store.py holds the checkpointed inputs)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..parsing.values import as_bool, as_int, warn_unknown

FLAGS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
         "synchronize_checkpoint_boundary", "profile")
KEYS = {*FLAGS, "number_checkpoints"}


@dataclass(frozen=True, slots=True)
class StoreOptions:
    partition: bool = False  # partition_activations
    cpu: bool = False  # cpu_checkpointing
    contiguous: bool = False  # contiguous_memory_optimization
    num_slots: int | None = None  # number_checkpoints


@dataclass(frozen=True, slots=True)
class Options:
    store: StoreOptions = field(default_factory=StoreOptions)
    synchronize: bool = False  # synchronize_checkpoint_boundary
    profile: bool = False


def parse(section: object) -> Options | None:
    """The activation_checkpointing section's Options; None without a section."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"zero config: activation_checkpointing must be an object, got {section!r}")
    warn_unknown(section, KEYS, "activation_checkpointing.")
    flags = {key: as_bool(section.get(key, False), f"activation_checkpointing.{key}") for key in FLAGS}
    slots = section.get("number_checkpoints")
    if slots is not None:
        slots = as_int(slots, "activation_checkpointing.number_checkpoints", 1)
    contiguous = flags["contiguous_memory_optimization"]
    if contiguous and not flags["partition_activations"]:
        raise ValueError("zero config: activation_checkpointing.contiguous_memory_optimization needs "
                         "partition_activations (as in DeepSpeed)")
    if contiguous and slots is None:
        raise ValueError("zero config: activation_checkpointing.contiguous_memory_optimization needs "
                         "number_checkpoints")
    store = StoreOptions(partition=flags["partition_activations"], cpu=flags["cpu_checkpointing"],
                         contiguous=contiguous, num_slots=slots)
    return Options(store, flags["synchronize_checkpoint_boundary"], flags["profile"])
