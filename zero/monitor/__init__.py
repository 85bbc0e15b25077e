"""DeepSpeed's logging in zero: the comms logger (comms_logger), the monitors
(csv_monitor, tensorboard, wandb) and the step timers (wall_clock_breakdown,
steps_per_print)."""
