"""The figure of `dostune profile --model --plot`: the memory of the recorded iteration over its time, allocated and
reserved, with its forward, backward and step shaded."""
from __future__ import annotations

import os

from ..records import save_figure
from .model_record import ModelProfile


def plot_memory_timeline(p: ModelProfile, path) -> "os.PathLike":
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = p.memory_timeline
    fig, ax = plt.subplots(figsize=(11, 4))
    colors = {"fwd": "#cfe8ff", "bwd": "#ffe0c7", "step": "#d9f2d0"}
    for ph in ("fwd", "bwd", "step"):
        ts = [s.t for s in tl if s.phase == ph]
        if ts:
            ax.axvspan(min(ts), max(ts), color=colors[ph], alpha=0.8, label=f"{ph} ({max(ts) - min(ts):.3f} s)")
    ax.plot([s.t for s in tl], [s.allocated_gib for s in tl], color="black", lw=1.2, label="allocated")
    ax.plot([s.t for s in tl], [s.reserved_gib for s in tl], color="gray", lw=1, ls="--", label="reserved")
    ax.set_xlabel("seconds from the start of the iteration")
    ax.set_ylabel("GiB" if p.device == "cuda" else "GiB (process RSS)")
    ax.set_title(f"{p.model}, micro-batch {p.micro_batch}, seq {p.seq}, {p.precision}: memory over one iteration "
                 f"({p.node})")
    ax.legend(loc="upper right", fontsize=8)
    return save_figure(fig, path)
