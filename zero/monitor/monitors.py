"""DeepSpeed's monitors on rank 0: csv_monitor (one CSV per tag,
output_path/job_name/<tag with / as _>.csv), tensorboard (torch.utils.tensorboard
events in output_path/job_name) and wandb; events are (tag, value, step) with
DeepSpeed's tags (Train/Samples/train_loss, .../lr, .../loss_scale) and the
number of samples seen as the step."""
from __future__ import annotations

import csv
import importlib.util
import os
import tempfile
from typing import Protocol

from .config import MonitoringConfig, MonitorOptions

Event = tuple[str, float, int]


class Monitor(Protocol):
    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def writable_folder(path: str, *, mode: int = 0o777) -> None:
    """Makes the folder `path` (and its parents) and a file in it, removed at
    once: an OSError now, naming the OS's reason, rather than at the first write."""
    os.makedirs(path, mode=mode, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass


def log_folder(key: str, options: MonitorOptions) -> str:
    """output_path/job_name, made and writable, else ValueError naming the key, the folder and the OS's reason."""
    folder = os.path.join(options.output_path, options.job_name)
    try:
        writable_folder(folder)
    except OSError as error:
        raise ValueError(f"zero config: {key}.output_path {options.output_path!r} (job_name {options.job_name!r}): "
                         f"cannot write in {folder}: {error.strerror or error}") from error
    return folder


class CsvMonitor:
    def __init__(self, options: MonitorOptions) -> None:
        self.log_dir = log_folder("csv_monitor", options)
        self._started: set[str] = set()

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            name = tag.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, f"{name}.csv"), "a+", newline="") as out:
                writer = csv.writer(out)
                if name not in self._started:
                    self._started.add(name)
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardMonitor:
    def __init__(self, options: MonitorOptions) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError("zero config: tensorboard.enabled needs the tensorboard package "
                               "(pip install tensorboard, or ringcomm[tensorboard])") from err
        self.log_dir = log_folder("tensorboard", options)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbMonitor:
    def __init__(self, options: MonitorOptions) -> None:
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("zero config: wandb.enabled needs the wandb package (pip install wandb)") from err
        self._wandb = wandb
        try:
            wandb.init(project=options.project, group=options.group, entity=options.team)
        except Exception as error:  # wandb's own errors (login, network): named, and agreed on (setup.py)
            raise RuntimeError(f"zero config: wandb: wandb.init(project={options.project!r}, group={options.group!r}, "
                               f"entity={options.team!r}) failed: {type(error).__name__}: {error}") from error

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self._wandb.log({tag: value}, step=step)

    def close(self) -> None:
        self._wandb.finish()


def make_monitors(config: MonitoringConfig, rank: int) -> list[Monitor]:
    """The enabled monitors, on rank 0 (every other rank writes nothing, as in
    DeepSpeed); every rank checks that their packages are installed. Call it
    through setup.open_step_log, which agrees on the outcome across ranks."""
    for options, module in ((config.tensorboard, "tensorboard"), (config.wandb, "wandb")):
        if options.enabled and importlib.util.find_spec(module) is None:
            raise RuntimeError(f"zero config: {module}.enabled needs the {module} package "
                               f"(pip install {module}) on rank {rank}")
    if rank != 0:
        return []
    kinds = ((config.csv_monitor, CsvMonitor), (config.tensorboard, TensorBoardMonitor), (config.wandb, WandbMonitor))
    made: list[Monitor] = []
    try:
        for options, kind in kinds:
            if options.enabled:
                made.append(kind(options))
    except BaseException:  # one failed: close those made before it (tensorboard's writer thread)
        for monitor in made:
            monitor.close()
        raise
    return made
