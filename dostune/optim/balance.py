"""Moving the lane boundary between steps (``adaptive_swing``): pure decision logic, no torch.

Why: which lane ends the step depends on how fast the host runs that minute. On H100 VMs (16 vCPUs) the same
schedule had the CPU lane finish all its subgroups during backward and the step wait for the GPU lane's copies
alone (a fast host), and minutes later the CPU lane still working when the GPU lane was done (a slow one). A tuned
static split is right for one of them. Each subgroup updates to the same values in either lane, so the split may change from step to step; this
moves the GPU lane's streamed subgroups nearest the CPU lane over while that is predicted to end the step
sooner, and back when the CPU lane ends last.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LaneTimes:
    """One step's lanes, in seconds from the moment the step starts its lanes (negative: during backward)."""

    cpu_end: float  # the CPU lane's last update ended (during backward if all of its work ran there)
    gpu_end: float  # the GPU lane's last copy or kernel ended
    cpu_sub: float  # what one more subgroup costs the CPU lane in the step
    gpu_sub: float  # what one streamed subgroup costs the GPU lane


class LaneBalance:
    """How many of the GPU lane's streamed subgroups (0..max_swing) the CPU lane takes in the next step.

    Decides on the medians of ``window`` steps measured since the last move, so that one noisy step does not
    move the boundary. One more subgroup on the CPU lane starts when that lane is free (at the earliest when
    the step starts: its gradients are final only at the end of backward, being nearest the GPU lane's); it is
    moved over when ``max(cpu_end, 0) + cpu_sub < gpu_end - gpu_sub``: the CPU lane would still end before the
    shortened GPU lane, so the step ends ``gpu_sub`` sooner (moving one that would make the CPU lane the last to
    end could gain less than that, and a noisy measurement could then move it back). One is moved back when
    ``gpu_end + gpu_sub < cpu_end``: the GPU lane could take it and still end before the CPU lane ends now. Both
    shorten the predicted step, and neither can follow the other on the same measurements.

    A decision applies that rule again to the lane ends it predicts after each move, and makes every move the
    rule still allows at once: moving one subgroup per window takes 3 steps per subgroup, and a short run (an
    11-step bench round on the H100) ended with the swing still climbing, short of where the rule would stop."""

    def __init__(self, max_swing: int, window: int = 3):
        if max_swing < 0 or window < 1:
            raise ValueError("max_swing must be >= 0 and window >= 1")
        self.max_swing = max_swing
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
        """Subgroups to move to the CPU lane (negative: back to the GPU lane) on the medians ``m``: each move is
        made while the rule allows it on the lane ends predicted after the moves before it."""
        cpu0 = max(m.cpu_end, 0.0)
        k = 0
        while self.swing + k < self.max_swing and cpu0 + (k + 1) * m.cpu_sub < m.gpu_end - (k + 1) * m.gpu_sub:
            k += 1
        if k:
            return k
        while self.swing + k > 0 and m.gpu_end + (1 - k) * m.gpu_sub < m.cpu_end + k * m.cpu_sub:
            k -= 1
        return k


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
