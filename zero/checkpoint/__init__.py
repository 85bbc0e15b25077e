"""Checkpoints: the file format and its checks (format.py, tensorfile.py),
the atomic collective save (save.py) and the all-or-nothing load (load.py,
agreed through barrier.py) of an engine's stateful parts, each saving and
loading itself (parts.py), DeepSpeed's layout both ways (deepspeed_layout.py,
deepspeed_files.py, to_deepspeed.py) with its optimizers' states
(deepspeed_optim.py), offline consolidation (to_fp32.py), the whole model
as files one tensor at a time, in Hugging Face's shards (model_files.py), and
where those converters may write: never into their source (output.py); and
in-memory snapshots every few steps in /dev/shm with a buddy's copy
(snapshot.py, their config section snapshot_config.py, a piece's folders
and small files snapshot_piece.py, placement and transfer snapshot_wire.py), which engine.resume() restores from, or from the
disk checkpoint when newer (snapshot_restore.py)."""
