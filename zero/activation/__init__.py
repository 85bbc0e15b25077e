"""Activation checkpointing, DeepSpeed's `deepspeed.checkpointing`:
recomputation from saved-tensor hooks (checkpointing.py) and where the
checkpointed inputs are held: on the device, on the host, partitioned or in
preallocated slots (store.py)."""
