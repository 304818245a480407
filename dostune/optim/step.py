"""The interleaved step: everything dostune adds to one DeepSpeed ZeRO-3 optimizer, built once at start-up from the
schedule (which lanes exist and in which form), and the order in which a step runs them.

DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3.step()`` updates subgroups one after another: unscale/clip the
subgroup's fp32 gradient, DeepSpeedCPUAdam, then a blocking pageable fp32->half copy into the GPU partition. Here the
prologue (overflow check, global norm, loss-scale update) and epilogue (``_post_step``) are DeepSpeed's own helpers
called in DeepSpeed's order, and in between the GPU lane is queued up front on its own streams, then the host runs
the CPU lane, so CPU Adam, GPU Adam and both PCIe directions overlap. The math is DeepSpeed's: the same global-norm
clipping and loss-scale/overflow handling, the same Adam/AdamW update from the same state.

Each step runs a plan: the run's (``plan``), or, when the GPU lane cannot get its device memory at that step, one
with the subgroups concerned moved to DeepSpeed's own update on the host (``step_plan``, pressure.py). The run's plan
changes between steps when adaptive_swing moves subgroups between the lanes, either way (swing.py, balance.py); the
next backward routes the gradients for the new lanes.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.stage3 import OPTIMIZER_STEP_TIMER

from .adam_steps import AdamSteps
from .cpu_lane import CpuBackwardLane, CpuLaneSeams, CpuStepLane, deepspeed_update
from .device import pick_device
from .footprint import check_host_fits, check_staging_fits
from .gpu_lane import ResidentGpuLane, StreamedGpuLane
from .grads import GradRouting
from .host_state import HostStates
from .norms import GradNorms
from .pressure import MemoryPressure
from .queues import Queues
from .schedule import Plan, ScheduleConfig, host_half_gradients, make_plan, updates_in_backward
from .swing import AdaptiveSplit, FixedSplit
from .timeline import StepClock
from .uploads import deepspeed_upload


class InterleavedStep:
    """``seams``: what a test may change of the lanes (cpu_lane.CpuLaneSeams; the default changes nothing)."""

    def __init__(self, opt, schedule: ScheduleConfig, seams: CpuLaneSeams = CpuLaneSeams()):
        self.opt, self.schedule = opt, schedule
        self.count = len(opt.fp16_groups)
        plan = make_plan(self.count, schedule)
        # The one place that asks which device this rank runs on: every object below gets its answer.
        self.device = device = pick_device()
        # Refused before anything is allocated, so that a config that cannot fit fails in seconds.
        check_staging_fits(opt, schedule, device.free_bytes())
        self.queues = q = Queues(device, timing=schedule.trace)
        self.pins = device.pin_registry()
        self.norms = GradNorms(opt, device)
        self.grads = GradRouting(opt, self.norms, device, schedule.grads_on_gpu)
        # The CPU lane's subgroups need no fp32 gradient buffer when it reads their half-precision gradients: freed
        # before the host memory check, which then finds that memory available again, and before anything is pinned.
        released = self.grads.release(host_half_gradients(self.count, schedule))
        check_host_fits(opt, schedule)
        self.host = HostStates(opt, device, self.pins, released_grads=released)
        d = opt.optimizer.defaults
        self.lane_adam = device.lane_adam(d["betas"][0], d["betas"][1], d["lr"], d["eps"], d["weight_decay"],
                                          opt.optimizer.adam_w_mode)
        self.adam = AdamSteps(opt, self.host, self.lane_adam)
        self.pressure = MemoryPressure()
        self.resident = ResidentGpuLane(self.host, q, self.lane_adam)
        self.streamed = StreamedGpuLane(self.host, self.grads, q, self.lane_adam, schedule.staging_buffers,
                                        schedule.grads_on_gpu, device.torch_device)
        for i in range(self.count):
            self.host.adopt(i)
        # DeepSpeed page-locks its gradient-partition buffer only with offload_optimizer.pin_memory, and then as a
        # power-of-two-rounded pinned copy; dostune's configs leave that off (footprint.py), so it is locked in place
        # here: backward's gradient copies into it stay asynchronous.
        flat = getattr(opt, "grad_partitions_flat_buffer", None)
        if flat is not None:
            self.pins.pin("grad_partitions", flat)
        if updates_in_backward(plan, schedule):
            self.cpu = CpuBackwardLane(opt, self.host, self.grads, self.norms, self.adam, q, self.pins, schedule,
                                       plan, seams)
        else:
            self.cpu = CpuStepLane(opt, self.host, schedule, device.cpu_lane_upload(schedule.upload, q, self.pressure),
                                   seams)
        self.split = AdaptiveSplit(plan, q, seams.wrap_lane_times) if len(plan.swing_range) > 1 else FixedSplit()
        self.clock = StepClock(q, schedule.trace)
        self._set_plan(plan)

    def _set_plan(self, plan: Plan) -> None:
        """Use ``plan``'s lanes from the next backward on (at start-up, and between steps when the swing moves):
        where that backward sends gradients (kept on the GPU or copied to the host) follows the new lanes."""
        self.plan = plan
        self.grads.set_plan(plan, self.cpu.in_backward(plan), self.cpu.grad_final)
        self._run_plan(plan)

    def _run_plan(self, plan: Plan) -> None:
        """The lanes run ``plan`` at the next step."""
        self.step_plan = plan
        self._gpu_set = frozenset(plan.gpu_subgroups)
        self.cpu.set_plan(plan)
        self.resident.set_plan(plan)
        self.streamed.set_plan(plan)

    def _plan_step(self) -> None:
        """Decide this step's plan before any GPU-lane work is queued: ``self.plan``, unless the GPU memory it
        allocates cannot be had (pressure.py); then the GPU-lane subgroups concerned go to the plan's fallback. The
        resident subgroups allocate nothing: DeepSpeed built their state and gradient buffer at start-up."""
        self.grads.reserve(self.plan.gpu_subgroups)
        lost = frozenset(self.grads.lost)  # gradient buffers, in backward or just now
        missing = ["gradient buffers"] if lost else []
        if lost:
            self._run_plan(make_plan(self.count, self.schedule, swing=self.split.swing, fallback=lost))
        if not self.streamed.reserve():
            streamed = frozenset(s.subgroup for s in self.step_plan.gpu_slots)
            self._run_plan(make_plan(self.count, self.schedule, swing=self.split.swing, fallback=lost | streamed))
            missing.append("staging slots")
        if missing:
            self.pressure.gpu_lane_fell_back(self.step_plan.fallback, " and ".join(missing))

    def _fall_back(self, inv, trace: list) -> None:
        """Update the step plan's fallback (streamed GPU-lane subgroups, never resident ones) on the host as DeepSpeed
        does (pressure.py), from DeepSpeed's host copies and its fp32 gradient buffer."""
        host = self.host
        for i in self.step_plan.fallback:
            self.grads.to_host(i)
            deepspeed_update(self.opt, host, i, inv, trace)
            deepspeed_upload(i, host.live(i).p, host.half(i), trace)

    def close(self) -> None:
        self.cpu.close()
        self.pins.close()
        self.lane_adam.close()

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        opt = self.opt
        self.clock.start()
        self._plan_step()
        self.streamed.prefetch()
        opt._pre_step()
        # DeepSpeed releases every gathered parameter first (_partition_all_parameters: ~50 ms of Python for
        # gpt2-1.3b on the H100, the GPU idle). It neither reads the gradients nor writes the partitions the lanes
        # update, so the global norm comes first and the lanes run while the host releases the parameters; the
        # values are the same either way.

        # Same order as DeepSpeed: raw overflow first, then the global norm, then the loss-scale update (which skips
        # the step and clears gradients on overflow).
        opt._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_global_grad_norm = None
        if not opt.overflow:
            opt._apply_muon_to_accumulated_grads()
            scaled_global_grad_norm = combine_grad_norm_groups(opt._get_norm_groups())
            if is_invalid_grad_norm(scaled_global_grad_norm):
                opt.overflow = True
        if opt._loss_scale_update_and_overflow_cleanup():
            self.queues.drain()  # the staging slots filled at the step's start may still be in flight
            self.grads.clear()
            self.streamed.reset()
            self.cpu.skip()
            self._end_step_plan()
            opt._partition_all_parameters()
            return
        opt._global_grad_norm = scaled_global_grad_norm / opt.loss_scale

        timer_names = {OPTIMIZER_STEP_TIMER}
        opt.timers(OPTIMIZER_STEP_TIMER).start()
        self.adam.sync_beta_powers()
        t0 = time.perf_counter()
        self._update(self._combined_scale(scaled_global_grad_norm), opt._partition_all_parameters)
        self.adam.step_done()
        opt.timers(OPTIMIZER_STEP_TIMER).stop()
        opt._post_step(timer_names)
        self.clock.close(t0)

    def _combined_scale(self, total_norm):
        # The same expression as DeepSpeed's unscale_and_clip_grads, so both lanes use its exact value.
        opt = self.opt
        combined_scale = opt.loss_scale
        if opt.clip_grad > 0.:
            clip = ((total_norm / opt.loss_scale) + 1e-6) / opt.clip_grad
            clip = torch.clamp(clip, min=1.0)
            combined_scale = clip * opt.loss_scale
        return combined_scale

    @torch.no_grad()
    def _update(self, combined_scale, host_work) -> None:
        """Both lanes for this step; ``host_work`` runs on the host once the GPU lane is queued and the CPU lane
        has the real factor, i.e. while both lanes work."""
        q = self.queues
        inv = 1. / combined_scale  # the CPU lane at the step multiplies by it as DeepSpeed does
        inv_f = float(inv)  # fp32 value; multiplying an fp32 tensor by it equals DeepSpeed's mul_(tensor)
        inv32 = float(np.float32(inv_f))  # what the speculative updates' factor is compared with
        trace: list = []
        q.after_current()
        for i in range(self.count):  # keep host state pinned after a checkpoint load replaced it
            self.host.ensure_pinned(i)
        self.split.start()
        self.cpu.before_gpu()
        scalars = self.adam.scalars(self._gpu_set)
        self.resident.queue(inv_f, scalars, trace)  # first: they need no copy, so they run while the others stream
        self.streamed.queue(inv_f, scalars, trace)
        self.split.gpu_queued()
        self.cpu.start(inv32)
        host_work()
        self.clock.mark("queued")
        self.cpu.finish(inv, inv32, trace)
        self._fall_back(inv, trace)
        for i in range(self.count):
            self.opt._unflatten_partitioned_parameters(i)
        q.join()
        self.clock.mark("joined")
        self.grads.clear()
        self.streamed.reset()  # safe: the lanes' streams are drained and the default stream waits on them
        self.clock.record(trace)
        # a step that fell back measures no lane as the swing's plan runs it
        fell_back = self._end_step_plan()
        swing = self.split.decide(None if fell_back else trace, self.plan)
        if swing is not None:
            self._set_plan(make_plan(self.count, self.schedule, swing=swing))

    def _end_step_plan(self) -> bool:
        """Back to ``self.plan`` after a step that ran another; whether it did."""
        if self.step_plan is self.plan:
            return False
        self._run_plan(self.plan)
        return True

    # ------------------------------------------------------------ reporting
    @property
    def overlap_stats(self) -> dict:
        return self.cpu.stats

    @property
    def pressure_stats(self) -> dict:
        return self.pressure.stats

    @property
    def swing_stats(self) -> dict:
        return {"steps_by_swing": dict(sorted(self.split.steps_by_swing.items())), "swing": self.split.swing}
