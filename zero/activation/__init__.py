"""Activation checkpointing, DeepSpeed's `deepspeed.checkpointing`:
recomputation from saved-tensor hooks and whose state it runs on
(checkpointing.py), as its config section says (config.py), what it holds
(stats.py) and where the checkpointed inputs wait: on the device, on the
host, partitioned or in preallocated slots (store.py)."""
