"""DeepSpeed's step taken apart while `dostune profile --model` times it: the parts outside the per-subgroup updates
(its prologue and epilogue helpers, the engine's own work around ``optimizer.step``), and DeepSpeedCPUAdam and the
gradient unscale per subgroup as DeepSpeed's step calls them.

The performance model takes from these where the interleaved step's lanes may start (the prologue's share of the
step overhead, and of it the parameter release's) and how fast CPU Adam and the unscale run in this engine's own
memory, with their fixed cost per subgroup (docs/performance-model.md). Profiling only: the wrappers are removed
before the engine is destroyed.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from ..stats import Stat
from .record import Sample, Series, fit_series

# DeepSpeed 0.19.8's DeepSpeedZeroOptimizer_Stage3.step, in its order. Before the subgroup loop:
PROLOGUE = ("_pre_step", "_partition_all_parameters", "_overflow_check_and_loss_scale_update", "_get_norm_groups",
            "_loss_scale_update_and_overflow_cleanup")
# ... of which the release of the gathered parameters (dostune computes the gradient norm before it, so its lanes
# can run under it):
RELEASE = "_partition_all_parameters"
EPILOGUE = ("_post_step",)
ENGINE = "engine"  # the engine's step outside optimizer.step (after it: zeroing gradients, its counters)
# Called once per subgroup, with the subgroup's index first:
UNSCALE, CPU_ADAM = "unscale_and_clip_grads", "_optimizer_step"


class StepParts:
    """Times one optimizer instance's step helpers (profiling only), one step at a time: ``reset`` before a step,
    ``close(step_s)`` after it with the step's wall time; ``summary`` then takes the medians over the closed steps."""

    def __init__(self, opt):
        self.opt, self._orig = opt, {}
        self._parts: dict[str, float] = {}
        self._calls: dict[str, dict[int, float]] = {UNSCALE: {}, CPU_ADAM: {}}
        self._opt_step_s = 0.0
        self.steps: list[tuple[dict[str, float], dict[str, dict[int, float]]]] = []
        for name in PROLOGUE + EPILOGUE + (UNSCALE, CPU_ADAM, "step"):
            orig = getattr(opt, name)
            self._orig[name] = orig
            setattr(opt, name, self._timed(name, orig))

    def _timed(self, name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                if name == "step":
                    self._opt_step_s += dt
                elif name in self._calls:
                    calls = self._calls[name]
                    calls[a[0]] = calls.get(a[0], 0.0) + dt
                else:
                    self._parts[name] = self._parts.get(name, 0.0) + dt
        return run

    def reset(self) -> None:
        self._parts, self._opt_step_s = {}, 0.0
        self._calls = {UNSCALE: {}, CPU_ADAM: {}}

    def overhead(self, step_s: float) -> float:
        """The step's time outside the per-subgroup updates: the engine's own work and DeepSpeed's prologue and
        epilogue."""
        return step_s - self._opt_step_s + sum(self._parts.values())

    def close(self, step_s: float) -> float:
        """Keep this step's parts; returns its overhead."""
        parts = dict(self._parts)
        parts[ENGINE] = max(0.0, step_s - self._opt_step_s)
        self.steps.append((parts, {k: dict(v) for k, v in self._calls.items()}))
        return self.overhead(step_s)

    def keep_steps(self, indices: list[int]) -> None:
        """Keep only the closed steps at ``indices`` (those of the iterations a measurement kept, QuietRuns)."""
        self.steps = [self.steps[i] for i in indices]

    def restore(self) -> None:
        for name, fn in self._orig.items():
            setattr(self.opt, name, fn)

    def summary(self, numels: list[int], threads: Optional[int] = None) -> tuple[dict[str, float], Optional[Series],
                                                                                Optional[Series]]:
        """(median seconds per step of each prologue/epilogue part and the engine's; DeepSpeedCPUAdam and the unscale
        as Series over the subgroups' sizes, None where the steps did not call them)."""
        if not self.steps:
            return {}, None, None
        names = sorted({n for parts, _ in self.steps for n in parts})
        parts = {n: round(statistics.median(p.get(n, 0.0) for p, _ in self.steps), 6) for n in names}
        threads = threads or torch.get_num_threads()

        def series(name: str) -> Optional[Series]:
            points = []
            for i, n in enumerate(numels):
                times = [calls[name][i] for _, calls in self.steps if i in calls[name]]
                if times and n > 0:
                    points.append(Sample(size=n, threads=threads, seconds=Stat.of(times)))
            return fit_series("elements", points) if points else None

        return parts, series(CPU_ADAM), series(UNSCALE)


def prologue_shares(step_parts_s: dict[str, float]) -> Optional[tuple[float, float]]:
    """(the prologue's share, the parameter release's share) of DeepSpeed's step overhead as a model profile measured
    them; None when it did not (older profiles) or measured no overhead."""
    total = sum(step_parts_s.values())
    if not step_parts_s or total <= 0 or any(n not in step_parts_s for n in PROLOGUE):
        return None
    return sum(step_parts_s[n] for n in PROLOGUE) / total, step_parts_s[RELEASE] / total
