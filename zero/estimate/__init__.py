"""`python -m zero.estimate` and `zero.estimate.estimate(...)`: the memory table per
stage, communication, activations and buffers, and the out-of-memory ladder
(arithmetic in memory_model.py), for a parameter count, a model built on the
meta device, or transformer shapes (also from a Hugging Face config.json).

    python -m zero.estimate --params 7.5e9 --ranks 64
    python -m zero.estimate --model pkg.module:build_fn --ranks 8 --seq 2048 --micro-batch 4 \\
        --device-memory 80GB --host-memory 1TB --write ds_config.json

The room: the closed forms of memory and traffic (memory_model.py), the
counts, the table and its text (report.py) and the command line (__main__).
"""


def __getattr__(name: str):
    """The public names of report.py (estimate, count_model, shape_from_hf, ...),
    imported on first use; memory_model and report are submodules."""
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    report = importlib.import_module(f"{__name__}.report")
    try:
        return getattr(report, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
