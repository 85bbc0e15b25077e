"""DeepSpeed's logging in zero: the comms logger (comms.py, comms_logger), the
monitors (monitors.py: csv_monitor, tensorboard, wandb), the step timers
(step_log.py: wall_clock_breakdown, steps_per_print), their config sections
(config.py), and their set-up at zero.initialize, agreed across ranks (setup.py)."""
