"""The interleaved optimizer: DeepSpeed 0.19.8's ZeRO-3 optimizer with CPU offload, whose per-subgroup update loop
is replaced by two lanes that run at the same time (step.py says how). This class holds only the DeepSpeed methods
dostune replaces; each delegates to the object that does the work. Everything else is DeepSpeed's.

DeepSpeed method replaced                            why (-> where the work is)
---------------------------------------------------  -------------------------------------------------------------------
step                                                 the subgroup loop becomes the two lanes, between DeepSpeed's own
                                                     prologue and epilogue helpers (-> InterleavedStep.step)
_offload_grad_partition_at_boundary                  GPU-lane gradients stay on the GPU; the CPU lane during backward
                                                     reads the half-precision copy and gets each subgroup as soon as its
                                                     gradients are final (-> GradRouting.at_boundary)
partition_grads                                      hands the gradient partition on instead of DeepSpeed's bitwise
                                                     equal copy back from the host; no host copy of GPU-lane gradients
                                                     where nothing reads it (-> GradRouting.partition)
complete_grad_norm_calculation_for_cpu_offload       one host copy of all recorded norms instead of two kernels per
                                                     parameter and two syncs per subgroup; the same values
                                                     (-> GradNorms.subgroup_norm)
_get_norm_groups                                     every subgroup's norm at once, the same values
                                                     (-> GradNorms.all_norms)
reset_cpu_buffers                                    the raw norms are cleared with DeepSpeed's (-> GradNorms.clear)
_get_fp32_grad_state_partition                       DeepSpeed's gradient accessors read gradients where dostune keeps
                                                     them (-> GradRouting.fp32_partition)
get_fp32_grad_partitions                             likewise (-> GradRouting.fill_partitions)
set_fp32_grad_for_param                              refuse to change a gradient that an update started during backward
                                                     has already read (-> GradRouting.check_writable)
set_local_grad_for_param                             likewise
update_fp32_grad_for_param_vectorized                refused for gradients kept elsewhere, not silently ignored
                                                     (-> GradRouting.refuse_vectorized_update)
destroy                                              stops the CPU-lane worker and unpins host memory
                                                     (-> InterleavedStep.close)

The resident subgroups (``resident_subgroups``) use DeepSpeed's own Twin-Flow placement unchanged: with
``offload_optimizer.ratio`` below 1 its constructor builds the first int((1 - ratio) * n) subgroups' fp32 params
(``_create_fp32_partitions``, from the half-precision partition, straight on the GPU) and fp32 gradient buffers
(``initialize_optimizer_states``, which zeroes each in host memory first: one subgroup's 4 bytes per element at a
time, freed at once) on the GPU and keeps no host copy, which is the resident subgroups' state with
gpu_placement "first": the emitted config writes that ratio from the schedule (dsconfig.py), and ``adopt`` refuses
one that disagrees. That beats moving the state to the GPU after DeepSpeed built it on the host: the host copy would
exist at start-up, and a 13B model's is what does not fit a 125 GiB host. Their Adam states are created beside the
params, on the GPU (host_state.py), in ``optimizer.state[fp32 params]``, where DeepSpeed's checkpoint reads them.
DeepSpeed methods this leaves as they are, and why that is right:

_optimizer_step, backup_optimizer                    DeepSpeed's Twin-Flow steps its GPU subgroups with a torch AdamW
                                                     of its own (different arithmetic, states outside the checkpoint);
                                                     the GPU lane updates the resident subgroups instead, from the
                                                     DeepSpeedCPUAdam states, with DeepSpeedCPUAdam's arithmetic, and
                                                     never hands one to _optimizer_step (pressure.py's fallback takes
                                                     streamed subgroups only: the resident ones allocate nothing)
_rigid_state_dict, get_full_hp_param,                read the tensors where they are: one copy of each subgroup's
get_local_fp32_param                                 state, on the GPU for the resident ones (a checkpoint holds them
                                                     as DeepSpeed's, and loads anywhere with map_location 'cpu')
_rigid_load_state_dict, set_full_hp_param,           write them where they are: fp32 params by copy_, the Adam states
set_local_hp_param, refresh_fp32_params,             through torch's Optimizer.load_state_dict, which moves each saved
load_hp_checkpoint_state_from_checkpoint_dir_stage3  state to its param's device; so a checkpoint of plain DeepSpeed at
                                                     ratio 1.0 loads into the resident subgroups and one of theirs into
                                                     plain DeepSpeed, bit for bit; the lanes read the state afresh
                                                     each step (host_state.py pins replaced host tensors)

The object is created by DeepSpeed as a ``DeepSpeedZeroOptimizer_Stage3`` and re-classed by
:meth:`InterleavedZeroOptimizer.adopt` once its ``_dos`` (the InterleavedStep) is built, so DeepSpeed's engine,
checkpointing and config parsing stay untouched and every replaced method can rely on ``_dos``.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..deepspeed_support import check_deepspeed, remember_cpu_info
from ..errors import ConfigError
from .cpu_lane import CpuLaneSeams
from .schedule import Plan, ScheduleConfig, resident_placement_problem
from .step import InterleavedStep
from .timeline import Span

log = logging.getLogger(__name__)


def unsupported_reason(opt: DeepSpeedZeroOptimizer_Stage3) -> Optional[str]:
    """Why this DeepSpeed optimizer cannot run the interleaved update, or None if it can."""
    if not opt.offload_optimizer:
        return "zero_optimization.offload_optimizer.device must be 'cpu' (the optimizer state is not offloaded)"
    if opt.swap_optimizer:
        return "offload_optimizer.device 'nvme' is not supported, use 'cpu'"
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


class InterleavedZeroOptimizer(DeepSpeedZeroOptimizer_Stage3):
    _dos: InterleavedStep

    @classmethod
    def adopt(cls, opt: DeepSpeedZeroOptimizer_Stage3, schedule: ScheduleConfig,
              seams: CpuLaneSeams = CpuLaneSeams()) -> "InterleavedZeroOptimizer":
        """Turn a constructed DeepSpeed ZeRO-3 optimizer into an interleaved one, in place. ``seams``: what a test
        may change of the CPU lane (the default changes nothing)."""
        if isinstance(opt, cls):
            return opt
        # the overrides below replace private Stage-3 methods: every way in (initialize, attach, the HF callback)
        # passes here, so this is where an untested DeepSpeed release is refused
        note = check_deepspeed("dostune's ZeRO-3 optimizer")
        if note:
            log.warning(note)
        # HF and Accelerate build engines without ensure_distributed: from here on their CPU Adams reuse one answer
        remember_cpu_info()
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
                hint="tune for exactly this model (a Hugging Face model: --model hf:its-config.json; the subgroups follow "
                     "its parameter order), or carry the schedule over with `dostune refit`")
        problem = resident_placement_problem(opt.partial_offload, n, schedule)
        if problem is not None:
            raise ConfigError(f"the dostune schedule cannot run with this DeepSpeed config: {problem}",
                              hint="let `dostune tune` or `dostune refit` write the config; they set the ratio")
        opt._dos = InterleavedStep(opt, schedule, seams)  # built on the DeepSpeed object, before any method is replaced
        opt.__class__ = cls
        return opt

    # ------------------------------------------------------------- reporting
    @property
    def dostune_schedule(self) -> ScheduleConfig:
        return self._dos.schedule

    @property
    def dostune_plan(self) -> Plan:
        return self._dos.plan

    @property
    def dostune_last_trace(self) -> list[Span]:
        return list(self._dos.clock.last_trace)

    @property
    def dostune_overlap_stats(self) -> dict:
        """overlap_backward counters since start: steps, CPU-lane subgroups updated speculatively during backward,
        how many of those were recomputed (clipping triggered), how many CPU-lane updates were committed from
        shadow buffers, and how many were made in place in the step (``in_step``: the subgroups beyond
        speculative_subgroups)."""
        return self._dos.overlap_stats

    @property
    def dostune_pressure_stats(self) -> dict:
        """GPU memory pressure counters since start: steps whose GPU lane could not get its device memory and left
        subgroups to DeepSpeed's own update on the host (``fallback_steps``), those subgroup updates
        (``fallback_subgroups``), and steps whose CPU-lane results went up without the upload buffer
        (``upload_fallback_steps``). The values are the same either way (docs/faults.md)."""
        return self._dos.pressure_stats

    @property
    def dostune_step_phases(self) -> dict:
        """Median host milliseconds of the last ``PHASE_WINDOW`` steps' parts (skipped steps not counted):
        ``before_lanes`` (DeepSpeed's prologue, overflow check and global norm), ``queue_and_host_work`` (queueing
        the GPU lane, handing the CPU lane its factor, and the parameter release that runs beside the lanes),
        ``wait_for_lanes`` (until both lanes are done and the partitions unflattened), ``after_lanes`` (the
        swing's decision, DeepSpeed's epilogue); empty before the first step."""
        return self._dos.clock.median_phases_ms()

    @property
    def dostune_swing_stats(self) -> dict:
        """adaptive_swing: how many steps ran with each swing (k > 0: k of the GPU lane's streamed subgroups on the
        CPU lane; k < 0: -k of the CPU lane's subgroups on the GPU lane), and the swing the next step runs."""
        return self._dos.swing_stats

    @property
    def dostune_swing(self) -> Optional[int]:
        """The swing the next step runs (see dostune_swing_stats); None when the schedule can move no subgroup."""
        return self._dos.split.swing if len(self._dos.plan.swing_range) > 1 else None

    @property
    def dostune_registered_bytes(self) -> int:
        """Host memory the optimizer page-locked in place (DeepSpeed's states and buffers; the lanes' own pinned
        buffers come from torch's pinned allocator and are counted by its statistics)."""
        return self._dos.pins.nbytes

    # ------------------------------------------------ DeepSpeed's, replaced
    def step(self, closure=None):
        self._dos.step()

    def _offload_grad_partition_at_boundary(self, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets):
        self._dos.grads.at_boundary(param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets)

    def partition_grads(self, params_to_release, grad_partitions):
        out = self._dos.grads.partition(params_to_release, grad_partitions)
        return super().partition_grads(params_to_release, grad_partitions) if out is None else out

    def complete_grad_norm_calculation_for_cpu_offload(self, params):
        return self._dos.norms.subgroup_norm(params)

    def _get_norm_groups(self):
        out = self._dos.norms.all_norms()
        return super()._get_norm_groups() if out is None else out

    def reset_cpu_buffers(self):
        super().reset_cpu_buffers()
        self._dos.norms.clear()

    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        out = self._dos.grads.fp32_partition(param)
        return super()._get_fp32_grad_state_partition(param, release_swap_buffers) if out is None else out

    def get_fp32_grad_partitions(self):
        return self._dos.grads.fill_partitions(super().get_fp32_grad_partitions())

    def set_fp32_grad_for_param(self, value, param):
        self._dos.grads.check_writable(param)
        return super().set_fp32_grad_for_param(value, param)

    def set_local_grad_for_param(self, value, param):
        self._dos.grads.check_writable(param)
        return super().set_local_grad_for_param(value, param)

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        self._dos.grads.refuse_vectorized_update(param_list)
        return super().update_fp32_grad_for_param_vectorized(update_func, param_list)

    def destroy(self):
        self._dos.close()
        super().destroy()
