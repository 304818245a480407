"""What a schedule holds in GPU and host memory over an iteration (docs/performance-model.md, "Memory"), with the
optimizer's own footprints (optim/footprint.py), and when in backward each subgroup's gradients arrive and are final,
interpolated from the model profile."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..optim.footprint import GRAD_BYTES, gpu_step_bytes, pinned_host_bytes, resident_bytes
from ..optim.schedule import Plan, ScheduleConfig, make_plan
from .inputs import ModelInputs

GiB = 2**30


@dataclass
class MemoryPrediction:
    peak_gpu_gib: Optional[float]  # None without a model profile
    extra_step_gib: float  # staging, kept gradients and upload buffers during the step
    extra_bwd_gib: float  # kept gradients already allocated at backward's peak
    pinned_host_gib: float


def predict_memory(sizes: Sequence[int], sched: ScheduleConfig, m: ModelInputs,
                   grad_alloc_fraction: Optional[Sequence[float]] = None,
                   plan: Optional[Plan] = None) -> MemoryPrediction:
    """The memory of ``plan`` (``make_plan``'s by default), with the optimizer's own footprints.
    ``grad_alloc_fraction[i]``: how far into backward (0..1) subgroup i's kept-gradient buffer is allocated
    (its first gradient). Backward's memory is taken to fall linearly from its peak at the start to its
    minimum at the end (as the measured timeline shows); the buffers add to it from their allocation on."""
    plan = plan or make_plan(len(sizes), sched)
    gpu = [s.subgroup for s in plan.gpu_slots]  # kept gradients; the resident subgroups' are in ``resident``
    extra_step = gpu_step_bytes(sizes, plan, sched) / GiB
    extra_bwd = 0.0
    if sched.grads_on_gpu and gpu and m.peak_bwd_gib is not None:
        fr = grad_alloc_fraction or [0.0] * len(sizes)  # unknown: assume allocated at backward's start
        base = m.peak_bwd_gib - (m.peak_step_gib or 0.0)  # what backward frees by its end
        extra_bwd = max(
            (m.peak_bwd_gib - base * phi) + sum(sizes[i] * GRAD_BYTES for i in gpu if fr[i] <= phi) / GiB
            - m.peak_bwd_gib for phi in sorted({0.0, *(fr[i] for i in gpu)}))
        extra_bwd = max(0.0, extra_bwd)
    resident = resident_bytes(sizes, plan) / GiB  # in every phase (and already in extra_step)
    peak = None
    if m.offload_peak_gib is not None:
        step_base = m.peak_step_gib or 0.0
        peak = max((m.peak_fwd_gib or 0.0) + resident, (m.peak_bwd_gib or 0.0) + extra_bwd + resident,
                   step_base + extra_step)
    return MemoryPrediction(peak_gpu_gib=peak, extra_step_gib=extra_step, extra_bwd_gib=extra_bwd,
                            pinned_host_gib=pinned_host_bytes(sizes, plan, sched) / GiB)


def _profile_ready_edges(profile_sizes: Sequence[int], profile_ready: Sequence[Optional[float]],
                         backward_s: float) -> Optional[list[tuple[int, int, float]]]:
    """The model profile's subgroups as (first element, end, fraction of backward when all their gradients
    were final); None when the profile does not say."""
    if not profile_sizes or backward_s <= 0 or any(r is None for r in profile_ready):
        return None
    edges, pos = [], 0
    for ps, r in zip(profile_sizes, profile_ready):
        edges.append((pos, pos + ps, r / backward_s))
        pos += ps
    return edges


def _ready_at(edges: list[tuple[int, int, float]], pos: float) -> Optional[float]:
    return next((r for a, b, r in edges if a <= pos < b), None)


def grad_ready_fractions(sizes: Sequence[int], profile_sizes: Sequence[int],
                         profile_ready: Sequence[Optional[float]], backward_s: float) -> Optional[list[float]]:
    """How far into backward (0..1) each subgroup's gradients are all final: when the element at its start is,
    interpolated from the model profile's per-subgroup readiness at its own sub_group_size. None if unknown."""
    edges = _profile_ready_edges(profile_sizes, profile_ready, backward_s)
    if edges is None:
        return None
    out, acc = [], 0
    for s in sizes:
        r = _ready_at(edges, acc)
        out.append(1.0 if r is None else min(1.0, r))
        acc += s
    return out


def grad_alloc_fractions(sizes: Sequence[int], profile_sizes: Sequence[int],
                         profile_ready: Sequence[Optional[float]], backward_s: float) -> list[float]:
    """When (as a fraction of backward) each subgroup's first gradient arrives, interpolated by element position
    from the model profile's per-subgroup readiness at its own sub_group_size. A subgroup's first gradient comes
    when the subgroup after it (in element order) is complete."""
    edges = _profile_ready_edges(profile_sizes, profile_ready, backward_s)
    if edges is None:
        return [0.0] * len(sizes)
    out, acc = [], 0
    for s in sizes:
        r = _ready_at(edges, acc + s)
        out.append(min(1.0, edges[-1][2] if r is None else r) if acc + s < edges[-1][1] else 0.0)
        acc += s
    return out
