"""What one step of the interleaved optimizer did when: the lanes' per-subgroup spans (``trace``) and the host time
of the step's parts (``dostune_step_phases``)."""
from __future__ import annotations

import statistics
import time
from ..records import Span
from .queues import Queues

PHASE_WINDOW = 64  # steps whose host-time phases dostune_step_phases reports


class StepClock:
    """The step's origin (a CUDA event queued on the compute lane when tracing, and the host time) and its host-time
    marks. Why the phases: on a slow H100 host the step took 170 ms while its lanes ended ~107 ms after they
    started, so the host's own work between and around the lanes had to be seen."""

    def __init__(self, queues: Queues, trace: bool):
        self._queues, self._trace = queues, trace
        self.origin: tuple = (None, time.perf_counter())
        self._marks: dict[str, float] = {}
        self.phases: list[dict[str, float]] = []  # the last PHASE_WINDOW finished steps, in seconds
        self.last_trace: list[Span] = []

    def start(self) -> None:
        q = self._queues
        # on a CPU device every span is a host time and the first item goes unused
        self.origin = (q.record("compute", timing=True) if self._trace else None, time.perf_counter())

    def mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def close(self, t_update: float) -> None:
        """File this step's marks as phases: before the lanes (from the step's start to ``t_update``), queueing and
        the host's own work beside them (to "queued"), waiting for them (to "joined"), and after them."""
        m, t_end = self._marks, time.perf_counter()
        self.phases.append({
            "before_lanes": t_update - self.origin[1],
            "queue_and_host_work": m.get("queued", t_update) - t_update,
            "wait_for_lanes": m.get("joined", t_end) - m.get("queued", t_update),
            "after_lanes": t_end - m.get("joined", t_end),
        })
        del self.phases[:-PHASE_WINDOW]
        self._marks = {}

    def median_phases_ms(self) -> dict[str, float]:
        if not self.phases:
            return {}
        return {k: round(1e3 * statistics.median(r[k] for r in self.phases), 1) for k in self.phases[0]}

    def record(self, raw: list) -> None:
        """Keep this step's spans (lane, subgroup, start, end) if tracing, in seconds from the step's origin."""
        if not self._trace:
            return
        start_ev, t_host0 = self.origin
        spans = []
        # Host timestamps (the CPU lane; every lane on a CPU device) are relative to the host clock at the step's
        # start, CUDA events to an event queued at that moment on an idle stream.
        for lane, i, a, b in raw:
            if isinstance(a, float):
                spans.append(Span(lane=lane, subgroup=i, start=a - t_host0, end=b - t_host0))
            elif start_ev is not None:
                # the host reaches here once the copies back are done, but the GPU lane's last kernels (a resident
                # subgroup's update) may still run: elapsed_time needs both events complete
                b.synchronize()
                spans.append(Span(lane=lane, subgroup=i, start=start_ev.elapsed_time(a) / 1e3,
                                  end=start_ev.elapsed_time(b) / 1e3))
        self.last_trace = sorted(spans, key=lambda s: s.start)
