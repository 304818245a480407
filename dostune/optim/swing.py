"""``adaptive_swing`` at run time: measures each step's lane ends and asks balance.py's decision for the next step's
swing (k > 0: k of the GPU lane's streamed subgroups on the CPU lane; k < 0: -k of the CPU lane's subgroups on the
GPU lane). ``FixedSplit`` stands in when the schedule has no swing, so the step calls the same three methods either
way.

The lane ends are measured with the device's timing events (CUDA); a CPU device measures none, and the split stays
as tuned. ``wrap_lane_times`` (cpu_lane.CpuLaneSeams) is given the measurement once and returns the function the
split calls instead: a test scripts which lane ends last with it, or watches what the device measured."""
from __future__ import annotations

from typing import Callable, Optional

from .balance import LaneBalance, LaneTimes, lane_times
from .queues import Queues
from .schedule import Plan

# (the step's trace, the plan it ran) -> its lane ends, or None where they cannot be measured
LaneTimesFn = Callable[[list, Plan], Optional[LaneTimes]]


class FixedSplit:
    def __init__(self):
        self.swing = 0
        self.steps_by_swing: dict[int, int] = {}

    def start(self) -> None:
        pass

    def gpu_queued(self) -> None:
        pass

    def decide(self, trace: Optional[list], plan: Plan) -> Optional[int]:
        return None


class AdaptiveSplit:
    """``plan``: the schedule's (its swing range bounds the decision); ``wrap_lane_times``: the test seam above
    (None: the device's measurement)."""

    def __init__(self, plan: Plan, queues: Queues,
                 wrap_lane_times: Optional[Callable[[LaneTimesFn], LaneTimesFn]] = None):
        self._q = queues
        self.balance = LaneBalance(to_cpu=len(plan.swing_candidates), to_gpu=len(plan.lend_candidates))
        self.swing = 0  # the swing the next step runs
        self.steps_by_swing: dict[int, int] = {}
        # the last cost of one subgroup seen in each lane's step (what one more costs a lane that ran none this step)
        self._cost: dict = {}
        self._origin: Optional[tuple] = None
        self._gpu_ends: list = []
        self._lane_times = self._measured if wrap_lane_times is None else wrap_lane_times(self._measured)

    def start(self) -> None:
        """Called once the gradient norm has been copied to the host: the GPU has caught up, so an event recorded
        now runs at about this host time, and the lanes' ends are measured from it (None on a CPU device: not
        measured)."""
        self._origin = self._q.device.start_clock()

    def gpu_queued(self) -> None:
        self._gpu_ends = [self._q.record(lane, timing=True) for lane in ("compute", "d2h")] \
            if self._origin is not None else []

    def _measured(self, trace: list, plan: Plan) -> Optional[LaneTimes]:
        """This step's lane ends (None where they cannot be measured: a CPU device, or no cost of one more subgroup
        known yet for a lane)."""
        if self._origin is None:
            return None
        ev0, t0 = self._origin
        # elapsed_time needs both events complete: join() waits for the copies back on the host, the compute lane (and
        # the origin's stream) only on the GPU
        for e in [ev0] + self._gpu_ends:
            e.synchronize()
        gpu_end = max(ev0.elapsed_time(e) for e in self._gpu_ends) / 1e3
        spans = [(a - t0, b - t0) for lane, _, a, b in trace if lane == "cpu"]
        return lane_times(spans, gpu_end, len(plan.gpu_slots), self._cost)

    def decide(self, trace: Optional[list], plan: Plan) -> Optional[int]:
        """After the step: the swing for the next step if it changes, else None. ``plan``: the one the step ran;
        ``trace`` None: a step not to measure."""
        self.steps_by_swing[self.swing] = self.steps_by_swing.get(self.swing, 0) + 1
        swing = self.balance.observe(None if trace is None else self._lane_times(trace, plan))
        if swing == self.swing:
            return None
        self.swing = swing
        return swing
