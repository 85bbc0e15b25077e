"""peers.py's plot: busbw vs size, one log-log panel per op, one line per peer
(median over rounds), memcpy as the dashed limit line."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from peers_report import LABELS  # noqa: E402


def plot(args, header: dict, stats: dict, path: str) -> None:
    fig, axes = plt.subplots(1, len(args.ops), figsize=(5.5 * len(args.ops), 4.4), squeeze=False)
    for ax, op in zip(axes[0], args.ops):
        for peer in LABELS:
            key_op = "copy" if peer == "memcpy" else op
            points = sorted((s["nbytes"], s["busbw"]["median"]) for (o, _, p), s in stats.items()
                            if o == key_op and p == peer and s["wrong"] == 0)
            if points:
                style = dict(linestyle="--", color="gray") if peer == "memcpy" else dict(marker="o")
                ax.plot(*zip(*points), label=LABELS[peer], **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s; memcpy: S / time)")
        ax.set_title(f"{op}, {header['world_size']} ranks, float32")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ringcomm vs peers on {header['host']} ({header['cpus']} cpus, load {header['loadavg_start']})")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
