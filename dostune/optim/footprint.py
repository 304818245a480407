"""What a schedule holds in memory, as functions of its Plan: the GPU memory of the step (staging slots, upload
buffer, kept gradients, resident states) and the pinned host memory (DeepSpeed's states and gradients, the CPU
lane's half-precision buffers, the shadow states of the CPU lane during backward). The optimizer's start-up checks
and the performance model both read them here, so the two cannot disagree."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from .schedule import Plan, ScheduleConfig, make_plan, updates_in_backward

STATE_BYTES = 12  # fp32 params, exp_avg, exp_avg_sq per element
GRAD_BYTES = 4  # an fp32 gradient per element
HALF_BYTES = 2  # a bf16/fp16 param per element
# The CPU lane during backward uploads its half-precision results from a ring of pinned buffers. The uploads of the
# subgroups left to the step queue behind the GPU lane's copies in: with only two buffers the worker waited for them
# (the H100 timeline of results/h100/nt-gpt2-1.3b: CPU Adam idle 38 ms), so the ring has as many as fit in this.
HALF_RING_BYTES = 512 * 2**20


def half_ring_count(subgroups: int, widest: int) -> int:
    """Buffers in the ring of the CPU lane during backward: as many as fit in HALF_RING_BYTES, at least two, at most
    one per subgroup it may update."""
    return max(2, min(subgroups, HALF_RING_BYTES // max(1, widest * HALF_BYTES)))


def cpu_lane_reach(plan: Plan) -> list[int]:
    """Every subgroup the CPU lane may update: its own, and those adaptive_swing may move to it."""
    return list(plan.cpu_order) + list(plan.swing_candidates)


def resident_bytes(sizes: Sequence[int], plan: Plan) -> int:
    """GPU memory the resident subgroups' fp32 params and Adam states hold for the whole run."""
    return STATE_BYTES * sum(sizes[i] for i in plan.resident)


def gpu_step_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig) -> int:
    """GPU memory the interleaved update holds during the step: the staging slots (the widest streamed subgroup's
    states, and its gradients when they are not kept), the CPU lane's fp32 upload buffer (gpu_convert), the gradients
    kept on the GPU for GPU-lane subgroups, and the resident states."""
    streamed = [sizes[s.subgroup] for s in plan.gpu_slots]
    slot_bytes = STATE_BYTES + (0 if sched.grads_on_gpu else GRAD_BYTES)
    slots = min(sched.staging_buffers, len(streamed)) * max(streamed, default=0) * slot_bytes
    up = max((sizes[i] for i in plan.cpu_order), default=0) * 4 if sched.upload == "gpu_convert" else 0
    kept = sum(sizes[i] for i in plan.gpu_subgroups) * GRAD_BYTES if sched.grads_on_gpu else 0
    return slots + up + kept + resident_bytes(sizes, plan)


def backward_lane_host_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig) -> int:
    """Pinned host memory the CPU lane during backward adds: a shadow copy of the fp32 params and Adam states of
    every subgroup it may update (allocated at start-up), and its ring of half-precision buffers."""
    if not updates_in_backward(plan, sched):
        return 0
    reach = cpu_lane_reach(plan)
    widest = max(sizes[i] for i in reach)
    return STATE_BYTES * sum(sizes[i] for i in reach) + half_ring_count(len(reach), widest) * widest * HALF_BYTES


def pinned_host_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig) -> int:
    """Pinned host memory of the run: DeepSpeed's fp32 states and gradients and its pinned gradient-partition
    buffer, the half-precision buffers of the CPU lane at the step (cpu_convert: two of the widest subgroup it may
    update), and what the CPU lane during backward adds."""
    pinned = (STATE_BYTES + GRAD_BYTES + GRAD_BYTES) * sum(sizes)
    reach = cpu_lane_reach(plan)
    if sched.upload == "cpu_convert" and reach and not updates_in_backward(plan, sched):
        pinned += 2 * max(sizes[i] for i in reach) * HALF_BYTES
    return pinned + backward_lane_host_bytes(sizes, plan, sched)


# ---------------------------------------------------------------- start-up checks
def _sizes(opt) -> list[int]:
    return [int(n) for n in opt.fp16_partitioned_groups_flat_numel]


def check_staging_fits(opt, schedule: ScheduleConfig, capacity_bytes: Optional[int] = None) -> None:
    """Refuse a schedule whose step-time GPU staging cannot fit on the device at all (checked before anything is
    allocated, so a bad config fails in seconds, not with an out-of-memory mid-step)."""
    if capacity_bytes is None:
        if not torch.cuda.is_available():
            return
        capacity_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
            - torch.cuda.memory_allocated()
    sizes = _sizes(opt)
    need = gpu_step_bytes(sizes, make_plan(len(sizes), schedule), schedule)
    if need > capacity_bytes:
        raise ConfigError(
            f"the dostune schedule stages {need / 2**30:.1f} GiB on the GPU during the step, but only "
            f"{capacity_bytes / 2**30:.1f} GiB are left on the device after the model",
            hint="lower staging_buffers or gpu_fraction, set grads_on_gpu false, or use a smaller sub_group_size "
                 "(dostune tune picks these under a memory budget)")


def available_host_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_shadows_fit(opt, schedule: ScheduleConfig, available: Optional[int] = None) -> None:
    """overlap_backward keeps a second copy of every CPU-lane subgroup's fp32 params and Adam states in host
    memory; refuse at start-up, with the numbers, rather than swap or die of the OOM killer mid-run."""
    if not schedule.overlap_backward:
        return
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    sizes = _sizes(opt)
    need = backward_lane_host_bytes(sizes, make_plan(len(sizes), schedule), schedule)
    if need > 0.9 * available:
        raise ConfigError(
            f"overlap_backward needs {need / 2**30:.1f} GiB more host memory for shadow optimizer states, but only "
            f"{available / 2**30:.1f} GiB are available",
            hint="set overlap_backward false, or lower adaptive_swing, or raise gpu_fraction so fewer subgroups are "
                 "updated on the CPU")
