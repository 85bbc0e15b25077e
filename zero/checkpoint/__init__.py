"""Checkpoints: the file format and its checks (format.py, tensorfile.py),
the atomic collective save (save.py) and the all-or-nothing load (load.py,
agreed through barrier.py) of an engine's stateful parts, each saving and
loading itself (parts.py), DeepSpeed's layout both ways (deepspeed_layout.py,
deepspeed_files.py, to_deepspeed.py) with its optimizers' states
(deepspeed_optim.py), offline consolidation (to_fp32.py), the whole model
as files one tensor at a time, in Hugging Face's shards (model_files.py), and
where those converters may write: never into their source (output.py)."""
