"""The memory limits `dostune tune` searches under, and what the search sets so that a schedule keeps within them.

GPU. By default a schedule may fill the GPU: its predicted peak up to the GPU's memory less a headroom of
GPU_HEADROOM_SHARE of it, and what it stages during the step up to the free memory the model profile measured in the
step less the same headroom. ``--max-peak-increase X`` holds the peak to ZeRO-Offload's measured peak times 1 + X
instead: the equal-memory comparison (its default of 10% kept a 3.8B GPT-2 on an H200 at 38.5 GiB of the GPU's
141 GB, where ZeRO-3 without offload fits in 85 GiB).

Host. The pinned memory of one node's ranks together stays under the tuner's host budget (world.host_budget: the RAM
available less a margin). The search sets what costs host memory to fit it: resident subgroups (as many as the GPU
holds) and how many CPU-lane subgroups update speculatively during backward (``speculative_subgroups``), so a
schedule needs more host memory than ZeRO-Offload at the same settings only where the host has room. A model is
refused only when no schedule's host memory fits: not even one with every subgroup the GPU can hold resident.

Every byte is counted by the optimizer's own footprints (optim/footprint.py), the same functions its start-up checks
and the performance model call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..dsconfig import DEFAULT_SUB_GROUP_SIZE
from ..errors import DostuneError
from ..optim.footprint import HALF_BYTES, gpu_step_bytes, pinned_host_bytes
from ..optim.schedule import ScheduleConfig, gpu_fraction_for, make_plan
from ..perfmodel.inputs import ModelInputs
from ..perfmodel.memory import GiB
from ..perfmodel.subgroups import subgroup_sizes
from ..perfmodel.world import node_pinned_gib
from ..profile.record import NodeProfile

if TYPE_CHECKING:
    from .space import Space

# The share of the GPU's memory no schedule's predicted peak may take. The prediction counts what torch allocates;
# beside it the CUDA context, NCCL's buffers and the caching allocator's unused reserved memory take device memory
# too: in the shipped model profiles the allocator reserved 1.8 GiB over the 19.3 GiB allocated at backward's peak
# (H200) and 3.6 GiB over it (H100), 9 to 19% of the allocation, in segments it can release and reuse under pressure.
GPU_HEADROOM_SHARE = 0.10



def gpu_headroom_gib(capacity_gib: float) -> float:
    return GPU_HEADROOM_SHARE * capacity_gib


def usable_gpu_gib(capacity_gib: Optional[float]) -> Optional[float]:
    """The GPU memory a schedule may fill: the GPU's less the headroom (None: unknown)."""
    return capacity_gib - gpu_headroom_gib(capacity_gib) if capacity_gib is not None else None


def gpu_capacity_gib(m: Optional[ModelInputs], node: NodeProfile) -> Optional[float]:
    """The GPU's memory: as the model profile measured it, else as the node profile recorded it (None on a profile
    without a GPU)."""
    if m is not None and m.gpu_total_gib is not None:
        return m.gpu_total_gib
    return node.gpu.memory_gib if node.gpu is not None else None


def unprofiled_step_ceiling_gib(numels: list[int], node: NodeProfile, world_size: int = 1) -> Optional[float]:
    """What a schedule may stage on the GPU during the step where no model profile measured the step's free memory:
    the GPU less the headroom and the half-precision parameter partition at DeepSpeed's default sub_group_size. A
    ceiling: activations and gathered layers come on top of it. None on a node profile without a GPU."""
    usable = usable_gpu_gib(gpu_capacity_gib(None, node))
    if usable is None:
        return None
    return usable - HALF_BYTES * sum(subgroup_sizes(numels, DEFAULT_SUB_GROUP_SIZE, world_size)) / GiB


def peak_limit_gib(m: ModelInputs, capacity_gib: Optional[float],
                   max_peak_increase: Optional[float]) -> Optional[float]:
    """The predicted peak GPU memory a schedule may reach: ZeRO-Offload's measured peak times 1 + max_peak_increase
    when it is given (equal memory), else the GPU's memory less the headroom. None without a model profile (the
    search then has no peak to hold)."""
    if m.offload_peak_gib is None:
        return None
    if max_peak_increase is not None:
        return m.offload_peak_gib * (1 + max_peak_increase)
    return usable_gpu_gib(capacity_gib)


def step_budget_gib(free_step_gib: float, capacity_gib: float) -> float:
    """What a schedule may stage on the GPU during the step: the free memory the model profile measured there less
    the headroom."""
    return max(0.0, free_step_gib - gpu_headroom_gib(capacity_gib))


