"""The CPU lane's rates as training ran them: the model's lane rates scaled to the model profile's lane reference.

The lane reference (profile/lane_reference.py) is dostune run on the model with one fixed schedule, its CPU lane
traced. The model predicts that schedule with the probes' rates; its lane's time per element in backward and in the
step, set beside the traced ones, gives two factors, and every schedule the tuner scores takes the lane's rates in
backward and in the step that many times the probes'. The step is then timed as the traces show
(``StepShape.traced_timing``, model.py).

Why: per shape the model's lane in backward, from the probes, ran 0.90x the traced time per element (median over 54
held-out shapes), with a spread of 17%, and the step the lane leaves after backward moves with it. Offline, the
lane's rates from another process of the same shape (a validated row of another schedule) and the traced timing put
dostune within both bounds on 33-37 of 60 held-out shapes, against 31 with the probes' rates and timing
(docs/experiments.md, section 40).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable, Iterable, Optional, Sequence

from ..profile.model_record import LaneReference
from .coefficients import Coefficients
from .model import Prediction

# Subgroups smaller than this (a model's last, part-filled one) are left out of the rates: their fixed costs, not
# their elements, set their time.
MIN_ELEMENTS = 1_000_000


def lane_s_per_element(spans: Iterable[tuple[int, float, float]], sizes: Sequence[int], boundary: float,
                       in_backward: bool) -> Optional[float]:
    """The median seconds per element of the CPU lane's (subgroup, start, end) spans that ended before ``boundary``
    (in backward) or started at or after it (in the step); None if there are none."""
    xs = [(end - start) / sizes[i] for i, start, end in spans
          if 0 <= i < len(sizes) and sizes[i] >= MIN_ELEMENTS and (end < boundary if in_backward else start >= boundary)]
    return statistics.median(xs) if xs else None


def with_lane_reference(coeffs: Coefficients, ref: LaneReference,
                        predict_reference: Callable[[Coefficients], Prediction]) -> Coefficients:
    """``coeffs`` with the CPU lane's rates scaled to the lane reference's and the traced timing.
    ``predict_reference``: the model's prediction of the reference's schedule with the given coefficients."""
    traced = [(s.subgroup, s.start, s.end) for trace in ref.traces for s in trace if s.lane == "cpu"]
    p = predict_reference(replace(coeffs, shape=replace(coeffs.shape, traced_timing=True)))
    modelled = [(x.subgroup, x.start, x.end) for x in p.step.spans if x.lane == "cpu"]
    # traced times are from the step's start, which in the traced timing is where the model's backward ends
    tb, ts = (lane_s_per_element(traced, p.sizes, 0.0, b) for b in (True, False))
    pb, ps = (lane_s_per_element(modelled, p.sizes, p.step.backward_end_s, b) for b in (True, False))
    fb = tb / pb if tb and pb else None
    fs = ts / ps if ts and ps else None
    fb, fs = fb or fs, fs or fb  # the lane ran in one phase only: its rate there stands for both
    if fb is None:
        return replace(coeffs, notes=coeffs.notes + (
            "the model profile's lane reference traced no CPU-lane update the model also places (subgroups of at "
            f"least {MIN_ELEMENTS / 1e6:g}M elements): the model takes the lane's rates from the probes",))
    # One pass. Scaled, the lane's updates move between backward and the step and against the copies that slow them,
    # so the reference predicted again does not run at exactly the traced rates; passes until it did lost offline
    # (32-34 of 60 shapes within both bounds against 34-37; docs/experiments.md, section 40).
    shape = replace(coeffs.shape, traced_timing=True, lane_backward_slowdown=coeffs.shape.lane_backward_slowdown * fb,
                    lane_step_slowdown=coeffs.shape.lane_step_slowdown * fs)

    def ns(x: Optional[float]) -> str:
        return f"{x * 1e9:.3f}" if x else "-"

    note = (f"the CPU lane's rates from the model profile's lane reference: {ns(tb)} ns per element in backward and "
            f"{ns(ts)} in the step, where the probes give {ns(pb)} and {ns(ps)}; the model's lane takes {fb:.2f}x and "
            f"{fs:.2f}x the probes' time")
    return replace(coeffs, shape=shape, notes=coeffs.notes + (note,))
