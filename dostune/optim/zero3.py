"""The interleaved optimizer: DeepSpeed 0.19.8's ZeRO-3 optimizer with CPU offload, whose per-subgroup
update loop is replaced by two lanes that run at the same time.

DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3.step()`` updates subgroups one after another: unscale/clip
the subgroup's fp32 gradient, DeepSpeedCPUAdam, then a blocking pageable fp32->half copy into the GPU
partition. Here, subgroups are split by the schedule (``dostune`` config section) into

* the CPU lane: the same unscale and the same DeepSpeedCPUAdam call (``_optimizer_step``), in place in
  host memory, followed by an asynchronous upload of the result to the GPU partition; and
* the GPU lane: fp32 params, exp_avg, exp_avg_sq (and gradients, unless they stayed on the GPU) stream
  into staging slots on the GPU, a fused Adam updates them, the half-precision partition is written
  from the updated fp32 params on the GPU, and the fp32 state streams back to host memory.

The GPU lane is queued up front on its own streams (CUDA events order slot reuse), then the host runs
the CPU lane, so CPU Adam, GPU Adam and both PCIe directions overlap. The math is DeepSpeed's: the
same global-norm clipping and loss-scale/overflow handling (reused from the parent class), the same
Adam/AdamW update from the same state, with only the kernel differing on the GPU lane.

Methods replaced (everything else is DeepSpeed's):

* ``step`` - the subgroup loop above. The prologue (overflow check, global norm, loss-scale update)
  and epilogue (``_post_step``) are the parent's own helpers called in the parent's order.
* ``_offload_grad_partition_at_boundary`` - for GPU-lane subgroups with ``grads_on_gpu``, the
  gradient partition is copied into a GPU buffer instead of host memory; the gradient norm is
  recorded exactly as the parent does. All other subgroups go through the parent.

With ``overlap_backward`` the CPU lane runs during backward instead (see ``overlap.py``): the same
``_offload_grad_partition_at_boundary`` override counts each CPU-lane subgroup's finalised parameters and
hands the subgroup to a worker thread once all are in; ``step`` then commits or recomputes its results.

The object is created by DeepSpeed as a ``DeepSpeedZeroOptimizer_Stage3`` and re-classed by
:meth:`InterleavedZeroOptimizer.adopt`, so DeepSpeed's engine, checkpointing and config parsing stay
untouched.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed import comm as dist
from deepspeed.comm import pg_utils
from deepspeed.runtime.utils import (combine_grad_norm_groups, is_invalid_grad_norm, is_model_parallel_parameter,
                                     mask_nan_or_inf_with_val_inplace)
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.runtime.zero.stage3 import OPTIMIZER_STEP_TIMER, DeepSpeedZeroOptimizer_Stage3

from ..errors import ConfigError
from .kernels import AdamScalars, LaneAdam
from .balance import LaneBalance, LaneTimes, lane_times
from .overlap import BackwardOverlap, StepOutcome, SubgroupIO, Buffers
from .pinned import PinRegistry
from .queues import Queues
from .schedule import Plan, ScheduleConfig, make_plan, swing_candidates

PHASE_WINDOW = 64  # steps whose host-time phases dostune_step_phases reports

log = logging.getLogger(__name__)


@dataclass
class Span:
    """One piece of lane work in a traced step, in seconds from the step's start."""

    lane: str  # cpu, h2d, gpu, d2h, up
    subgroup: int
    start: float
    end: float


@dataclass
class _State:
    schedule: ScheduleConfig
    plan: Plan
    queues: Queues
    lane_device: torch.device
    pins: PinRegistry
    lane_adam: LaneAdam
    device_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    # Subgroups whose gradients this backward did not write to DeepSpeed's fp32 gradient buffer, and where they are
    # instead: "device" (device_grads, the GPU lane's) or "half" (DeepSpeed's pinned half-precision copy, the CPU
    # lane's during backward). DeepSpeed's gradient accessors read them there until the step.
    grad_home: dict[int, str] = field(default_factory=dict)
    gpu_set: frozenset = frozenset()
    resident_set: frozenset = frozenset()
    last_trace: list[Span] = field(default_factory=list)
    last_step_s: float = 0.0
    steps: int = 0
    # Optimizer step number the C++ Adam beta powers were last advanced to by this process (None: never).
    beta_step: Optional[int] = None
    # This iteration's GPU-lane staging slots (slot index -> tensors, and "ready": the event after which the slot
    # may be refilled), used round robin; slot_uses counts the fills so far. prefetched: subgroup -> (start, done)
    # of the states streamed in early, at the step's start.
    slots: dict[int, dict] = field(default_factory=dict)
    slot_uses: int = 0
    prefetched: dict[int, tuple] = field(default_factory=dict)
    step_t0: Optional[tuple] = None  # (event on the compute lane, host time) at the step's start, for the trace
    # Host time of each step's parts (see dostune_step_phases): the marks of the step in progress, then a window of
    # finished steps. Why: on a slow H100 host the step took 170 ms while its lanes ended ~107 ms after they started.
    step_marks: dict = field(default_factory=dict)
    step_phases: list = field(default_factory=list)
    # resident_subgroups: their fp32 params and Adam states on the GPU (kept for the run); which of them match the
    # host copies DeepSpeed holds (else uploaded before the next update), and which host copies are behind.
    resident: dict[int, Buffers] = field(default_factory=dict)
    resident_fresh: set = field(default_factory=set)
    host_stale: set = field(default_factory=set)
    # Parameter id -> the 2-norm of its gradient partition in DeepSpeed's norm dtype, as the norm kernel returns it;
    # what DeepSpeed would record in norm_for_param_grads follows from it exactly (see _dostune_record_norm).
    raw_norms: dict = field(default_factory=dict)
    # overlap_backward: the CPU-lane worker, each CPU-lane subgroup's parameter ids (those holding data on this
    # rank), the ids finalised so far this backward, and the running squared gradient norm.
    overlap: Optional[BackwardOverlap] = None
    overlap_pids: dict[int, frozenset] = field(default_factory=dict)
    overlap_seen: dict[int, set] = field(default_factory=dict)
    overlap_partial: object = None
    overlap_last: Optional[tuple] = None  # (host copy of overlap_partial, event after which it is filled)
    # Where each subgroup's gradients lie in DeepSpeed's pinned gradient-partition buffer (start, length), when the
    # layout there is the subgroup's own (checked at start-up): the CPU lane during backward reads them from there.
    grad_slices: dict[int, tuple[int, int]] = field(default_factory=dict)
    overlap_stats: dict = field(default_factory=lambda: {"steps": 0, "speculative": 0, "redone": 0, "committed": 0})
    # adaptive_swing: the decision between steps, how many streamed GPU-lane subgroups the CPU lane has now, and
    # the last cost of one subgroup seen in each lane's step (what one more costs a lane that ran none this step).
    balance: Optional[LaneBalance] = None
    swing: int = 0
    sub_cost_s: dict = field(default_factory=dict)
    swing_steps: dict = field(default_factory=dict)  # swing -> steps run with it

    def reset_slots(self) -> None:
        self.slots.clear()
        self.slot_uses = 0
        self.prefetched.clear()


