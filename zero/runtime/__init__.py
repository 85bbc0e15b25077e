"""The engine's run: DeepSpeed's training-loop surface (engine.py) and how it
is assembled (build.py) from a DeepSpeed config (config.py, with the keys
accepted without effect in no_effect.py), with mixed precision and loss
scaling (precision.py), the optimizer and LR schedules DeepSpeed's configs
name (optim.py, lr_schedules.py)."""
