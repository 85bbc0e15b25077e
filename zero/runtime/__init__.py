"""The top room: DeepSpeed's training-loop surface (engine.py) and how it is
assembled (build.py) from a DeepSpeed config, which config.py composes from
the sections each room parses (with the keys accepted without effect in
no_effect.py), with mixed precision and loss scaling (precision.py), and
the host-memory check before it allocates (memory_guard.py)."""
