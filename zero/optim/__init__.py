"""What every room's optimizer step uses, below them all: building the
optimizer DeepSpeed's config names, pointing it at the fp32 master slices and
unscaling inside its fused kernel (optimizers.py), DeepSpeed's LR schedules
(lr_schedules.py), the C++ Adam step on host masters (host_adam.py), and the
optimizer and scheduler config sections (config.py)."""
