"""`deepspeed.checkpointing`'s name for zero's activation checkpointing
(zero/activation/checkpointing.py), where DeepSpeed users reach it."""
from .activation.checkpointing import (ActivationStats, checkpoint, checkpoint_modules, configure, is_configured,
                                       measure, reset, stats)

__all__ = ["ActivationStats", "checkpoint", "checkpoint_modules", "configure", "is_configured", "measure", "reset",
           "stats"]
