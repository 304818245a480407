"""What a schedule holds in memory, as functions of its Plan: the GPU memory of the step (staging slots, upload
buffer, kept gradients, resident states) and the host memory (DeepSpeed's states and gradients, the CPU lane's
half-precision buffers, the shadow states of the CPU lane during backward), and for comparison the host memory of
DeepSpeed's own ZeRO-Offload. The optimizer's start-up checks, the performance model, the tuner and the bench all
read them here, so they cannot disagree.

Host memory is what a large model runs out of first: a 7B model's offloaded state is ~18 bytes per parameter
(fp32 params, gradients, exp_avg, exp_avg_sq and DeepSpeed's half-precision gradient buffer), ~113 GiB of a 125 GiB
host. Measured on the H100 host with llama-7b (6.74B parameters, RSS at the first step): ZeRO-Offload with
pin_memory false 115.0 GiB, dostune 114.7 GiB; ZeRO-Offload with pin_memory true was killed by the OOM killer,
because DeepSpeed pins its gradient buffers by copying them into pinned allocations that torch's host allocator
rounds up to a power of two (83 GiB before the Adam states existed). dostune page-locks everything in place
instead (pinned.py), so its configs leave DeepSpeed's pin_memory off."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError
from .schedule import Plan, ScheduleConfig, make_plan, updates_in_backward

STATE_BYTES = 12  # fp32 params, exp_avg, exp_avg_sq per element
GRAD_BYTES = 4  # an fp32 gradient per element
HALF_BYTES = 2  # a bf16/fp16 param per element
# The process itself before any engine: CUDA context, torch, DeepSpeed and their libraries (RSS ~1.0 GiB on the H100
# host after building llama-7b's partitioned model), with room for the allocator's own overhead.
HOST_BASE_BYTES = 2 * 2**30
# The share of the host memory available at start-up that the optimizer may take (check_host_fits), and the tuner's
# "auto" host budget with it: the rest stays for the page cache and what else the host runs.
HOST_USABLE_SHARE = 0.95
# The CPU lane during backward uploads its half-precision results from a ring of pinned buffers. The uploads of the
# subgroups left to the step queue behind the GPU lane's copies in: with only two buffers the worker waited for them
# (CPU Adam idle 38 ms of a gpt2-1.3b step on the H100), so the ring has as many as fit in this.
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


def grad_buffer_bytes(precision: str) -> int:
    """Bytes per element of DeepSpeed's gradient-partition buffer: its gradient-accumulation dtype, the training
    precision's (bf16/fp16: 2, fp32: 4)."""
    return GRAD_BYTES if precision == "fp32" else HALF_BYTES


def lane_buffer_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig) -> int:
    """Host memory the lanes add to DeepSpeed's: the half-precision buffers of the CPU lane at the step
    (cpu_convert: two of the widest subgroup it may update) and what the CPU lane during backward adds."""
    extra = 0
    reach = cpu_lane_reach(plan)
    if sched.upload == "cpu_convert" and reach and not updates_in_backward(plan, sched):
        extra += 2 * max(sizes[i] for i in reach) * HALF_BYTES
    return extra + backward_lane_host_bytes(sizes, plan, sched)


def pinned_host_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig, grad_buffer: int = HALF_BYTES) -> int:
    """Host memory of dostune's optimizer on one rank, all of it page-locked in place (nothing rounded): DeepSpeed's
    fp32 params and gradients, the Adam states, DeepSpeed's gradient-partition buffer (``grad_buffer`` bytes per
    element, see grad_buffer_bytes) and the lanes' own buffers. Add HOST_BASE_BYTES for the process."""
    return (STATE_BYTES + GRAD_BYTES + grad_buffer) * sum(sizes) + lane_buffer_bytes(sizes, plan, sched)


def _pinned_rounded(nbytes: int) -> int:
    # torch's pinned-memory allocator (behind DeepSpeed's pin_memory()) rounds each allocation up to a power of two
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def deepspeed_gpu_subgroups(num_subgroups: int, ratio: float) -> int:
    """How many subgroups DeepSpeed's Twin-Flow (offload_optimizer.ratio) keeps on the GPU: the first
    int((1 - ratio) * n), as stage3.py assigns them."""
    return int((1 - ratio) * num_subgroups)


def deepspeed_gpu_state_bytes(sizes: Sequence[int], ratio: float) -> int:
    """GPU memory the subgroups that Twin-Flow keeps on the GPU hold for the whole run: their fp32 params, fp32
    gradients and Adam states (0 for ZeRO-Offload, ratio 1.0)."""
    return (STATE_BYTES + GRAD_BYTES) * sum(sizes[:deepspeed_gpu_subgroups(len(sizes), ratio)])