def limits_line(space: "Space", capacity_gib: Optional[float], max_peak_increase: Optional[float]) -> str:
    """The limits the search ran under, in words (tune.json's details)."""
    if space.max_peak_gib is None:
        gpu = "no peak GPU memory limit (no model profile)"
    elif max_peak_increase is not None:
        gpu = (f"peak GPU memory at most {space.max_peak_gib:.1f} GiB, ZeRO-Offload's measured peak plus "
               f"{max_peak_increase:.0%} (--max-peak-increase: equal memory)")
    else:
        gpu = (f"peak GPU memory at most {space.max_peak_gib:.1f} GiB, the GPU's {capacity_gib:.1f} GiB less a "
               f"{gpu_headroom_gib(capacity_gib):.1f} GiB headroom ({GPU_HEADROOM_SHARE:.0%})")
    budget = "" if space.budget_gib is None else f", at most {space.budget_gib:.1f} GiB staged during the step"
    host = "" if space.host_budget_gib is None else (f"; the node's ranks pin at most {space.host_budget_gib:.1f} "
                                                     "GiB of host memory together")
    return f"memory limits: {gpu}{budget}{host}"


def _node_pinned(space: "Space", sizes, sched: ScheduleConfig) -> float:
    # as Space.violations counts it: the prediction's pinned host memory (perfmodel/memory.py) for the node's ranks
    return node_pinned_gib(pinned_host_bytes(sizes, make_plan(len(sizes), sched), sched) / GiB, space.world)


def fit_speculation(space: "Space", sub_group_size: int, sched: ScheduleConfig) -> ScheduleConfig:
    """``sched`` with as many CPU-lane subgroups speculating during backward as the node's host budget holds: all of
    them where it has room (the field left at None), else the most that fit (0: none; the schedule is then scored
    infeasible only if even that does not fit). Speculation hides CPU-lane work under backward, so more is never
    predicted slower, and the most that fit is the search's pick. ``sched`` unchanged without overlap_backward or
    without a host budget."""
    if not sched.overlap_backward or space.host_budget_gib is None:
        return sched
    sizes = space.sizes(sub_group_size)
    if _node_pinned(space, sizes, sched) <= space.host_budget_gib:
        return sched
    lo, hi = 0, len(make_plan(len(sizes), sched).cpu_order)  # the most that fit lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _node_pinned(space, sizes, sched.model_copy(update={"speculative_subgroups": mid})) <= space.host_budget_gib:
            lo = mid
        else:
            hi = mid
    return sched.model_copy(update={"speculative_subgroups": lo})


@dataclass(frozen=True)
class LeastHost:
    """The schedule that needs the least host memory at one sub_group_size: the GPU lane as many of the first
    subgroups as the GPU can hold, all resident, nothing during backward."""

    sub_group_size: int
    schedule: ScheduleConfig
    node_pinned_gib: float  # what the node's ranks pin together with it


def least_host(space: "Space", gpu_room_gib: Optional[float]) -> LeastHost:
    """The least host memory any schedule of ``space`` pins, and that schedule. ``gpu_room_gib``: what a rank's GPU
    may hold of the optimizer's own (None: unknown, nothing resident); what the model itself takes is not
    subtracted, so this is a floor: a schedule the search finds needs at least as much."""
    best = None
    for sgs in space.sub_group_sizes:
        sizes = space.sizes(sgs)
        n = len(sizes)

        def resident(k: int) -> ScheduleConfig:
            return ScheduleConfig(gpu_fraction=gpu_fraction_for(k, n), gpu_placement="first", staging_buffers=1,
                                  grads_on_gpu=True, resident_subgroups=k, expected_subgroups=n)

        def fits(k: int) -> bool:
            s = resident(k)
            return gpu_step_bytes(sizes, make_plan(n, s), s) / GiB <= gpu_room_gib

        lo = 0  # the most resident subgroups the room holds: their GPU memory grows with their number
        if gpu_room_gib is not None:
            hi = n + 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        sched = resident(lo)
        found = LeastHost(sgs, sched, _node_pinned(space, sizes, sched))
        if best is None or found.node_pinned_gib < best.node_pinned_gib:
            best = found
    return best


class HostTooSmall(DostuneError):
    """No schedule's host memory fits the node's: ``least`` is the schedule that comes nearest, of ``space``."""

    def __init__(self, message: str, space: "Space", least: LeastHost, hint: Optional[str] = None):
        super().__init__(message, hint=hint)
        self.space, self.least = space, least


def check_host_room(space: "Space", model: str, gpu_room_gib: Optional[float]) -> LeastHost:
    """Refuse (HostTooSmall) a model whose offloaded state no schedule fits in the node's host budget, before
    anything else is asked of the profiles (profiling it would be ended by the OOM killer)."""
    least = least_host(space, gpu_room_gib)
    host = space.host_budget_gib
    if host is not None and least.node_pinned_gib > host:
        w = space.world
        raise HostTooSmall(f"{w.describe()}: the {w.gpus_per_node} rank(s) of a node pin at least "
                           f"{least.node_pinned_gib:.1f} GiB of host memory for {model}'s offloaded optimizer state, "
                           f"more than the node's {host:.1f} GiB", space, least,
                           hint=f"`dostune plan --model {model}` shows what each offload method needs on this node; "
                                "spread it over more ranks (--num-gpus, --nodes), or give --host-memory-budget in GiB "
                                "if the node has more")
    return least
