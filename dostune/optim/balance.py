"""Moving the lane boundary between steps (``adaptive_swing``), either way: pure decision logic, no torch.

Why: which lane ends the step depends on how fast the host runs that minute, and on whether overlap_backward's
speculation succeeded. On H100 VMs (16 vCPUs) the same schedule had the CPU lane finish all its subgroups during
backward and the step wait for the GPU lane's copies alone (a fast host), and minutes later the CPU lane still
working when the GPU lane was done (a slow one); when gradient clipping triggers (random weights, early training,
fine-tuning) speculation stops and the CPU lane carries all its subgroups inside the step. A tuned static split is
right for one of them. Each subgroup updates to the same values in either lane, so the split may change from step
to step. The swing k is signed: k > 0 hands k of the GPU lane's streamed subgroups to the CPU lane, k < 0 hands -k
of the CPU lane's subgroups to the GPU lane; one rule decides both ways.

Which subgroups move (schedule.make_plan). To the CPU lane: the GPU lane's streamed subgroups with the highest
indices, whose gradients are final first, so the CPU lane can take them as early as its own. To the GPU lane: the
CPU lane's lowest indices, whose gradients are final last in backward. They are the CPU lane's last work in the
step: with overlap_backward the CPU lane updates its subgroups in the order backward finalises them, and those it
reached during backward cost the step nothing, so handing over the last ones is what shortens the CPU lane's end
(handing over one it finished during backward would shorten nothing); when clipping stops speculation, they are
the ones it reaches last in the step. With gpu_placement "first" they also border the GPU lane's own, so either
way the boundary between the lanes moves one subgroup at a time. A subgroup the GPU lane takes streams through its
staging slots like its own, its gradients offloaded in backward as a CPU-lane subgroup's are and streamed in with
its states: kept on the GPU they would hold 4 bytes per element from backward on, while the slots need room for
them only in the step.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class LaneTimes:
    """One step's lanes, in seconds from the moment the step starts its lanes (negative: during backward)."""

    cpu_end: float  # the CPU lane's last update ended (during backward if all of its work ran there)
    gpu_end: float  # the GPU lane's last copy or kernel ended
    cpu_sub: float  # what one more subgroup costs the CPU lane in the step
    gpu_sub: float  # what one streamed subgroup costs the GPU lane


class LaneBalance:
    """The swing for the next step, from -to_gpu (that many CPU-lane subgroups on the GPU lane) to to_cpu (that many
    of the GPU lane's streamed subgroups on the CPU lane).

    Decides on the medians of ``window`` steps measured since the last move, so that one noisy step does not
    move the boundary. One more subgroup on the CPU lane starts when that lane is free (at the earliest when the
    step starts: its gradients are final only at the end of backward); it is moved over (the swing rises by one)
    when ``max(cpu_end, 0) + cpu_sub < gpu_end - gpu_sub``: the CPU lane would still end before the shortened GPU
    lane, so the step ends ``gpu_sub`` sooner (moving one that would make the CPU lane the last to end could gain
    less than that, and a noisy measurement could then move it back). One moves the other way (the swing falls by
    one) when ``gpu_end + gpu_sub < cpu_end``: the GPU lane could take it and still end before the CPU lane ends
    now. The same two tests hold on either side of 0 (giving a subgroup back is taking one the other way); both
    shorten the predicted step, and neither can follow the other on the same measurements.

    A decision applies that rule again to the lane ends it predicts after each move, and makes every move the rule
    still allows at once: moving one subgroup per window takes 3 steps per subgroup, and a short run (an 11-step
    bench round on the H100) ended with the swing still climbing, short of where the rule would stop. So after a
    change of regime the swing settles within a few steps: the first decision once the new regime's steps are the
    window's median (2 of 3), and a correction at the next window where the first prediction was off."""

    def __init__(self, to_cpu: int, to_gpu: int = 0, window: int = 3):
        if to_cpu < 0 or to_gpu < 0 or window < 1:
            raise ValueError("to_cpu and to_gpu must be >= 0 and window >= 1")
        self.to_cpu, self.to_gpu = to_cpu, to_gpu
        self.window = window
        self.swing = 0
        self._seen: list[LaneTimes] = []

    def observe(self, times: Optional[LaneTimes]) -> int:
        """Record one step (None: not measured, e.g. a skipped step) and return the swing for the next."""
        if times is None:
            return self.swing
        self._seen.append(times)
        if len(self._seen) < self.window:
            return self.swing
        m = LaneTimes(*(statistics.median(getattr(t, f) for t in self._seen)
                        for f in ("cpu_end", "gpu_end", "cpu_sub", "gpu_sub")))
        move = self._moves(m)
        if move:
            self.swing += move
            self._seen.clear()
        else:
            self._seen.pop(0)
        return self.swing

    def _moves(self, m: LaneTimes) -> int:
        """Subgroups to move to the CPU lane (negative: to the GPU lane) on the medians ``m``: each move is made
        while the rule allows it on the lane ends predicted after the moves before it."""
        cpu0 = max(m.cpu_end, 0.0)
        k = 0
        while self.swing + k < self.to_cpu and cpu0 + (k + 1) * m.cpu_sub < m.gpu_end - (k + 1) * m.gpu_sub:
            k += 1
        if k:
            return k
        while self.swing + k > -self.to_gpu and m.gpu_end + (1 - k) * m.gpu_sub < m.cpu_end + k * m.cpu_sub:
            k -= 1
        return k


def settled_swing(times_at: Callable[[int], LaneTimes], to_cpu: int, to_gpu: int, swing: int = 0) -> int:
    """Where the rule settles from ``swing`` when the lane times at each swing k are ``times_at(k)`` (a prediction,
    e.g. the performance model's: no noise, so one decision per step): the swing at which it makes no more moves.
    Lane times that would have it move back and forth stop it after to_cpu + to_gpu + 1 decisions, wherever it is."""
    b = LaneBalance(to_cpu, to_gpu, window=1)
    b.swing = swing
    for _ in range(to_cpu + to_gpu + 1):
        before = b.swing
        if b.observe(times_at(before)) == before:
            break
    return b.swing


def lane_times(cpu_spans: list[tuple[float, float]], gpu_end: float, streamed: int,
               cost: dict) -> Optional[LaneTimes]:
    """One step's LaneTimes from the CPU lane's update spans (start, end) and the GPU lane's end, all in seconds
    from the step's origin, and ``streamed``, the number of GPU-lane subgroups that streamed their states.
    ``cost`` carries each lane's last per-subgroup cost across steps (updated here): a lane that ran no subgroup
    in this step still needs one to decide. None until both are known."""
    cpu_end = max((b for _, b in cpu_spans), default=0.0)
    in_step = [b - a for a, b in cpu_spans if a >= 0]
    if in_step:
        cost["cpu"] = statistics.median(in_step)
    elif cpu_spans and "cpu" not in cost:  # none ran in the step yet: what they took during backward
        cost["cpu"] = statistics.median(b - a for a, b in cpu_spans)
    if streamed:  # the streamed subgroups' copies set the GPU lane's length (a resident one takes ~1 ms)
        cost["gpu"] = gpu_end / streamed
    if "cpu" not in cost or "gpu" not in cost:
        return None
    return LaneTimes(cpu_end=cpu_end, gpu_end=gpu_end, cpu_sub=cost["cpu"], gpu_sub=cost["gpu"])
