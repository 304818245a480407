"""Renderings of a benchmark result: rows for a table, markdown, and the update-timeline PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..host_steal import set_aside_text
from ..records import save_figure
from .record import BenchResult, RankFigures, Span

COLUMNS = ["method", "iter s", "fwd s", "bwd s", "step s", "speedup", "update G elem/s", "peak GPU GiB",
           "host peak GiB", "pinned GiB", "final loss"]
# a refusal's reason is the row's: host-memory refusals say how much was needed and how much there was
REASON_CHARS = 160


def _f(x: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def signed_swing(k: int) -> str:
    """A swing as it reads in a report: -2, 0, +1."""
    return f"{k:+d}" if k else "0"


def steps_by_swing_text(swings) -> str:
    """"3 at -2, 1 at 0, 4 at +1": how many of ``swings`` (one per step or iteration, or a dict swing -> count)
    ran at each swing."""
    counts = swings if isinstance(swings, dict) else {k: list(swings).count(k) for k in set(swings)}
    return ", ".join(f"{counts[k]} at {signed_swing(k)}" for k in sorted(counts))


def rows(res: BenchResult) -> list[list[str]]:
    out = []
    for name, m in res.methods.items():
        if not m.ran:
            reason = (m.error or "").splitlines()[0] if m.error else ""
            out.append([name, "did not run"] + [""] * (len(COLUMNS) - 3) + [reason[:REASON_CHARS]])
            continue
        sp = res.speedup(name)
        out.append([name, _f(m.iter_s), _f(m.fwd_s), _f(m.bwd_s), _f(m.step_s), _f(sp, "{:.2f}x"),
                    _f(m.update_gelem_s, "{:.2f}"), _f(m.peak_gpu_gib, "{:.1f}"), _f(m.host_peak_rss_gib, "{:.1f}"),
                    _f(m.host_pinned_gib, "{:.1f}"), _f(m.final_loss, "{:.4f}")])
    return out


def ceiling_lines(res: BenchResult) -> list[str]:
    """One line per method: its iteration time over no offload's, pooled and per round (none without no offload)."""
    out = []
    for name in res.methods:
        r = res.over_ceiling(name)
        if r is not None:
            rounds = f" (per round: {', '.join(f'{x:.2f}x' for x in r[1])})" if len(r[1]) > 1 else ""
            out.append(f"{name}: {r[0]:.2f}x no offload's iteration time{rounds}")
    return out


def set_aside_lines(res: BenchResult) -> list[str]:
    """One line per method that set timed iterations aside for steal, beside what the kept ones took."""
    out = []
    for name, m in res.methods.items():
        text = set_aside_text(m.set_aside) if m.ran else None
        if text:
            out.append(f"{name}: {text}, the kept ones {m.iter_s:.3f} s")
    return out


def describe_ranks(ranks: list[RankFigures]) -> str:
    """The slowest rank's phases and every rank's median iteration and peak GPU memory, on one line."""
    slow = max(ranks, key=lambda r: r.iter_s)
    each = ", ".join(f"rank {r.rank} {r.iter_s:.3f} s" + (f" / {r.peak_gpu_gib:.1f} GiB" if r.peak_gpu_gib is not None
                                                           else "") for r in ranks)
    return (f"slowest rank {slow.rank}: iteration {slow.iter_s:.3f} s = forward {slow.fwd_s:.3f} + backward "
            f"{slow.bwd_s:.3f} + step {slow.step_s:.3f}; iteration" + (" / peak GPU memory" if slow.peak_gpu_gib
                                                                        is not None else "") + f" per rank: {each}")


def rank_lines(res: BenchResult) -> list[str]:
    """Under the launcher, one line per method: its slowest rank (whose phases the table shows) and every rank's
    median iteration and peak memory."""
    return [f"{name}: {describe_ranks(m.ranks)}" for name, m in res.methods.items() if m.ran and m.ranks]


def _repeats(res: BenchResult) -> str:
    if res.rounds == 1:
        return f"medians of {res.iters} iterations after {res.warmup} warm-up"
    return (f"medians of {res.rounds} rounds x {res.iters} iterations ({res.warmup} warm-up each), the methods "
            f"in reverse order every other round")


