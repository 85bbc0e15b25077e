"""The CPU a benchmark ran on, and the build of ringcomm's kernels it used, for
the benchmarks' headers and JSON."""
from __future__ import annotations

import platform


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
