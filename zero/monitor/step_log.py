"""What the engine logs per step, as DeepSpeed's engine does: the monitors'
events at each boundary step (rank 0), the progress line every steps_per_print
steps, and with wall_clock_breakdown the forward / backward / step times."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from .config import MonitoringConfig
from .monitors import Monitor

PHASES = ("forward", "backward", "step")


class StepLog:
    """Made at zero.initialize by setup.open_step_log (the monitors: rank 0's, made and agreed)."""

    def __init__(self, config: MonitoringConfig, rank: int, monitors: list[Monitor]) -> None:
        self.config, self.rank = config, rank
        self.monitors = monitors
        self.elapsed_ms = dict.fromkeys(PHASES, 0.0)  # this step's
        self._losses: list[float] = []  # this step's micro-batch losses

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Times one forward, backward or step when wall_clock_breakdown asks."""
        if not self.config.wall_clock_breakdown:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.elapsed_ms[phase] += (time.perf_counter() - start) * 1e3

    def loss(self, value: object) -> None:
        """A micro-batch's loss (as given to backward), while a monitor listens."""
        if self.monitors:
            self._losses.append(float(value.detach().float().mean()))

    def boundary(self, *, step: int, samples: int, skipped: int, lr: float, mom: object,
                 loss_scale: float | None) -> None:
        """After the boundary step `step` (1-based), `samples` seen so far."""
        if self.monitors:
            events = [("Train/Samples/train_loss", sum(self._losses) / max(len(self._losses), 1), samples),
                      ("Train/Samples/lr", lr, samples)]
            if loss_scale is not None:
                events.append(("Train/Samples/loss_scale", loss_scale, samples))
            if self.config.wall_clock_breakdown:  # DeepSpeed's backward_inner / _allreduce: ours overlap in backward
                events += [(f"Train/Samples/elapsed_time_ms_{phase}", self.elapsed_ms[phase], samples)
                           for phase in PHASES]
            for monitor in self.monitors:
                monitor.write_events(events)
        self._losses.clear()
        every = self.config.steps_per_print
        if every is not None and step % every == 0 and self.rank == 0:
            print(f"[Rank 0] step={step}, skipped={skipped}, lr={[lr]}, mom={[mom]}", flush=True)
            if self.config.wall_clock_breakdown:
                times = " | ".join(f"{phase}: {self.elapsed_ms[phase]:.2f}" for phase in PHASES)
                print(f"[Rank 0] time (ms) | {times}", flush=True)
        self.elapsed_ms = dict.fromkeys(PHASES, 0.0)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