def unsupported_reason(opt: DeepSpeedZeroOptimizer_Stage3) -> Optional[str]:
    """Why this DeepSpeed optimizer cannot run the interleaved update, or None if it can."""
    if not opt.offload_optimizer:
        return "zero_optimization.offload_optimizer.device must be 'cpu' (the optimizer state is not offloaded)"
    if opt.swap_optimizer:
        return "offload_optimizer.device 'nvme' is not supported, use 'cpu'"
    if opt.partial_offload != 1.0:
        return f"offload_optimizer.ratio must be 1.0 (Twin-Flow), got {opt.partial_offload}"
    if type(opt.optimizer) is not DeepSpeedCPUAdam:
        return f"the base optimizer must be DeepSpeedCPUAdam (Adam/AdamW), got {type(opt.optimizer).__name__}"
    if getattr(opt, "use_muon", False):
        return "Muon is not supported"
    if getattr(opt, "zenflow", False):
        return "ZenFlow is not supported"
    if getattr(opt, "torch_autocast_gradscaler", None) is not None:
        return "torch autocast with fp16 GradScaler is not supported"
    if any(t is None for t in opt.fp16_partitioned_groups_flat):
        return "parameter offload to NVMe is not supported"
    if opt.master_weights_and_grads_dtype != torch.float32:
        return "master weights and gradients must be fp32"
    if not opt.optimizer.fp32_optimizer_states:
        return "optimizer states must be fp32"
    if any(g.get("amsgrad", False) for g in opt.optimizer.param_groups):
        return "AMSGrad is not supported"
    return None


def check_staging_fits(opt: DeepSpeedZeroOptimizer_Stage3, schedule: ScheduleConfig,
                       capacity_bytes: Optional[int] = None) -> None:
    """Refuse a schedule whose step-time GPU staging cannot fit on the device at all (checked before
    anything is allocated, so a bad config fails in seconds, not with an out-of-memory mid-step)."""
    from ..perfmodel.model import staging_bytes

    if capacity_bytes is None:
        if not torch.cuda.is_available():
            return
        capacity_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
            - torch.cuda.memory_allocated()
    need = staging_bytes([int(n) for n in opt.fp16_partitioned_groups_flat_numel], schedule)
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


def check_shadows_fit(opt: DeepSpeedZeroOptimizer_Stage3, schedule: ScheduleConfig,
                      available: Optional[int] = None) -> None:
    """overlap_backward keeps a second copy of every CPU-lane subgroup's fp32 params and Adam states in host
    memory; refuse at start-up, with the numbers, rather than swap or die of the OOM killer mid-run."""
    if not schedule.overlap_backward:
        return
    available = available_host_bytes() if available is None else available
    if available is None:
        return
    numel = [int(n) for n in opt.fp16_partitioned_groups_flat_numel]
    plan = make_plan(len(numel), schedule)
    cpu = plan.cpu_order + swing_candidates(len(numel), schedule)
    need = 12 * sum(numel[i] for i in cpu) + 4 * max((numel[i] for i in cpu), default=0)
    if need > 0.9 * available:
        raise ConfigError(
            f"overlap_backward needs {need / 2**30:.1f} GiB more host memory for shadow optimizer states, but only "
            f"{available / 2**30:.1f} GiB are available",
            hint="set overlap_backward false, or lower adaptive_swing, or raise gpu_fraction so fewer subgroups are "
                 "updated on the CPU")


class InterleavedZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    _dos: _State

    # ---------------------------------------------------------------- set-up
    @classmethod
    def adopt(cls, opt: DeepSpeedZeroOptimizer_Stage3, schedule: ScheduleConfig) -> "InterleavedZeroOptimizer":
        """Turn a constructed DeepSpeed ZeRO-3 optimizer into an interleaved one, in place."""
        if isinstance(opt, cls):
            return opt
        if type(opt) is not DeepSpeedZeroOptimizer_Stage3:
            raise ConfigError(f"dostune needs DeepSpeed's ZeRO-3 optimizer, got {type(opt).__name__} "
                              "(is super_offload or another ZeRO-3 variant enabled?)")
        reason = unsupported_reason(opt)
        if reason is not None:
            raise ConfigError(f"the dostune schedule cannot run with this DeepSpeed config: {reason}")
        n = len(opt.fp16_groups)
        if schedule.expected_subgroups is not None and schedule.expected_subgroups != n:
            raise ConfigError(
                f"the dostune section was tuned for {schedule.expected_subgroups} subgroups but this model has {n} "
                f"at sub_group_size {opt.sub_group_size:g}",
                hint="re-run `dostune tune` for this model, or remove 'expected_subgroups' from the dostune section")
        check_staging_fits(opt, schedule)
        check_shadows_fit(opt, schedule)
        opt.__class__ = cls
        opt._dostune_init(schedule)
        return opt

    def _dostune_init(self, schedule: ScheduleConfig) -> None:
        lane_device = torch.device(get_accelerator().current_device_name())
        plan = make_plan(len(self.fp16_groups), schedule)
        d = self.optimizer.defaults
        lane_adam = LaneAdam(lane_device, d["betas"][0], d["betas"][1], d["lr"], d["eps"], d["weight_decay"],
                             self.optimizer.adam_w_mode)
        self._dos = _State(schedule=schedule, plan=plan, queues=Queues(lane_device, timing=schedule.trace),
                           lane_device=lane_device, pins=PinRegistry(), lane_adam=lane_adam,
                           gpu_set=frozenset(plan.gpu_subgroups), resident_set=frozenset(plan.resident))
        for i in range(len(self.fp16_groups)):
            self._dostune_adopt_subgroup_state(i)
        self._dos.grad_slices = self._dostune_grad_slices()
        swing = swing_candidates(len(self.fp16_groups), schedule)
        if swing:
            self._dos.balance = LaneBalance(len(swing))
        if schedule.overlap_backward and (plan.cpu_order or swing):
            self._dostune_init_overlap(lane_device)

    def _dostune_param_ids(self, i: int) -> frozenset:
        # The same test DeepSpeed's partition_grads applies: a parameter whose partition on this rank is empty
        # never reaches the boundary hook.
        return frozenset(self.get_param_id(p) for p in self.fp16_groups[i]
                         if p.partition_numel() * self._get_param_partition_rank(p) < p.ds_numel)

    def _dostune_grad_slices(self) -> dict[int, tuple[int, int]]:
        """Subgroup -> (start, length) in ``grad_partitions_flat_buffer``, which DeepSpeed fills with every
        parameter's gradient partition in parameter order; {} unless each subgroup's part of it has exactly the
        layout of its fp32 partition (then the gradients can be read there without an fp32 copy)."""
        buf = getattr(self, "grad_partitions_flat_buffer", None)
        if buf is None or buf.device.type != "cpu":
            return {}
        out, pos = {}, 0
        for i, group in enumerate(self.fp16_groups):
            start = pos
            for p in group:
                n = p.partition_numel()
                pid = self.get_param_id(p)
                if n and pid in self.grad_position and (self.grad_position[pid][0] != i
                                                        or self.grad_position[pid][1] != pos - start):
                    return {}
                pos += n
            if pos - start != int(self.fp16_partitioned_groups_flat_numel[i]):
                return {}
            out[i] = (start, pos - start)
        return out if pos == buf.numel() else {}

    def _dostune_init_overlap(self, lane_device: torch.device) -> None:
        dos = self._dos
        for i in dos.plan.cpu_order + swing_candidates(len(self.fp16_groups), dos.schedule):
            dos.overlap_pids[i] = self._dostune_param_ids(i)
        for i in dos.plan.cpu_order:
            dos.overlap_seen[i] = set()  # its keys: the CPU lane's subgroups this step
        threads = dos.schedule.cpu_threads or torch.get_num_threads()
        bwd_threads = dos.schedule.backward_cpu_threads or max(1, threads - 1)

        def scalars():
            self._dostune_sync_beta_powers()
            return self._dostune_step_scalars(frozenset(dos.plan.cpu_order))

        dos.overlap = BackwardOverlap(dos.plan.cpu_order, self._dostune_subgroup_io, scalars, lane_device,
                                      dos.pins.pin, bwd_threads, threads)
        dos.overlap.reserve(swing_candidates(len(self.fp16_groups), dos.schedule))

    def _dostune_subgroup_io(self, i: int) -> SubgroupIO:
        fp32 = self.fp32_partitioned_groups_flat[i]
        state = self.optimizer.state[fp32]
        sl = self._dos.grad_slices.get(i)
        grad = fp32.grad if sl is None else self.grad_partitions_flat_buffer.narrow(0, *sl)
        return SubgroupIO(fp32.data, grad, state["exp_avg"], state["exp_avg_sq"], self.fp16_partitioned_groups_flat[i])

    def _dostune_adopt_subgroup_state(self, i: int) -> None:
        """Create Adam state up front (DeepSpeedCPUAdam creates it lazily, pageable) and page-lock the
        subgroup's fp32 params, gradients and states so the lanes can copy them asynchronously."""
        fp32 = self.fp32_partitioned_groups_flat[i]
        state = self.optimizer.state[fp32]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(fp32.data)
            state["exp_avg_sq"] = torch.zeros_like(fp32.data)
        self._dostune_host_changed(i)
        pins = self._dos.pins
        for kind, t in (("param", fp32.data), ("grad", fp32.grad), ("exp_avg", state["exp_avg"]),
                        ("exp_avg_sq", state["exp_avg_sq"])):
            if t is not None:
                pins.pin((i, kind), t)

    def destroy(self):
        if hasattr(self, "_dos"):
            if self._dos.overlap is not None:
                self._dos.overlap.close()
            self._dos.pins.close()
            self._dos.lane_adam.close()
            self._dos.resident.clear()
        super().destroy()

    @property
    def dostune_schedule(self) -> ScheduleConfig:
        return self._dos.schedule

    @property
    def dostune_plan(self) -> Plan:
        return self._dos.plan

    @property
    def dostune_last_trace(self) -> list[Span]:
        return list(self._dos.last_trace)

    @property
    def dostune_overlap_stats(self) -> dict:
        """overlap_backward counters since start: steps, CPU-lane subgroups updated speculatively during backward,
        how many of those were recomputed (clipping triggered), and how many CPU-lane updates were committed."""
        return dict(self._dos.overlap_stats)

    @property
    def dostune_step_phases(self) -> dict:
        """Median host milliseconds of the last ``PHASE_WINDOW`` steps' parts (skipped steps not counted):
        ``before_lanes`` (DeepSpeed's prologue, overflow check and global norm), ``queue_and_host_work`` (queueing
        the GPU lane, handing the CPU lane its factor, and the parameter release that runs beside the lanes),
        ``wait_for_lanes`` (until both lanes are done and the partitions unflattened), ``after_lanes`` (the
        swing's decision, DeepSpeed's epilogue); empty before the first step."""
        rows = self._dos.step_phases
        if not rows:
            return {}
        return {k: round(1e3 * statistics.median(r[k] for r in rows), 1) for k in rows[0]}

    @property
    def dostune_swing_stats(self) -> dict:
        """adaptive_swing: how many steps ran with each number of the GPU lane's streamed subgroups moved to the
        CPU lane, and the number the next step uses."""
        return {"steps_by_swing": dict(sorted(self._dos.swing_steps.items())), "swing": self._dos.swing}

    # ------------------------------------------------------ gradient routing
    def _offload_grad_partition_at_boundary(self, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets):
        # Replaces DeepSpeed's method for two kinds of subgroup; the norm bookkeeping is the parent's for all:
        # * GPU-lane subgroups (grads_on_gpu): the gradient stays on the GPU, so the update does not stream it in;
        # * CPU-lane subgroups updated during backward: the CPU lane reads the gradient from DeepSpeed's pinned
        #   gradient-partition buffer, which partition_grads has already filled, so the parent's fp32 conversion
        #   and second copy to host memory (4 bytes per element over PCIe during backward) are skipped.
        # Being called once per parameter as backward finalises gradients, it also hands the CPU-lane worker each
        # subgroup whose gradients are all final.
        dos = getattr(self, "_dos", None)
        if dos is None:
            return super()._offload_grad_partition_at_boundary(param, grad_buffer, offload_fp32_gradients,
                                                               offload_fp32_offsets)
        pid = self.get_param_id(param)
        i, dest_offset, _ = self.grad_position[pid]
        cpu_overlap = dos.overlap is not None and i in dos.overlap_seen
        if cpu_overlap and i in dos.grad_slices:
            self._dostune_record_norm(pid, grad_buffer)
            dos.grad_home[i] = "half"
        elif not dos.schedule.grads_on_gpu or i not in dos.gpu_set:
            super()._offload_grad_partition_at_boundary(param, grad_buffer, offload_fp32_gradients,
                                                        offload_fp32_offsets)
        else:
            self._dostune_record_norm(pid, grad_buffer)
            dos.grad_home[i] = "device"
            buf = dos.device_grads.get(i)
            if buf is None:
                buf = torch.zeros(self.fp16_partitioned_groups_flat_numel[i], dtype=torch.float32,
                                  device=dos.lane_device)
                dos.device_grads[i] = buf
            # One widening kernel straight into the buffer, without .to(fp32)'s temporary; bf16/fp16 -> fp32 is exact.
            buf.narrow(0, dest_offset, grad_buffer.numel()).copy_(grad_buffer, non_blocking=True)
        if cpu_overlap:
            self._dostune_grad_final(i, pid)

    def partition_grads(self, params_to_release, grad_partitions):
        # Replaces DeepSpeed's method in the common case (a boundary micro-step that does not accumulate): DeepSpeed
        # copies each gradient partition into its pinned host buffer, then copies that back to the GPU "to speed up
        # the next operations" and hands the copy to _offload_grad_partition_at_boundary. The copy back is bitwise
        # the partition it came from, so here the partition itself is handed on: 2 bytes per element less over PCIe
        # during backward. The host copy stays (DeepSpeed's overflow check and the CPU lane read it). Everything
        # else (accumulation, NVMe) is the parent's.
        dos = getattr(self, "_dos", None)
        if dos is None or not dos.grad_slices or self.micro_step_id != 0 or \
                not self.is_gradient_accumulation_boundary():
            return super().partition_grads(params_to_release, grad_partitions)
        # Only fp16's overflow check reads the host copy of a GPU-lane subgroup's gradients (the GPU lane keeps its
        # own on the device): otherwise it is not made, which takes those copies (the last of backward, as the
        # GPU lane holds the first layers) off the stream backward's end waits for.
        skip = dos.gpu_set if (dos.schedule.grads_on_gpu and self.dtype != torch.float16) else frozenset()
        buffers = []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            if not param.partition_numel() * self._get_param_partition_rank(param) < param.ds_numel:
                param.grad = None  # this rank's partition is empty
                continue
            self._offload_boundary_param_ids.add(param.ds_id)
            i, dest_offset, _ = self.grad_position[self.get_param_id(param)]
            grad_buffer = self.grad_partitions_flat_buffer.narrow(0, dos.grad_slices[i][0] + dest_offset,
                                                                  grad_partition.numel())
            buffers.append(grad_buffer)
            if i not in skip:
                grad_buffer.copy_(grad_partition, non_blocking=True)
            self._offload_grad_partition_at_boundary(param, grad_partition, {}, {})
            if not get_accelerator().is_synchronized_device() and param.grad is not None:
                param.grad.record_stream(get_accelerator().current_stream())
            param.grad = None
        return buffers

    def _dostune_record_norm(self, pid: int, grad: torch.Tensor) -> None:
        # DeepSpeed records ((g.double().norm(2)) ** 2) ** 0.5 per parameter with _constant_buffered_norm2: seven tensor
        # operations on the host thread that paces backward (the profiled backward is host-bound). Only the norm
        # kernel's result is kept here (two operations); the square and the square root, both exactly rounded
        # double operations, are replayed on the host at the step, so the global norm is bit for bit DeepSpeed's.
        # Python floats replay double operations exactly (MPS-like devices without fp64 keep DeepSpeed's path), and
        # DeepSpeed sums the norms of 250M-element pieces of bigger partitions: both left to its code.
        # Tensor.norm(2) is torch.functional.norm, Python that ends in torch.linalg.vector_norm(x, 2) for a strided
        # tensor: called directly here (the same kernel on the same input), without that Python on backward's path.
        if get_norm_dtype() != torch.float64 or grad.numel() > 250_000_000:
            self.norm_for_param_grads[pid] = self._constant_buffered_norm2(grad)
            return
        flat = grad if grad.dim() == 1 else grad.reshape(-1)
        self._dos.raw_norms[pid] = torch.linalg.vector_norm(flat.to(torch.float64), 2)
        self.norm_for_param_grads.pop(pid, None)

    def _dostune_norm_tensor(self, pid: int):
        """(tensor, raw) for a parameter's recorded gradient norm, or None; a value DeepSpeed's own code recorded
        (e.g. set_local_grad_for_param after backward) takes precedence."""
        t = self.norm_for_param_grads.get(pid)
        if t is not None:
            return t, False
        t = self._dos.raw_norms.get(pid)
        return (t, True) if t is not None else None

    def _dostune_norm_reduction(self, params) -> tuple:
        """How DeepSpeed reduces one subgroup's squared gradient norm across ranks: (partition group, whether every
        rank counts its own partition, the AutoEP expert-parallel group or None)."""
        self._assert_same_partition_group(params)
        process_group = self._get_param_partition_group(params[0])
        return process_group, self._grad_norm_counts_every_rank(params, process_group), \
            self._autoep_expert_parallel_group(params)

    def _dostune_squared_sums(self, groups: list, reductions: list) -> list[float]:
        """Each subgroup's sum of squared per-parameter gradient norms, as DeepSpeed's
        complete_grad_norm_calculation_for_cpu_offload adds them (in doubles, in parameter order), from one copy of all
        the recorded norms to the host."""
        found = []
        for params, (_, counts_every_rank, _) in zip(groups, reductions):
            entries = []
            for p in params:
                if counts_every_rank or is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):
                    entry = self._dostune_norm_tensor(self.get_param_id(p))
                    if entry is not None:
                        entries.append(entry)
            found.append(entries)
        flat = [t for entries in found for t, _ in entries]
        values = iter(torch.stack([t.reshape(()).to(torch.float64) for t in flat]).cpu().tolist() if flat else [])
        sums = []
        for entries in found:
            total = 0.0
            for (_, raw), v in zip(entries, values):
                param_norm = math.sqrt(v * v) if raw else v  # DeepSpeed's (norm ** 2.0) ** 0.5
                total += param_norm * param_norm
            sums.append(total)
        return sums

    def _dostune_finish_norms(self, sums: list[float], reduction: tuple):
        """The rest of DeepSpeed's per-subgroup norm, on a vector of subgroups that share ``reduction``: the same
        all-reduces, square root and nan/inf mask, each elementwise, so each entry is what the scalar code gives."""
        process_group, counts_every_rank, autoep_ep_group = reduction
        total_norm_cuda = get_accelerator().FloatTensor([float(x) for x in sums])
        dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=process_group)
        if not counts_every_rank:
            self._model_parallel_all_reduce(tensor=total_norm_cuda, op=dist.ReduceOp.SUM)
        if pg_utils.is_parallel(autoep_ep_group):
            dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=autoep_ep_group)
        total_norm = total_norm_cuda**(1. / 2.0)
        mask_nan_or_inf_with_val_inplace(total_norm, device=total_norm.device)
        return total_norm.cpu()

    def complete_grad_norm_calculation_for_cpu_offload(self, params):
        # Replaces DeepSpeed's method, which squares and adds the recorded per-parameter norms with two kernel launches
        # per parameter and two host syncs per subgroup: here one copy of all the norms to the host and the same
        # double-precision operations in the same order there (Python floats are IEEE doubles, each operation exactly
        # rounded as on the GPU). The rest (reductions across ranks, the square root, the nan/inf mask) is the
        # parent's code on a one-element vector.
        if getattr(self, "_dos", None) is None:
            return super().complete_grad_norm_calculation_for_cpu_offload(params)
        reduction = self._dostune_norm_reduction(params)
        return self._dostune_finish_norms(self._dostune_squared_sums([params], [reduction]), reduction)[0]

    def _get_norm_groups(self):
        # Replaces DeepSpeed's method for the offloaded optimizer, which completes each subgroup's norm on its own: a
        # host round trip, an all-reduce, a square root and a mask per subgroup (38 for gpt2-1.3b at 25M), all at the
        # head of the step, where the GPU lane waits for the norm. When every subgroup reduces over the same groups
        # (always, short of AutoEP/tensor-parallel mixes), all run at once on a vector: the same values.
        if getattr(self, "_dos", None) is None or not self.offload_optimizer:
            return super()._get_norm_groups()
        reductions = [self._dostune_norm_reduction(g) for g in self.fp16_groups]
        first = reductions[0]
        if any(r[0] is not first[0] or r[1] != first[1] or r[2] is not first[2] for r in reductions):
            return super()._get_norm_groups()
        sums = self._dostune_squared_sums(list(self.fp16_groups), reductions)
        return list(self._dostune_finish_norms(sums, first).unbind())

    def reset_cpu_buffers(self):
        # DeepSpeed's method clears the recorded norms after the step; the raw ones with them.
        super().reset_cpu_buffers()
        if hasattr(self, "_dos"):
            self._dos.raw_norms.clear()

    def _dostune_grad_final(self, i: int, pid: int) -> None:
        """Hand CPU-lane subgroup i to the worker once its last parameter's gradient has been copied out."""
        dos = self._dos
        seen = dos.overlap_seen[i]
        seen.add(pid)
        if len(seen) != len(dos.overlap_pids[i]):
            return
        ov = dos.overlap
        if not ov.active:
            spec = ov.spec_factor(float(self.loss_scale))
            ov.open(spec, float(self.loss_scale), float(self.clip_grad))
        if self._dostune_partial_norm_useful():
            host, event = self._dostune_add_partial_norm(dos.overlap_pids[i])
        else:
            # the event the worker waits on before reading the gradient copies (on a CPU device none is needed)
            host, event = None, (dos.queues.record_current() if dos.queues.cuda else None)
        ov.ready(i, event, host)

    def _dostune_partial_norm_useful(self) -> bool:
        # The running norm only lets the lanes stop speculating early, once it makes clipping certain or is
        # inf/nan (an overflow: the step is skipped). Without clipping, that leaves overflows, which dynamic fp16
        # loss scaling produces on purpose but bf16/fp32 gradients almost never do; there its upkeep (a stack, a
        # reduction, a pinned copy per subgroup: ~0.2 ms each on the host thread that paces backward, measured
        # on the H100) buys nothing, and a rare overflow still skips the step exactly, only after speculating.
        return float(self.clip_grad) > 0 or self.dtype == torch.float16

    def _dostune_add_partial_norm(self, pids: frozenset) -> tuple:
        """Add a finalised subgroup's squared gradient norms (as DeepSpeed records them for its global norm) to
        the running sum, on the stream that made them; returns (host copy, event after which the copy and
        DeepSpeed's non-blocking gradient copies so far are done)."""
        dos = self._dos
        # raw norms squared differ from DeepSpeed's in the last bit at most: a bound for the cutoff, not the factor
        sq = torch.stack([self._dostune_norm_tensor(p)[0] for p in pids]).double().pow(2).sum()
        dos.overlap_partial = sq if dos.overlap_partial is None else dos.overlap_partial + sq
        if dos.queues.cuda:
            host = torch.empty((), dtype=torch.float64, pin_memory=True)
            host.copy_(dos.overlap_partial, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = dos.overlap_partial.clone(), None
        dos.overlap_last = (host, event)
        return host, event

    def _dostune_finish_overlap(self, inv_f: Optional[float], trace: list) -> None:
        """The step's half of overlap_backward: hand the worker the real factor (its fp32 value), wait for the CPU
        lane, then swap the committed subgroups' shadow buffers in (``inv_f`` None: the step is skipped)."""
        dos = self._dos
        out: StepOutcome = dos.overlap.finish(inv_f, self._dostune_may_commit(inv_f))
        for i in out.committed:
            fp32 = self.fp32_partitioned_groups_flat[i]
            state = self.optimizer.state[fp32]
            new = dos.overlap.shadow(i)
            dos.overlap.set_shadow(i, Buffers(fp32.data, state["exp_avg"], state["exp_avg_sq"]))
            fp32.data, state["exp_avg"], state["exp_avg_sq"] = new.p, new.m, new.v
            state["step"] += 1  # what DeepSpeedCPUAdam.step does before its kernel call
        st = dos.overlap_stats
        st["steps"] += 1
        st["speculative"] += out.speculative
        st["redone"] += out.redone
        st["committed"] += len(out.committed)
        trace += [(lane, i, a, b) for lane, i, a, b in out.spans]
        self._dostune_reset_overlap()

    def _dostune_may_commit(self, inv_f: Optional[float]) -> bool:
        """Whether the CPU lane's speculative updates used this step's real factor (``inv_f`` None: skipped step)."""
        return inv_f is not None and inv_f == self._dos.overlap.spec_inv

    def _dostune_reset_overlap(self) -> None:
        dos = self._dos
        for seen in dos.overlap_seen.values():
            seen.clear()
        dos.overlap_partial = None
        dos.overlap_last = None

    def _dostune_slot_width(self) -> int:
        numel = self.fp16_partitioned_groups_flat_numel
        return max((int(numel[s.subgroup]) for s in self._dos.plan.gpu_slots), default=0)

    def _dostune_new_slot(self, width: int, need_grads: bool) -> dict:
        dev, q = self._dos.lane_device, self._dos.queues
        with q.on("compute"):
            # Allocated on the stream that uses them; freed at the end of the step after the lanes drain.
            slot = {"p": torch.empty(width, device=dev), "m": torch.empty(width, device=dev),
                    "v": torch.empty(width, device=dev),
                    "g": torch.empty(width, device=dev) if need_grads else None}
        slot["ready"] = q.record("compute", timing=False)
        return slot

    def _dostune_stage(self, i: int, slot: dict) -> tuple:
        """Queue subgroup i's fp32 params and Adam states into ``slot`` once the slot is free; (start, done)."""
        q = self._dos.queues
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        fp32 = self.fp32_partitioned_groups_flat[i]
        state = self.optimizer.state[fp32]
        with torch.no_grad(), q.on("h2d"):
            q.wait("h2d", slot["ready"])
            t_in = q.record("h2d")
            slot["p"][:n].copy_(fp32.data, non_blocking=True)
            slot["m"][:n].copy_(state["exp_avg"], non_blocking=True)
            slot["v"][:n].copy_(state["exp_avg_sq"], non_blocking=True)
            return t_in, q.record("h2d")

    def _dostune_step_prefetch(self) -> None:
        """At the step's start, stream the GPU lane's first subgroups' fp32 params and Adam states into every staging
        slot backward has not filled: they do not depend on this step's gradients or clipping factor, so the copies
        run while the host works through DeepSpeed's prologue (releasing the parameters, the gradient norm: about
        40 ms for gpt2-1.3b on the H100), which used to leave the copy engines idle. Backward's activations are
        freed by now, so the slots do not raise peak memory. A skipped step drains and drops them."""
        dos = self._dos
        firsts = dos.plan.first_fills
        need_grads = not dos.schedule.grads_on_gpu
        while len(dos.slots) < len(firsts):
            gs = firsts[len(dos.slots)]
            self._dostune_check_pinned(gs.subgroup)  # a checkpoint load may have replaced the states
            slot = self._dostune_new_slot(self._dostune_slot_width(), need_grads)
            dos.slots[gs.slot] = slot
            dos.prefetched[gs.subgroup] = self._dostune_stage(gs.subgroup, slot)

    # ------------------------------------------------------------------ step
    def step(self, closure=None):
        """Replaces DeepSpeed's ``step``: same prologue and epilogue, interleaved subgroup updates."""
        if not hasattr(self, "_dos"):
            return super().step(closure)
        q = self._dos.queues
        self._dos.step_t0 = (q.record("compute", timing=True) if (self._dos.schedule.trace and q.cuda) else None,
                             time.perf_counter())
        self._dostune_step_prefetch()
        self._pre_step()
        # DeepSpeed releases every gathered parameter first (_partition_all_parameters: ~50 ms of Python for
        # gpt2-1.3b on the H100, the GPU idle). It neither reads the gradients nor writes the partitions the lanes
        # update, so the global norm comes first and the lanes run while the host releases the parameters; the
        # values are the same either way.

        # Same order as the parent: raw overflow first, then the global norm, then the loss-scale update
        # (which skips the step and clears gradients on overflow).
        self._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_global_grad_norm = None
        if not self.overflow:
            self._apply_muon_to_accumulated_grads()
            scaled_global_grad_norm = combine_grad_norm_groups(self._get_norm_groups())
            if is_invalid_grad_norm(scaled_global_grad_norm):
                self.overflow = True
        if self._loss_scale_update_and_overflow_cleanup():
            # The staging slots filled at the step's start may still be in flight.
            self._dos.queues.drain()
            self._dos.device_grads.clear()
            self._dos.grad_home.clear()
            self._dos.reset_slots()
            if self._dos.overlap is not None:
                self._dostune_finish_overlap(None, [])
            self._partition_all_parameters()
            return
        self._global_grad_norm = scaled_global_grad_norm / self.loss_scale

        timer_names = {OPTIMIZER_STEP_TIMER}
        self.timers(OPTIMIZER_STEP_TIMER).start()
        self._dostune_sync_beta_powers()
        t0 = time.perf_counter()
        self._dostune_update(self._combined_scale(scaled_global_grad_norm), self._partition_all_parameters)
        self._dos.last_step_s = time.perf_counter() - t0
        self._dos.steps += 1
        self._dos.beta_step = int(self.optimizer.state[self.fp32_partitioned_groups_flat[0]]["step"])
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._post_step(timer_names)
        self._dostune_close_phases(t0)

    def _dostune_close_phases(self, t_update: float) -> None:
        """File this step's host-time marks as phases (seconds), keeping the last ``PHASE_WINDOW`` steps."""
        dos = self._dos
        m, t_end = dos.step_marks, time.perf_counter()
        t_start = dos.step_t0[1]
        dos.step_phases.append({
            "before_lanes": t_update - t_start,
            "queue_and_host_work": m.get("queued", t_update) - t_update,
            "wait_for_lanes": m.get("joined", t_end) - m.get("queued", t_update),
            "after_lanes": t_end - m.get("joined", t_end),
        })
        del dos.step_phases[:-PHASE_WINDOW]
        dos.step_marks = {}

    def _dostune_sync_beta_powers(self) -> None:
        """Make a resumed run's Adam constants bit-equal to an uninterrupted run's.

        DeepSpeed's C++ Adam keeps beta1^t and beta2^t as running float products, but a fresh process (after
        a checkpoint load) computes them with pow() at its first step, which differs in the last bit at some
        steps (e.g. beta2=0.999 at t=6), so every later update would drift. Advancing the products one step
        at a time through the loaded history (empty tensors: no element is touched) restores the exact
        state an uninterrupted run would have."""
        dos = self._dos
        done = int(self.optimizer.state[self.fp32_partitioned_groups_flat[0]]["step"])
        if dos.beta_step == done:
            return
        dos.beta_step = done
        if done == 0:
            return
        empty = torch.empty(0, dtype=torch.float32)
        group = self.optimizer.param_groups[self.sub_group_to_group_id[0]]
        beta1, beta2 = group["betas"]
        ops = [(self.optimizer.ds_opt_adam, self.optimizer.opt_id)] + dos.lane_adam.cpu_ops()
        dos.lane_adam.shadow = type(dos.lane_adam.shadow)(beta1, beta2)
        for t in range(1, done + 1):
            for op, opt_id in ops:
                op.adam_update(opt_id, t, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                               group["bias_correction"], empty, empty, empty, empty)
            dos.lane_adam.shadow.increment(t, beta1, beta2)

    def _combined_scale(self, total_norm):
        # The same expression as DeepSpeed's unscale_and_clip_grads, so both lanes use its exact value.
        combined_scale = self.loss_scale
        if self.clip_grad > 0.:
            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad
            clip = torch.clamp(clip, min=1.0)
            combined_scale = clip * self.loss_scale
        return combined_scale

    @torch.no_grad()
    def _dostune_update(self, combined_scale, host_work=None) -> None:
        """Both lanes for this step; ``host_work`` (if given) runs on the host once the GPU lane is queued and the
        CPU lane has the real factor, i.e. while both lanes work."""
        dos = self._dos
        q, plan, sched = dos.queues, dos.plan, dos.schedule
        inv = 1. / combined_scale
        inv_f = float(inv)  # fp32 value; multiplying an fp32 tensor by it equals DeepSpeed's mul_(tensor)
        trace: list = []
        start_ev, t_host0 = dos.step_t0 if dos.step_t0 is not None else (None, time.perf_counter())
        q.after_current()
        for i in range(len(self.fp16_groups)):  # keep host state pinned after a checkpoint load replaced it
            self._dostune_check_pinned(i)
        # adaptive_swing's clock: the gradient norm has just been copied to the host, so the GPU has caught up and
        # this event runs at about this host time; the lanes' ends are measured from it
        origin = None
        if dos.balance is not None and q.cuda:
            origin = (torch.cuda.Event(enable_timing=True), time.perf_counter())
            origin[0].record()

        if dos.overlap is not None:
            dos.overlap.prepare()  # this step's CPU Adam constants, before the GPU lane advances step counts
        scalars = self._dostune_step_scalars()  # likewise for the GPU lane
        inv32 = float(np.float32(inv_f))  # what the speculative updates' factor is compared with
        self._dostune_queue_gpu_lane(inv_f, trace, plan.gpu_subgroups, scalars)
        gpu_ends = [q.record(lane, timing=True) for lane in ("compute", "d2h")] if origin is not None else []
        if dos.overlap is not None:
            dos.overlap.submit(inv32, self._dostune_may_commit(inv32))
        if host_work is not None:
            host_work()
        dos.step_marks["queued"] = time.perf_counter()
        if dos.overlap is not None:
            self._dostune_finish_overlap(inv32, trace)
        else:
            prev_threads = torch.get_num_threads()
            if sched.cpu_threads:
                torch.set_num_threads(sched.cpu_threads)
            try:
                self._dostune_run_cpu_lane(inv, trace)
            finally:
                torch.set_num_threads(prev_threads)
        for i in range(len(self.fp16_groups)):
            self._unflatten_partitioned_parameters(i)
        q.join()
        dos.step_marks["joined"] = time.perf_counter()
        dos.device_grads.clear()
        dos.grad_home.clear()
        dos.reset_slots()  # safe: the lanes' streams are drained and the default stream waits on them
        if sched.trace:
            dos.last_trace = self._dostune_resolve_trace(trace, start_ev, t_host0)
        if dos.balance is not None:
            dos.swing_steps[dos.swing] = dos.swing_steps.get(dos.swing, 0) + 1
            swing = dos.balance.observe(self._dostune_lane_times(trace, origin, gpu_ends, len(plan.gpu_slots)))
            if swing != dos.swing:
                self._dostune_set_swing(swing)

    def _dostune_lane_times(self, trace: list, origin, gpu_ends: list, streamed: int) -> Optional[LaneTimes]:
        """This step's lane ends for adaptive_swing (None where they cannot be measured: no CUDA, or no cost of
        one more subgroup known yet for a lane)."""
        if origin is None:
            return None
        ev0, t0 = origin
        for e in gpu_ends:
            e.synchronize()  # join() waits for the copies back on the host, the compute lane only on the GPU
        gpu_end = max(ev0.elapsed_time(e) for e in gpu_ends) / 1e3
        spans = [(a - t0, b - t0) for lane, _, a, b in trace if lane == "cpu"]
        return lane_times(spans, gpu_end, streamed, self._dos.sub_cost_s)

    def _dostune_set_swing(self, swing: int) -> None:
        """Re-plan with ``swing`` streamed GPU-lane subgroups on the CPU lane, between steps: where the next
        backward sends gradients (kept on the GPU or copied to the host) follows the new lanes."""
        dos = self._dos
        dos.swing = swing
        dos.plan = make_plan(len(self.fp16_groups), dos.schedule, swing=swing)
        dos.gpu_set = frozenset(dos.plan.gpu_subgroups)
        if dos.overlap is not None:
            dos.overlap_seen = {i: set() for i in dos.plan.cpu_order}
            dos.overlap.subgroups = list(dos.plan.cpu_order)

    def _dostune_check_pinned(self, i: int) -> None:
        fp32 = self.fp32_partitioned_groups_flat[i]
        state = self.optimizer.state[fp32]
        stale = not state or (self._dos.queues.cuda and not all(
            t.is_pinned() for t in (fp32.data, state["exp_avg"], state["exp_avg_sq"])))
        if stale:
            self._dostune_adopt_subgroup_state(i)

    def _dostune_queue_gpu_lane(self, inv: float, trace: list, todo: list[int], scalars: dict) -> None:
        """Queue the GPU-lane subgroups ``todo``: H2D into a staging slot (unless their states came in at the step's
        start), fused Adam, convert, D2H. Slots are reused round robin, each refill waiting for the slot's
        previous write-back. Nothing here blocks the host."""
        dos = self._dos
        q, sched = dos.queues, dos.schedule
        if not todo:
            return
        numel = self.fp16_partitioned_groups_flat_numel
        width = self._dostune_slot_width()
        need_grads = not sched.grads_on_gpu
        dev = dos.lane_device
        nslots = min(sched.staging_buffers, len(dos.plan.gpu_slots))
        for i in todo:
            if i in dos.resident_set:
                self._dostune_update_resident(i, inv, trace, scalars)
                continue
            n = int(numel[i])
            fp32 = self.fp32_partitioned_groups_flat[i]
            state = self.optimizer.state[fp32]
            idx = dos.slot_uses % nslots
            dos.slot_uses += 1
            early = dos.prefetched.get(i)  # the step's prefetch filled slot k with the k-th
            slot = dos.slots.get(idx)
            if slot is None:
                slot = dos.slots[idx] = self._dostune_new_slot(width, need_grads)
            p, m, v = slot["p"][:n], slot["m"][:n], slot["v"][:n]
            if early is not None and not need_grads:
                # Params and states came in during DeepSpeed's prologue and nothing else is to copy:
                # the update waits for this subgroup's own copies. An event recorded now would follow every copy
                # queued on the h2d stream so far, i.e. all the prefetched slots (the H100 timeline of
                # results/h100/nt-gpt2-1.3b: the first streamed subgroup's Adam waited ~16 ms for the other two).
                h2d_done = early[1]
                trace.append(("h2d", i, *early))
            else:
                with q.on("h2d"):
                    q.wait("h2d", slot["ready"])
                    if early is not None:
                        trace.append(("h2d", i, *early))
                    else:
                        t_in = q.record("h2d")
                        p.copy_(fp32.data, non_blocking=True)
                        m.copy_(state["exp_avg"], non_blocking=True)
                        v.copy_(state["exp_avg_sq"], non_blocking=True)
                    if need_grads:
                        t_in = q.record("h2d") if early is not None else t_in
                        slot["g"][:n].copy_(fp32.grad, non_blocking=True)
                    h2d_done = q.record("h2d")
            g = slot["g"][:n] if need_grads else dos.device_grads.get(i)
            if g is None:  # no gradient reached this subgroup (e.g. unused parameters): DeepSpeed's is zeros
                with q.on("compute"):
                    g = torch.zeros(n, device=dev)
            state["step"] += 1
            with q.on("compute"):
                q.wait("compute", h2d_done)
                t_c = q.record("compute")
                dos.lane_adam.update(p, g, m, v, self.fp16_partitioned_groups_flat[i], inv, state["step"],
                                     self.optimizer.param_groups[self.sub_group_to_group_id[i]], scalars.get(i))
                compute_done = q.record("compute")
            with q.on("d2h"):
                q.wait("d2h", compute_done)
                t_out = q.record("d2h")
                fp32.data.copy_(p, non_blocking=True)
                state["exp_avg"].copy_(m, non_blocking=True)
                state["exp_avg_sq"].copy_(v, non_blocking=True)
                slot["ready"] = q.record("d2h")
            if early is None or need_grads:
                trace.append(("h2d", i, t_in, h2d_done))
            trace += [("gpu", i, t_c, compute_done), ("d2h", i, t_out, slot["ready"])]

    def _dostune_update_resident(self, i: int, inv: float, trace: list, scalars: dict) -> None:
        """A resident subgroup: its states are uploaded once (and again only after the host copies changed, e.g. a
        checkpoint load); the update then runs on the GPU copies and writes nothing back over PCIe."""
        dos = self._dos
        q = dos.queues
        n = int(self.fp16_partitioned_groups_flat_numel[i])
        fp32 = self.fp32_partitioned_groups_flat[i]
        state = self.optimizer.state[fp32]
        buf = dos.resident.get(i)
        h2d_done = None
        if buf is None:
            with q.on("compute"):  # kept for the run, so allocated where it is used
                buf = dos.resident[i] = Buffers(*(torch.empty(n, device=dos.lane_device) for _ in range(3)))
            dos.resident_fresh.discard(i)
        if i not in dos.resident_fresh:
            with q.on("h2d"):
                t_in = q.record("h2d")
                buf.p.copy_(fp32.data, non_blocking=True)
                buf.m.copy_(state["exp_avg"], non_blocking=True)
                buf.v.copy_(state["exp_avg_sq"], non_blocking=True)
                h2d_done = q.record("h2d")
            trace.append(("h2d", i, t_in, h2d_done))
            dos.resident_fresh.add(i)
        g = dos.device_grads.get(i)
        with q.on("compute"):
            if g is None:  # no gradient reached this subgroup: DeepSpeed's is zeros
                g = torch.zeros(n, device=dos.lane_device)
            q.wait("compute", h2d_done)
            state["step"] += 1
            t_c = q.record("compute")
            dos.lane_adam.update(buf.p, g, buf.m, buf.v, self.fp16_partitioned_groups_flat[i], inv, state["step"],
                                 self.optimizer.param_groups[self.sub_group_to_group_id[i]], scalars.get(i))
            trace.append(("gpu", i, t_c, q.record("compute")))
        dos.host_stale.add(i)

    def dostune_sync_host(self) -> None:
        """Bring the host copies of the resident subgroups' fp32 params and Adam states up to date (DeepSpeed's
        checkpoints and fp32 accessors read those). Blocks until the copies are done; a no-op when none is behind."""
        dos = getattr(self, "_dos", None)
        if dos is None or not dos.host_stale:
            return
        q = dos.queues
        with torch.no_grad(), q.on("d2h"):
            q.wait("d2h", q.record("compute"))
            for i in sorted(dos.host_stale):
                fp32 = self.fp32_partitioned_groups_flat[i]
                state = self.optimizer.state[fp32]
                buf = dos.resident[i]
                fp32.data.copy_(buf.p, non_blocking=True)
                state["exp_avg"].copy_(buf.m, non_blocking=True)
                state["exp_avg_sq"].copy_(buf.v, non_blocking=True)
        if q.cuda:
            q.streams["d2h"].synchronize()
        dos.host_stale.clear()

    def _dostune_host_changed(self, i: Optional[int] = None) -> None:
        """The host copies of subgroup i (None: all) were replaced or written: they are now the truth, and the
        resident GPU copies are uploaded again before their next update."""
        dos = getattr(self, "_dos", None)
        if dos is None:
            return
        if i is None:
            dos.resident_fresh.clear()
            dos.host_stale.clear()
        else:
            dos.resident_fresh.discard(i)
            dos.host_stale.discard(i)

    # --------------------------------------------------- gradient accessors
    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        # Replaces DeepSpeed's method (behind safe_get_full_grad / safe_get_local_grad and their setters), which reads
        # the fp32 gradient buffer of the offloaded subgroup: dostune does not fill it for GPU-lane subgroups
        # (gradients stay on the device) nor for CPU-lane ones updated during backward (read from the half-precision
        # copy), so without this those accessors returned stale values. A device gradient is returned as a view (a
        # setter writes what the GPU lane will use); a half-precision one widened to fp32, the values DeepSpeed's
        # buffer would hold.
        dos = getattr(self, "_dos", None)
        i, dest_offset, n = self.grad_position[self.get_param_id(param)]
        home = None if dos is None else dos.grad_home.get(i)
        if home is None:
            return super()._get_fp32_grad_state_partition(param, release_swap_buffers)
        if dos.queues.cuda:
            self.reduce_and_partition_stream.synchronize()
        if home == "device":
            return dos.device_grads[i].narrow(0, dest_offset, n), i
        return self.grad_partitions_flat_buffer.narrow(0, dos.grad_slices[i][0] + dest_offset, n).float(), i

    def _dostune_check_grad_writable(self, param) -> None:
        dos = getattr(self, "_dos", None)
        if dos is None or not param.requires_grad:
            return
        i = self.grad_position[self.get_param_id(param)][0]
        if dos.grad_home.get(i) == "half":
            raise ConfigError(
                f"dostune: the gradient of subgroup {i} cannot be changed between backward and step: with "
                f"overlap_backward its update already started during backward. Set \"overlap_backward\": false "
                f"in the dostune section to modify gradients before the step.")

    def set_fp32_grad_for_param(self, value, param):
        # DeepSpeed's method, after refusing a gradient an update started during backward has already read.
        self._dostune_check_grad_writable(param)
        return super().set_fp32_grad_for_param(value, param)

    def set_local_grad_for_param(self, value, param):
        # Likewise.
        self._dostune_check_grad_writable(param)
        return super().set_local_grad_for_param(value, param)

    def get_fp32_grad_partitions(self):
        # DeepSpeed's method reads the fp32 gradient buffers directly: the subgroups dostune keeps elsewhere are
        # read where they are (see _get_fp32_grad_state_partition).
        grads = super().get_fp32_grad_partitions()
        dos = getattr(self, "_dos", None)
        if dos is not None and dos.grad_home:
            for i, group in enumerate(self.fp16_groups):
                if i in dos.grad_home:
                    for j, p in enumerate(group):
                        grads[i][j] = self._get_fp32_grad_state_partition(p, False)[0]
        return grads

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        # DeepSpeed's method rewrites the fp32 gradient buffers directly, which dostune does not read for the
        # subgroups it keeps elsewhere: refused for those rather than silently ignored.
        dos = getattr(self, "_dos", None)
        if dos is not None and any(p.requires_grad and self.grad_position[self.get_param_id(p)][0] in dos.grad_home
                                   for p in param_list):
            raise ConfigError("dostune: update_fp32_grad_for_param_vectorized is not supported for subgroups on the "
                              "GPU lane or updated during backward; use safe_set_full_grad / safe_set_local_grad")
        return super().update_fp32_grad_for_param_vectorized(update_func, param_list)

    # DeepSpeed's checkpoint and fp32 accessors read or write the host copies: the resident subgroups' GPU copies are
    # written back before a read, and uploaded again after a write. Each replaces the parent method only by that.
    def state_dict(self):
        self.dostune_sync_host()
        return super().state_dict()

    def load_state_dict(self, *args, **kwargs):
        self.dostune_sync_host()  # a partial load (e.g. weights only) keeps the rest of the resident states
        out = super().load_state_dict(*args, **kwargs)
        self._dostune_host_changed()
        return out

    def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, checkpoint_dir):
        self.dostune_sync_host()
        out = super().load_hp_checkpoint_state_from_checkpoint_dir_stage3(checkpoint_dir)
        self._dostune_host_changed()
        return out

    def refresh_fp32_params(self):
        out = super().refresh_fp32_params()
        self._dostune_host_changed()
        return out

    def get_full_hp_param(self, param, optim_state_key=None):
        self.dostune_sync_host()
        return super().get_full_hp_param(param, optim_state_key)

    def get_local_fp32_param(self, param, optim_state_key=None):
        self.dostune_sync_host()
        return super().get_local_fp32_param(param, optim_state_key)

    def set_full_hp_param(self, value, param, optim_state_key=None):
        self.dostune_sync_host()
        out = super().set_full_hp_param(value, param, optim_state_key)
        self._dostune_host_changed()
        return out

    def set_local_hp_param(self, value, param, optim_state_key=None):
        self.dostune_sync_host()
        out = super().set_local_hp_param(value, param, optim_state_key)
        self._dostune_host_changed()
        return out

    def _dostune_step_scalars(self, which: Optional[frozenset] = None) -> dict[int, AdamScalars]:
        """The float constants DeepSpeed's C++ Adam would use for each subgroup in ``which`` (default: the GPU
        lane's) this step: replay its IncrementStep over all subgroups in DeepSpeed's order (step numbers
        after this step's increment). Idempotent within a step."""
        dos = self._dos
        which = dos.gpu_set if which is None else which
        shadow, out = dos.lane_adam.shadow, {}
        for i in range(len(self.fp16_groups)):
            group = self.optimizer.param_groups[self.sub_group_to_group_id[i]]
            step = self.optimizer.state[self.fp32_partitioned_groups_flat[i]]["step"] + 1
            shadow.increment(step, *group["betas"])
            if i in which:
                out[i] = shadow.scalars(group["lr"], group["eps"], group["weight_decay"], group["bias_correction"],
                                        self.optimizer.adam_w_mode)
        return out

    def _dostune_run_cpu_lane(self, inv, trace: list) -> None:
        """DeepSpeed's own per-subgroup CPU update, then an asynchronous upload of the half-precision
        params. Runs on the host while the GPU lane's queued work proceeds."""
        dos = self._dos
        q, sched = dos.queues, dos.schedule
        numel = self.fp16_partitioned_groups_flat_numel
        cpu_ids = dos.plan.cpu_order
        if not cpu_ids:
            return
        width = max(int(numel[i]) for i in cpu_ids)
        staging, half_bufs, half_free = None, [], []
        if q.cuda:
            if sched.upload == "gpu_convert":
                with q.on("up"):
                    staging = torch.empty(width, device=dos.lane_device)
            else:
                half = self.fp16_partitioned_groups_flat[cpu_ids[0]].dtype
                half_bufs = [torch.empty(width, dtype=half, pin_memory=True) for _ in range(2)]
                half_free = [None, None]
        for k, i in enumerate(cpu_ids):
            fp32 = self.fp32_partitioned_groups_flat[i]
            c0 = time.perf_counter()
            fp32.grad.mul_(inv)  # DeepSpeed's unscale_and_clip_grads, with the same factor
            self._optimizer_step(i)  # DeepSpeed's own DeepSpeedCPUAdam call for this subgroup
            c1 = time.perf_counter()
            trace.append(("cpu", i, c0, c1))
            dst, n = self.fp16_partitioned_groups_flat[i], int(numel[i])
            if not q.cuda:
                dst.copy_(fp32.data)
                continue
            if sched.upload == "gpu_convert":
                with q.on("up"):
                    t_up = q.record("up")
                    staging[:n].copy_(fp32.data, non_blocking=True)
                    dst.copy_(staging[:n])
                    trace.append(("up", i, t_up, q.record("up")))
            else:
                b = k % 2
                if half_free[b] is not None:
                    half_free[b].synchronize()  # the previous upload from this pinned buffer is done
                half_bufs[b][:n].copy_(fp32.data)  # convert on the CPU
                with q.on("up"):
                    t_up = q.record("up")
                    dst.copy_(half_bufs[b][:n], non_blocking=True)
                    half_free[b] = q.record("up")
                    trace.append(("up", i, t_up, half_free[b]))
        if staging is not None:
            self._dos.queues.streams["up"].synchronize()

    def _dostune_resolve_trace(self, raw: list, start_ev, t_host0: float) -> list[Span]:
        spans = []
        # Host timestamps (the CPU lane; every lane on a CPU device) are relative to the host clock at the
        # step's start, CUDA events to an event queued at that moment on an idle stream.
        for lane, i, a, b in raw:
            if isinstance(a, float):
                spans.append(Span(lane, i, a - t_host0, b - t_host0))
            elif start_ev is not None:
                spans.append(Span(lane, i, start_ev.elapsed_time(a) / 1e3, start_ev.elapsed_time(b) / 1e3))
        return sorted(spans, key=lambda s: s.start)
