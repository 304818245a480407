"""What a schedule holds in memory, as functions of its Plan: the GPU memory of the step (staging slots, upload
buffer, kept gradients, resident states) and the host memory (DeepSpeed's states and gradients of the subgroups it
offloads, its gradient-partition buffer, the CPU lane's half-precision buffers, the shadow states of the subgroups the
CPU lane updates speculatively during backward), and for comparison the host memory of DeepSpeed's own ZeRO-Offload
and Twin-Flow. The optimizer's start-up checks, the performance model, the tuner and the bench all
read them here, so they cannot disagree.

Host memory is what a large model runs out of first: a 7B model's offloaded state is ~18 bytes per parameter
(fp32 params, gradients, exp_avg, exp_avg_sq and DeepSpeed's half-precision gradient buffer), ~113 GiB of a 125 GiB
host. dostune's CPU lane during backward reads the half-precision gradients, so its subgroups hold no fp32 gradient
buffer (14 bytes per parameter), and resident subgroups hold nothing on the host but that half-precision buffer.
Measured on the H100 host with llama-7b (6.74B parameters, RSS at the first step, before dostune freed those
buffers): ZeRO-Offload with pin_memory false 115.0 GiB, dostune 114.7 GiB; ZeRO-Offload with pin_memory true was
killed by the OOM killer, because DeepSpeed pins its gradient buffers by copying them into pinned allocations that torch's host allocator
rounds up to a power of two (83 GiB before the Adam states existed). dostune page-locks everything in place
instead (pinned.py), so its configs leave DeepSpeed's pin_memory off."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import ConfigError
from .schedule import (Plan, ScheduleConfig, host_half_gradients, kept_gradients, make_plan, streamed_gradients,
                       twin_flow_gpu_subgroups, updates_in_backward)

STATE_BYTES = 12  # fp32 params, exp_avg, exp_avg_sq per element
GRAD_BYTES = 4  # an fp32 gradient per element
HALF_BYTES = 2  # a bf16/fp16 param per element
# A resident subgroup's fp32 params, Adam states and fp32 gradients: DeepSpeed's Twin-Flow placement builds its
# gradient buffer on the GPU beside the params, for the whole run.
RESIDENT_BYTES = STATE_BYTES + GRAD_BYTES
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


def speculative_set(plan: Plan, sched: ScheduleConfig) -> frozenset[int]:
    """The subgroups the CPU lane during backward may update speculatively, into shadow buffers: with
    ``speculative_subgroups`` k, the k highest-index subgroups it may get (those whose gradients are final first; a
    GPU-lane subgroup adaptive_swing may move to it counts only if it is among them, which with gpu_placement
    "first" means k above the CPU lane's own count); all of them without. The others are updated at the step, in
    place. The same for every swing of one schedule: ``plan`` is any of them."""
    if not updates_in_backward(plan, sched):
        return frozenset()
    reach = sorted(set(cpu_lane_reach(plan)), reverse=True)
    k = sched.speculative_subgroups
    return frozenset(reach if k is None else reach[:k])


def resident_bytes(sizes: Sequence[int], plan: Plan) -> int:
    """GPU memory the resident subgroups' fp32 params, Adam states and gradients hold for the whole run."""
    return RESIDENT_BYTES * sum(sizes[i] for i in plan.resident)


def staging_slots(sizes: Sequence[int], plan: Plan, staging_buffers: int, grads_on_gpu: bool) -> tuple[int, int, bool]:
    """The streamed GPU lane's staging slots for ``plan``: (how many, elements each, whether each has room for
    gradients). As many as staging_buffers allows, each as wide as the widest streamed subgroup, with room for
    gradients when any of them streams its gradients in (streamed_gradients)."""
    streamed = [sizes[s.subgroup] for s in plan.gpu_slots]
    return (min(staging_buffers, len(streamed)), max(streamed, default=0),
            bool(streamed_gradients(plan, grads_on_gpu)))


def plan_step_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig, cpu_in_backward: bool) -> int:
    """GPU memory the interleaved update holds during a step that runs ``plan``: the staging slots (staging_slots),
    the CPU lane's fp32 upload buffer (gpu_convert, at the step: ``cpu_in_backward`` False), the gradients kept on
    the GPU (kept_gradients), and the resident states."""
    count, width, with_grads = staging_slots(sizes, plan, sched.staging_buffers, sched.grads_on_gpu)
    slots = count * width * (STATE_BYTES + (GRAD_BYTES if with_grads else 0))
    up = max((sizes[i] for i in plan.cpu_order), default=0) * 4 \
        if sched.upload == "gpu_convert" and not cpu_in_backward else 0
    kept = sum(sizes[i] for i in kept_gradients(plan, sched.grads_on_gpu)) * GRAD_BYTES
    return slots + up + kept + resident_bytes(sizes, plan)


