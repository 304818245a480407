"""Which subgroups the optimizer's CPU lane updates in which way, as the model predicts a schedule in a regime.

A regime is whether the steps clip their gradients: ``no_clip`` (the global gradient norm stays under the clipping
threshold, or clipping is off: overlap_backward's speculative updates during backward are committed) or ``clip`` (the
norm is above it, as it is at once on freshly initialised weights: the partial norm makes clipping certain at the
first CPU-lane subgroup whose gradients are final, speculation stops there, and every CPU-lane subgroup is updated in
the step). A schedule without overlap_backward runs the same in both.
"""
from __future__ import annotations

from typing import Literal, Optional

from ..optim.schedule import Plan, ScheduleConfig, make_plan

Regime = Literal["no_clip", "clip"]
REGIMES: tuple[Regime, ...] = ("no_clip", "clip")


def speculative_count(sched: ScheduleConfig) -> Optional[int]:
    """How many CPU-lane subgroups overlap_backward updates speculatively during backward (None: all of them), the
    schedule's ``speculative_subgroups``. The one place the model reads it: read by name, so that it takes effect
    wherever the schedule has the field, and a schedule without it updates them all, as before it existed."""
    return getattr(sched, "speculative_subgroups", None)


def speculating_subgroups(plan: Plan, count: Optional[int]) -> list[int]:
    """The CPU-lane subgroups that overlap_backward's worker takes (``count`` of them, None: all): those whose
    gradients are final first, the highest indices. The others are updated in the step by DeepSpeed's own update."""
    order = sorted(plan.cpu_order, reverse=True)
    return order if count is None else order[:max(0, count)]


def lent_subgroups(plan: Plan, sched: ScheduleConfig) -> frozenset[int]:
    """The CPU-lane subgroups of the schedule that ``plan`` streams through the GPU lane instead (a swing of the lane
    balance towards the GPU): their gradients stream in from DeepSpeed's fp32 host buffer with their states."""
    base = make_plan(len(plan.lanes), sched)
    return frozenset(s.subgroup for s in plan.gpu_slots) & frozenset(base.cpu_order)
