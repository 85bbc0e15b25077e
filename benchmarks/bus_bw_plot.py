"""busbw vs size, one panel per op, one line per backend, memcpy as the limit line;
log-log, so that 8 B-1 MiB (latency-bound) is as readable as the large sizes."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(rows: list[dict], args, info: dict, path: str) -> None:
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op]
        for backend in args.backends:
            points = [(r["size"], r["oop"]["busbw"]) for r in mine if r["backend"] == backend]
            ax.plot(*zip(*points), marker="o", label=f"{backend} busbw")
        limit = sorted({(r["size"], r["memcpy_gbps"]) for r in mine})
        ax.plot(*zip(*limit), linestyle="--", color="gray", label="memcpy (limit)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # busbw spans 5 decades from 8 B to 128 MiB
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{op}, {info['world_size']} ranks, {args.datatype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"ringcomm ({info['ringcomm_transport']}) vs reference on {info['host']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