def gpu_step_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig) -> int:
    """GPU memory the interleaved update may hold during the step of the schedule whose plan is ``plan``: the most
    over every split adaptive_swing may run (``plan.swing_range``), so that no move allocates more than this."""
    backward = updates_in_backward(plan, sched)  # the CPU lane's form, chosen once for the run
    return max(plan_step_bytes(sizes, make_plan(len(sizes), sched, swing=k), sched, backward)
               for k in plan.swing_range)


def backward_lane_host_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig) -> int:
    """Pinned host memory the CPU lane during backward adds: a shadow copy of the fp32 params and Adam states of
    every subgroup it may update speculatively (speculative_set, allocated at start-up), and its ring of
    half-precision buffers (every update it runs, speculative or in place, rounds into one)."""
    if not updates_in_backward(plan, sched):
        return 0
    reach = cpu_lane_reach(plan)
    widest = max(sizes[i] for i in reach)
    shadows = STATE_BYTES * sum(sizes[i] for i in speculative_set(plan, sched))
    return shadows + half_ring_count(len(reach), widest) * widest * HALF_BYTES


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


def offloaded_host_bytes(sizes: Sequence[int], on_gpu: int, grad_buffer: int = HALF_BYTES) -> int:
    """Host memory of DeepSpeed 0.19.8's offloaded optimizer on one rank, every buffer allocated once (pageable, or
    page-locked in place): the fp32 params, fp32 gradients and Adam states of the subgroups it offloads (all but the
    first ``on_gpu``, which its Twin-Flow placement builds on the GPU), and its gradient-partition buffer, which
    spans every parameter (``grad_buffer`` bytes per element, see grad_buffer_bytes)."""
    return (STATE_BYTES + GRAD_BYTES) * sum(sizes[on_gpu:]) + grad_buffer * sum(sizes)


def pinned_host_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig, grad_buffer: int = HALF_BYTES) -> int:
    """Host memory of dostune's optimizer on one rank, all of it page-locked in place (nothing rounded): DeepSpeed's
    offloaded state (offloaded_host_bytes: none of the resident subgroups', which live on the GPU only; no fp32
    gradient buffer for the subgroups whose gradients stay in half precision, schedule.host_half_gradients) and the
    lanes' own buffers. Add HOST_BASE_BYTES for the process."""
    half_only = sum(sizes[i] for i in host_half_gradients(len(sizes), sched))
    return (offloaded_host_bytes(sizes, len(plan.resident), grad_buffer) - GRAD_BYTES * half_only
            + lane_buffer_bytes(sizes, plan, sched))


def _pinned_rounded(nbytes: int) -> int:
    # torch's pinned-memory allocator (behind DeepSpeed's pin_memory()) rounds each allocation up to a power of two
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def deepspeed_gpu_state_bytes(sizes: Sequence[int], ratio: float) -> int:
    """GPU memory the subgroups that Twin-Flow keeps on the GPU hold for the whole run: their fp32 params, fp32
    gradients and Adam states (0 for ZeRO-Offload, ratio 1.0)."""
    return (STATE_BYTES + GRAD_BYTES) * sum(sizes[:twin_flow_gpu_subgroups(ratio, len(sizes))])


def deepspeed_offload_pinned_bytes(sizes: Sequence[int], grad_buffer: int = HALF_BYTES, ratio: float = 1.0) -> int:
    """The page-locked part of deepspeed_offload_host_bytes with pin_memory: the fp32 gradients of each offloaded
    subgroup and the gradient-partition buffer, each a pinned copy rounded up to a power of two."""
    offloaded = sizes[twin_flow_gpu_subgroups(ratio, len(sizes)):]
    return sum(_pinned_rounded(GRAD_BYTES * n) for n in offloaded) + _pinned_rounded(grad_buffer * sum(sizes))


