"""The figure of `dostune tune --validate`: for ZeRO-Offload and each validated schedule, the predicted and the
measured iteration side by side, each a stack of its phases (forward, backward, step), with the errors written on."""
from __future__ import annotations

import os
from pathlib import Path

from ..records import save_figure
from .record import TuneResult

PHASE_COLORS = {"fwd": "#8fb8de", "bwd": "#f4a259", "step": "#7fbf7b"}
PHASE_NAMES = {"fwd": "forward", "bwd": "backward", "step": "step"}


def _fmt(err) -> str:
    return "-" if err is None else f"{err:.0%}"


def plot_validation(res: TuneResult, path: "str | os.PathLike") -> Path:
    """Draw ``res.validation`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res.validation
    if not rows:
        raise ValueError("no validated rows to draw")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(rows) + 2), 4.8))
    width = 0.36
    for k, v in enumerate(rows):
        for side, (kind, hatch) in enumerate((("predicted", "//"), ("measured", ""))):
            x = k + (side - 0.5) * width * 1.08
            bottom = 0.0
            phases = [(ph, getattr(v, f"{kind}_{ph}_s")) for ph in ("fwd", "bwd", "step")]
            if any(t is None for _, t in phases):  # the iteration alone (no forward/backward predicted)
                phases = [("step", getattr(v, f"{kind}_step_s"))]
            for ph, t in phases:
                ax.bar(x, t, width, bottom=bottom, color=PHASE_COLORS[ph], hatch=hatch, edgecolor="black",
                       linewidth=0.5, label=PHASE_NAMES[ph] if (k, side) == (0, 1) else None)
                bottom += t
            ax.text(x, bottom, kind[:4] + ".", ha="center", va="bottom", fontsize=7)
        top = max(v.measured_iter_s, v.predicted_iter_s or v.predicted_step_s)
        ax.text(k, top * 1.06, f"iter {_fmt(v.iter_error)}\nbwd {_fmt(v.error('bwd'))} step {_fmt(v.step_error)}",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([v.label.split(" (")[0] for v in rows], fontsize=8)
    ax.set_ylabel("seconds per iteration (hatched: predicted)")
    ax.set_ylim(0, max(max(v.measured_iter_s, v.predicted_iter_s or 0.0) for v in rows) * 1.3)
    ax.set_title(f"{res.model}, micro-batch {res.micro_batch}: predicted against measured "
                 f"({Path(res.node_profile).stem})", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    return save_figure(fig, path)