def deepspeed_offload_pinned_bytes(sizes: Sequence[int], grad_buffer: int = HALF_BYTES, ratio: float = 1.0) -> int:
    """The page-locked part of deepspeed_offload_host_bytes with pin_memory: the fp32 gradients of each offloaded
    subgroup and the gradient-partition buffer, each a pinned copy rounded up to a power of two."""
    offloaded = sizes[deepspeed_gpu_subgroups(len(sizes), ratio):]
    return sum(_pinned_rounded(GRAD_BYTES * n) for n in offloaded) + _pinned_rounded(grad_buffer * sum(sizes))


def deepspeed_offload_host_bytes(sizes: Sequence[int], pin_memory: bool, grad_buffer: int = HALF_BYTES,
                                 ratio: float = 1.0) -> int:
    """Host memory of DeepSpeed 0.19.8's own ZeRO-Offload on one rank once its first step has created the Adam
    states: fp32 params (pageable), fp32 gradients per subgroup and the gradient-partition buffer (with pin_memory,
    each copied into a pinned allocation rounded up to a power of two), exp_avg and exp_avg_sq (pageable). Add
    HOST_BASE_BYTES for the process. Measured on the H100 host with llama-7b at 1e8-element subgroups: 83.3 GiB
    RSS with pin_memory after the engine was built (this gives 82 GiB before the states, 132 with them: it was
    killed at the first step), 115.0 GiB without (this: 113 + 2). ``ratio`` < 1 is Twin-Flow: DeepSpeed keeps the
    first int((1 - ratio) * n) subgroups on the GPU and offloads the rest; the gradient-partition buffer still spans
    every parameter."""
    off = sum(sizes[deepspeed_gpu_subgroups(len(sizes), ratio):])
    if not pin_memory:
        return (STATE_BYTES + GRAD_BYTES) * off + grad_buffer * sum(sizes)
    return STATE_BYTES * off + deepspeed_offload_pinned_bytes(sizes, grad_buffer, ratio)


# ---------------------------------------------------------------- start-up checks
def _sizes(opt) -> list[int]:
    return [int(n) for n in opt.fp16_partitioned_groups_flat_numel]


def check_staging_fits(opt, schedule: ScheduleConfig, capacity_bytes: Optional[int]) -> None:
    """Refuse a schedule whose step-time GPU staging cannot fit in the ``capacity_bytes`` the device has left at all
    (checked before anything is allocated, so a bad config fails in seconds, not with an out-of-memory mid-step).
    None: a device without memory of its own (nothing to check)."""
    if capacity_bytes is None:
        return
    sizes = _sizes(opt)
    need = gpu_step_bytes(sizes, make_plan(len(sizes), schedule), schedule)
    if need > capacity_bytes:
        raise ConfigError(
            f"the dostune schedule stages {need / 2**30:.1f} GiB on the GPU during the step, but only "
            f"{capacity_bytes / 2**30:.1f} GiB are left on the device after the model",
            hint="lower staging_buffers or gpu_fraction, set grads_on_gpu false, or use a smaller sub_group_size "
                 "(dostune tune picks these under a memory budget)")


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def available_host_bytes() -> Optional[int]:
    """Host memory this process can still take: MemAvailable from /proc/meminfo, or less where the process's
    cgroup (a container, a SLURM or Kubernetes job) is limited below it (None where neither is readable)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = limit - used if avail is None else min(avail, limit - used)
    return avail


def check_host_fits(opt, schedule: ScheduleConfig, available: Optional[int] = None) -> None:
    """Refuse at start-up, with the numbers, what the optimizer would still allocate in host memory beyond what is
    available (the Adam states DeepSpeed has not created yet, which the optimizer creates up front, and the lanes'
    buffers: the shadow states of the CPU lane during backward above all), rather than swap or be killed by the
    OOM killer mid-run."""
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    sizes = _sizes(opt)
    plan = make_plan(len(sizes), schedule)
    missing = [n for i, n in enumerate(sizes) if not opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[i])]
    states = 8 * sum(missing)
    lanes = lane_buffer_bytes(sizes, plan, schedule)
    need = states + lanes
    if need > HOST_USABLE_SHARE * available:
        parts = [f"Adam states {states / 2**30:.1f}"] if states else []
        if lanes:
            parts.append(f"the lanes' buffers {lanes / 2**30:.1f}" + (
                " (shadow states of the CPU lane during backward)" if updates_in_backward(plan, schedule) else ""))
        raise ConfigError(
            f"dostune needs {need / 2**30:.1f} GiB more host memory on this rank ({', '.join(parts)} GiB), but only "
            f"{available / 2**30:.1f} GiB are available",
            hint="set overlap_backward false (its shadow states cost 12 bytes per CPU-lane parameter), lower "
                 "adaptive_swing, or raise gpu_fraction; set offload_optimizer.pin_memory false (dostune pins in "
                 "place, DeepSpeed's pinned copies are rounded up to powers of two); fewer ranks per node")
