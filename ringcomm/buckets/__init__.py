"""Gradients in buckets, reduced while backward runs: buffer.py owns the flat
gradient storage laid out by the plan; launch.py starts one bucket's
collective without blocking (comm thread on CPU, comm stream on CUDA) and
times it; overlap.py holds the shared launcher and ZeRO's scheduler;
flat_scheduler.py is the DDP-style scheduler."""
