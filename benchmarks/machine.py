"""The CPU a benchmark ran on, and the build of ringcomm's kernels it used, for
the benchmarks' headers and JSON; where the JSON goes; this process's memory
(status_kib)."""
from __future__ import annotations

import json
import os
import platform


def write_json(path: str, report: object) -> None:
    """`report` as JSON at `path`, its folder made if missing."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (/proc/cpuinfo), else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_line() -> str:
    """One header line: the CPU, the kernels in use, what was built and what this CPU runs."""
    import ringcomm

    found = ringcomm.cpu_capabilities()
    march = f"-march={found.march}" if found.march else "the compiler's default"
    return (f"cpu {cpu_model()} ({platform.machine()}); ringcomm kernels: {found.active} "
            f"(built for {march}: {', '.join(found.built)}; this CPU runs {', '.join(found.supported)})")


def status_kib(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")
