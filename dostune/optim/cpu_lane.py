"""The CPU lane, in one of two forms chosen at start-up:

* ``CpuStepLane``: in the step, DeepSpeed's own per-subgroup update (the same unscale, the same DeepSpeedCPUAdam
  call) in place in host memory, each result then uploaded to the GPU partition while the next one computes;
* ``CpuBackwardLane`` (``overlap_backward``): the worker of overlap.py updates each subgroup during backward as soon
  as its gradients are final, speculatively; the step commits, recomputes or drops its results. With
  ``speculative_subgroups`` only that many speculate (footprint.speculative_set): the worker updates the others in
  the step, in place, with the real factor, beside the GPU lane.

Both offer the step the same calls, in the step's order: ``before_gpu`` (before the GPU lane advances step counts),
``start`` (once the GPU lane is queued), ``finish`` (after the host's own work), or ``skip`` on a skipped step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .adam_steps import AdamSteps
from .footprint import cpu_lane_reach, half_ring_count, speculative_set
from .grads import GradRouting
from .host_state import HostStates
from .norms import GradNorms
from .overlap import BackwardOverlap, StepOutcome, SubgroupIO
from .pinned import PinRegistry
from .queues import Queues
from .schedule import Plan, ScheduleConfig
from .uploads import Upload


def deepspeed_update(opt, host: HostStates, i: int, inv, trace: list) -> None:
    """DeepSpeed's own update of subgroup i in place in host memory, as its step loop runs it: the same unscale
    (``inv``: the factor its unscale_and_clip_grads multiplies by), the same DeepSpeedCPUAdam call."""
    c0 = time.perf_counter()
    host.grad(i).mul_(inv)
    opt._optimizer_step(i)
    trace.append(("cpu", i, c0, time.perf_counter()))


@dataclass(frozen=True)
class CpuLaneSeams:
    """What a test (or the CPU gate's harness) may change of the lanes, given when the optimizer is built; the
    defaults change nothing.

    ``wrap_update``: called once with the lane's per-subgroup update function, returns the function the lane calls
    instead (the CPU gate's harness makes the lane slower with it, to prove the gate catches that); None: the update
    as it is. ``partial_norm_cutoff``: overlap_backward stops speculating once the partial gradient norm makes
    clipping certain; False makes every subgroup speculate, so that a clipped step recomputes them all.
    ``wrap_lane_times``: called once with adaptive_swing's measurement of a step's lane ends (swing.py), returns the
    function the split calls instead: a test scripts which lane ends last with it (a CPU device measures nothing),
    or watches what the device measured; None: the measurement as it is."""

    wrap_update: Optional[Callable[[Callable], Callable]] = None
    partial_norm_cutoff: bool = True
    wrap_lane_times: Optional[Callable[[Callable], Callable]] = None


class CpuStepLane:
    """``upload``: how each result reaches the device (the device's choice for the schedule, uploads.py)."""

    def __init__(self, opt, host: HostStates, schedule: ScheduleConfig, upload: Upload, seams: CpuLaneSeams):
        self._opt, self._host = opt, host
        self._update = deepspeed_update if seams.wrap_update is None else seams.wrap_update(deepspeed_update)
        self._threads = schedule.cpu_threads
        self._upload = upload
        self._order: list[int] = []

    def in_backward(self, plan: Plan) -> frozenset:
        return frozenset()

    def set_plan(self, plan: Plan) -> None:
        self._order = list(plan.cpu_order)

    def grad_final(self, i: int, pid: int) -> None:
        raise AssertionError("the CPU lane at the step takes no subgroup during backward")

    def before_gpu(self) -> None:
        pass

    def start(self, inv32: float) -> None:
        pass

    def finish(self, inv, inv32: float, trace: list) -> None:
        """Run the lane on the host while the GPU lane's queued work proceeds: DeepSpeed's own per-subgroup CPU
        update, then an asynchronous upload of the half-precision params. ``inv``: DeepSpeed's unscale factor, in
        the form its unscale_and_clip_grads multiplies by."""
        if not self._order:
            return
        prev_threads = torch.get_num_threads()
        if self._threads:
            torch.set_num_threads(self._threads)
        try:
            self._run(inv, trace)
        finally:
            torch.set_num_threads(prev_threads)

    def _run(self, inv, trace: list) -> None:
        host, up = self._host, self._upload
        up.begin(max(host.numel(i) for i in self._order), host.half(self._order[0]).dtype)
        for k, i in enumerate(self._order):
            self._update(self._opt, host, i, inv, trace)
            up.send(k, i, host.live(i).p, host.half(i), trace)
        up.end()

    def skip(self) -> None:
        pass

    @property
    def stats(self) -> dict:
        return {"steps": 0, "speculative": 0, "redone": 0, "committed": 0, "in_step": 0}

    def close(self) -> None:
        pass


class CpuBackwardLane:
    def __init__(self, opt, host: HostStates, grads: GradRouting, norms: GradNorms, adam: AdamSteps,
                 queues: Queues, pins: PinRegistry, schedule: ScheduleConfig, plan: Plan, seams: CpuLaneSeams):
        self._opt, self._host, self._grads, self._norms, self._queues = opt, host, grads, norms, queues
        self._adam, self._plan = adam, plan
        reach = cpu_lane_reach(plan)
        # Each subgroup's parameter ids (those holding data on this rank), for every subgroup the lane may get, and
        # those finalised so far this backward, for the lane's subgroups this step.
        self._pids = {i: grads.param_ids(i) for i in reach}
        self._seen: dict[int, set] = {}
        threads = schedule.cpu_threads or torch.get_num_threads()
        ring = half_ring_count(len(reach), max(host.numel(i) for i in reach))
        speculative = speculative_set(plan, schedule)
        self.worker = BackwardOverlap(plan.cpu_order, self.subgroup_io, self._scalars, queues.device, pins.pin,
                                      schedule.backward_cpu_threads or max(1, threads - 1), threads, ring,
                                      speculative=speculative, partial_norm_cutoff=seams.partial_norm_cutoff,
                                      wrap_update=seams.wrap_update)
        # every shadow at start-up (host memory is checked for them all: footprint.check_host_fits), not at a
        # subgroup's first update: one adaptive_swing moves here mid-run would otherwise pay for 12 bytes per element
        # of fresh pinned memory inside that step
        self.worker.reserve(sorted(speculative))
        self._stats = {"steps": 0, "speculative": 0, "redone": 0, "committed": 0, "in_step": 0}
        self._ready_signal = self._with_partial_norm if norms.tracks_partial else self._gradient_event

    def _scalars(self) -> dict:
        self._adam.sync_beta_powers()
        return self._adam.scalars(frozenset(self._plan.cpu_order))

    def subgroup_io(self, i: int) -> SubgroupIO:
        """What the worker needs of subgroup i, read fresh each step (checkpoint loads replace it)."""
        live = self._host.live(i)
        return SubgroupIO(live.p, self._grads.host_grad(i), live.m, live.v, self._host.half(i))

    def in_backward(self, plan: Plan) -> frozenset:
        return frozenset(plan.cpu_order)

    def set_plan(self, plan: Plan) -> None:
        self._plan = plan
        self._seen = {i: set() for i in plan.cpu_order}
        self.worker.subgroups = list(plan.cpu_order)

    def grad_final(self, i: int, pid: int) -> None:
        """Hand subgroup i to the worker once its last parameter's gradient has been copied out."""
        seen = self._seen[i]
        seen.add(pid)
        if len(seen) != len(self._pids[i]):
            return
        ov, opt = self.worker, self._opt
        if not ov.active:
            ov.open(ov.spec_factor(float(opt.loss_scale)), float(opt.loss_scale), float(opt.clip_grad))
        host, event = self._ready_signal(i)
        ov.ready(i, event, host)

    def _with_partial_norm(self, i: int) -> tuple:
        """(host copy of the running partial norm, event after which it and the gradient copies are done)."""
        return self._norms.add_partial(self._pids[i])

    def _gradient_event(self, i: int) -> tuple:
        """No partial norm, and the mark the worker waits for before reading the gradient copies."""
        return None, self._queues.record_current()

    def before_gpu(self) -> None:
        self.worker.prepare()  # this step's CPU Adam constants, before the GPU lane advances step counts

    def _may_commit(self, inv32: Optional[float]) -> bool:
        """Whether the speculative updates used this step's real factor (``inv32`` None: skipped step)."""
        return inv32 is not None and inv32 == self.worker.spec_inv

    def start(self, inv32: float) -> None:
        self.worker.submit(inv32, self._may_commit(inv32))

    def finish(self, inv, inv32: Optional[float], trace: list) -> None:
        """Hand the worker the real factor (its fp32 value; None: the step is skipped), wait for the lane, then swap
        the committed subgroups' shadow buffers in and count the Adam step of those it updated in place."""
        ov = self.worker
        out: StepOutcome = ov.finish(inv32, self._may_commit(inv32))
        for i in out.committed:
            ov.set_shadow(i, self._host.commit(i, ov.shadow(i)))
        for i in out.in_place:
            self._host.advance(i)  # as DeepSpeedCPUAdam.step counts it (commit does for the others)
        st = self._stats
        st["steps"] += 1
        st["speculative"] += out.speculative
        st["redone"] += out.redone
        st["committed"] += len(out.committed)
        st["in_step"] += len(out.in_place)
        trace += out.spans
        for seen in self._seen.values():
            seen.clear()
        self._norms.reset_partial()

    def skip(self) -> None:
        self.finish(None, None, [])

    @property
    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        self.worker.close()