def markdown(res: BenchResult) -> str:
    lines = [f"# dostune bench: {res.model} on {res.node}", "",
             f"{res.params / 1e9:.2f}B parameters, {res.precision}, micro-batch {res.micro_batch}, sequence {res.seq}, "
             f"world size {res.world_size}; {_repeats(res)}; "
             f"GPU {res.gpu}; DeepSpeed {res.deepspeed_version}, torch {res.torch_version}, dostune "
             f"{res.dostune_version}; {res.created}.", "",
             f"Command: `{res.command}`", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(res)]
    if res.rounds > 1:
        lines += ["", "Median iteration time of each round (s; odd rounds in the order above, even rounds reversed):",
                  ""]
        lines += [f"- `{n}`: " + ", ".join(f"{x:.3f}" for x in m.round_iter_s)
                  for n, m in res.methods.items() if m.ran]
    swings = [(n, m.swing) for n, m in res.methods.items() if m.ran and m.swing]
    if swings:
        per = max(1, len(swings[0][1]) // res.rounds)
        lines += ["", "The swing in each timed iteration, round by round (adaptive_swing; +k: k of the GPU lane's "
                  "subgroups on the CPU lane, -k: k of the CPU lane's on the GPU lane), and the iterations at each:",
                  ""]
        lines += [f"- `{n}`: " + " | ".join(" ".join(map(str, s[k:k + per])) for k in range(0, len(s), per))
                  + f" ({steps_by_swing_text(s)})" for n, s in swings]
    ranks = rank_lines(res)
    if ranks:
        lines += ["", f"{res.world_size} ranks on {res.nodes} node(s): each row is the slowest rank's, its peak "
                  "memory the highest of any rank.", ""] + [f"- {line}" for line in ranks]
    aside = set_aside_lines(res)
    if aside:
        lines += ["", "Set aside for steal (the hypervisor took the CPU; each iteration run again, the table holds the "
                  "kept ones):", ""] + [f"- {line}" for line in aside]
    ceiling = ceiling_lines(res)
    if ceiling:
        lines += ["", "Against no offload (the ceiling):", ""] + [f"- {line}" for line in ceiling]
    mem = [(n, m) for n, m in res.methods.items() if m.ran and m.phase_peak_gib]
    if mem:
        lines += ["", "Peak GPU memory allocated within each phase (GiB):", "", "| method | forward | backward | step |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {m.phase_peak_gib.get('fwd', 0):.2f} | {m.phase_peak_gib.get('bwd', 0):.2f} | "
                  f"{m.phase_peak_gib.get('step', 0):.2f} |" for n, m in mem]
    lines += ["", "Speedup is ZeRO-Offload's iteration time over the method's. Host peak: the method's process's peak "
              "resident set (VmHWM) from its engine's build on; pinned: the host memory page-locked for it, torch's "
              "pinned allocator's peak (DeepSpeed's pinned buffers among it) and what dostune page-locked in place "
              "(- without CUDA). Methods:", ""]
    lines += [f"- `{n}`: {m.description}" for n, m in res.methods.items()]
    failed = [m for m in res.methods.values() if not m.ran]
    if failed:
        lines += ["", "Methods that did not run here:", ""]
        lines += [f"- `{m.method}`: {(m.error or '').splitlines()[0]}" for m in failed]
    return "\n".join(lines) + "\n"


LANE_ORDER = ["cpu", "up", "h2d", "gpu", "d2h"]
LANE_LABEL = {"cpu": "CPU Adam", "up": "upload (CPU lane)", "h2d": "H2D (GPU lane)", "gpu": "GPU Adam",
              "d2h": "D2H (GPU lane)"}


def plot_timeline(spans: list[Span], path: str | Path, title: str) -> Optional[Path]:
    """One row per lane, a bar per subgroup (labelled with its index)."""
    if not spans:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [lane for lane in LANE_ORDER if any(s.lane == lane for s in spans)]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.6))
    colors = plt.get_cmap("tab20")
    for row, lane in enumerate(lanes):
        for s in (s for s in spans if s.lane == lane):
            ax.barh(row, (s.end - s.start) * 1e3, left=s.start * 1e3, color=colors(s.subgroup % 20),
                    edgecolor="black", linewidth=0.3)
            if (s.end - s.start) * 1e3 > 0.03 * max(x.end for x in spans) * 1e3:
                ax.text((s.start + s.end) / 2 * 1e3, row, str(s.subgroup), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), [LANE_LABEL[lane] for lane in lanes])
    ax.invert_yaxis()
    if any(s.start < 0 for s in spans):
        ax.axvline(0, color="black", linewidth=0.8, linestyle="--")  # left of it: during backward
    ax.set_xlabel("ms from the start of the optimizer step")
    ax.set_title(title)
    return save_figure(fig, path)
