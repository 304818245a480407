"""Which subgroups the optimizer's CPU lane updates in which way, as the model predicts a schedule in a regime.

A regime is whether the steps clip their gradients: ``no_clip`` (the global gradient norm stays under the clipping
threshold, or clipping is off: overlap_backward's speculative updates during backward are committed) or ``clip`` (the
norm is above it, as it is at once on freshly initialised weights: the partial norm makes clipping certain at the
first CPU-lane subgroup whose gradients are final, speculation stops there, and every CPU-lane subgroup is updated in
the step). A schedule without overlap_backward runs the same in both.
"""
from __future__ import annotations

from typing import Literal

from ..optim.footprint import speculative_set
from ..optim.schedule import Plan, ScheduleConfig, make_plan

Regime = Literal["no_clip", "clip"]
REGIMES: tuple[Regime, ...] = ("no_clip", "clip")


def speculating_subgroups(plan: Plan, sched: ScheduleConfig) -> list[int]:
    """The CPU-lane subgroups of ``plan`` that overlap_backward's worker updates speculatively during backward: those
    with shadow buffers (footprint.speculative_set, the optimizer's own choice), highest index first. The worker
    updates the plan's other CPU-lane subgroups in place in the step."""
    shadowed = speculative_set(plan, sched)
    return sorted((i for i in plan.cpu_order if i in shadowed), reverse=True)


def lent_subgroups(plan: Plan, sched: ScheduleConfig) -> frozenset[int]:
    """The CPU-lane subgroups of the schedule that ``plan`` streams through the GPU lane instead (a swing of the lane
    balance towards the GPU): their gradients stream in from DeepSpeed's fp32 host buffer with their states."""
    base = make_plan(len(plan.lanes), sched)
    return frozenset(s.subgroup for s in plan.gpu_slots) & frozenset(base.cpu_order)
