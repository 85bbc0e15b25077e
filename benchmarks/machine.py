"""The CPU a benchmark ran on, and the build of ringcomm's kernels it used, for
the benchmarks' headers and JSON; where the JSON goes; this process's memory
(status_kib)."""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess


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
    """One header line: the CPU and one core's caches, the kernels in use, what was
    built and what this CPU runs."""
    import ringcomm
    from ringcomm.core.host import cache_nbytes

    found = ringcomm.cpu_capabilities()
    march = f"-march={found.march}" if found.march else "the compiler's default"
    caches = ", ".join(f"L{level} {size >> 10} KiB" for level in (1, 2, 3) if (size := cache_nbytes(level)))
    return (f"cpu {cpu_model()} ({platform.machine()}; {caches or 'caches unknown'}); ringcomm kernels: "
            f"{found.active} (built for {march}: {', '.join(found.built)}; this CPU runs {', '.join(found.supported)})")


def join_cgroup(folder: str) -> None:
    """Moves this process into the cgroup `folder` (root)."""
    with open(os.path.join(folder, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def reset_peak() -> None:
    """VmHWM := VmRSS: the peak resident memory from here on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def status_kib(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def io_bytes() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (/proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def dd_rate(command: list[str]) -> float:
    """GB/s as dd reports it."""
    out = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(match[1]) / float(match[2]) / 1e9


def disk_rates(folder: str, gib: float) -> tuple[float, float]:
    """The disk's sequential (write, read) rate in GB/s, O_DIRECT, 8 MiB requests."""
    path = os.path.join(folder, "probe")
    count = max(int(gib * 128), 1)
    try:
        write = dd_rate(["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "oflag=direct", "conv=fsync"])
        read = dd_rate(["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"])
    finally:
        os.unlink(path)
    return write, read