def deepspeed_offload_host_bytes(sizes: Sequence[int], pin_memory: bool, grad_buffer: int = HALF_BYTES,
                                 ratio: float = 1.0) -> int:
    """Host memory of DeepSpeed 0.19.8's own ZeRO-Offload on one rank once its first step has created the Adam
    states: fp32 params (pageable), fp32 gradients per subgroup and the gradient-partition buffer (with pin_memory,
    each copied into a pinned allocation rounded up to a power of two), exp_avg and exp_avg_sq (pageable). Add
    HOST_BASE_BYTES for the process. Measured on the H100 host with llama-7b at 1e8-element subgroups: 83.3 GiB
    RSS with pin_memory after the engine was built (this gives 82 GiB before the states, 132 with them: it was
    killed at the first step), 115.0 GiB without (this: 113 + 2). ``ratio`` < 1 is Twin-Flow: DeepSpeed keeps the
    first subgroups on the GPU (schedule.twin_flow_gpu_subgroups) and offloads the rest; the gradient-partition
    buffer still spans every parameter."""
    on_gpu = twin_flow_gpu_subgroups(ratio, len(sizes))
    if not pin_memory:
        return offloaded_host_bytes(sizes, on_gpu, grad_buffer)
    return STATE_BYTES * sum(sizes[on_gpu:]) + deepspeed_offload_pinned_bytes(sizes, grad_buffer, ratio)


# ---------------------------------------------------------------- start-up checks
def _sizes(opt) -> list[int]:
    return [int(n) for n in opt.fp16_partitioned_groups_flat_numel]


def check_staging_fits(opt, schedule: ScheduleConfig, capacity_bytes: Optional[int]) -> None:
    """Refuse a schedule whose step-time GPU staging (gpu_step_bytes: at the swing that needs the most) cannot fit
    in the ``capacity_bytes`` the device has left at all (checked before anything is allocated, so a bad config
    fails in seconds, not with an out-of-memory mid-step). None: a device without memory of its own (nothing to
    check)."""
    if capacity_bytes is None:
        return
    sizes = _sizes(opt)
    plan = make_plan(len(sizes), schedule)
    # DeepSpeed built the resident subgroups' fp32 params and gradients on the device already (their Adam states
    # are still to come): the capacity left is net of them
    need = gpu_step_bytes(sizes, plan, schedule) - (4 + GRAD_BYTES) * sum(sizes[i] for i in plan.resident)
    if need > capacity_bytes:
        raise ConfigError(
            f"the dostune schedule stages {need / 2**30:.1f} GiB on the GPU during the step, but only "
            f"{capacity_bytes / 2**30:.1f} GiB are left on the device after the model",
            hint="lower staging_buffers, gpu_fraction or adaptive_swing, set grads_on_gpu false, or use a smaller "
                 "sub_group_size (dostune tune picks these under a memory budget)")


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
    available (the Adam states DeepSpeed has not created yet for the subgroups it offloads, which the optimizer
    creates up front, and the lanes' buffers: the shadow states of the speculative CPU lane above all), rather than
    swap or be killed by the OOM killer mid-run. The resident subgroups' Adam states are created on the GPU."""
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    sizes = _sizes(opt)
    plan = make_plan(len(sizes), schedule)
    resident = frozenset(plan.resident)
    missing = [n for i, n in enumerate(sizes)
               if i not in resident and not opt.optimizer.state.get(opt.fp32_partitioned_groups_flat[i])]
    states = 8 * sum(missing)  # exp_avg and exp_avg_sq
    lanes = lane_buffer_bytes(sizes, plan, schedule)
    need = states + lanes
    if need > HOST_USABLE_SHARE * available:
        parts = [f"Adam states {states / 2**30:.1f}"] if states else []
        if lanes:
            parts.append(f"the lanes' buffers {lanes / 2**30:.1f}" + (
                " (shadow states of the CPU lane during backward)" if speculative_set(plan, schedule) else ""))
        raise ConfigError(
            f"dostune needs {need / 2**30:.1f} GiB more host memory on this rank ({', '.join(parts)} GiB), but only "
            f"{available / 2**30:.1f} GiB are available",
            hint="lower speculative_subgroups or set overlap_backward false (each subgroup updated speculatively "
                 "during backward holds 12 bytes of shadow states per parameter), or raise resident_subgroups (their "
                 "state lives on the GPU only); set offload_optimizer.pin_memory false (dostune pins in place, "
                 "DeepSpeed's pinned copies are rounded up to powers of two); fewer ranks per node")
