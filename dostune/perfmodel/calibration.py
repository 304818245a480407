"""The performance model calibrated to the model profile's reference run (profile/reference.py): dostune itself, one
fixed schedule, on the model being profiled.

The probes measure the parts of an interleaved iteration apart, and two of the parts are not what training runs:
dostune's backward does more host work than the probes' backward (it records each gradient's norm and hands finished
subgroups to the CPU lane), and the probes' CPU-lane kernel reads a scratch subgroup that sits in the cache, where
training's subgroups come from memory. Two coefficients, measured by the reference run, stand for them:

- ``backward``: dostune's backward compute over the probes' (``BackwardInputs.dostune_scale``);
- ``lane``: the CPU lane of ``overlap_backward`` in training over the probes' lane, in backward and in the step alike
  (``StepShape.lane_backward_slowdown`` and ``lane_step_slowdown`` both scaled by it).

Each is solved so that the model's prediction of the reference schedule meets its measured phase: ``backward`` its
backward, ``lane`` its step. They move each other's phase (a longer backward hides more of the lane's work, a slower
lane slows backward), so they are solved in turn until both settle, each by bisection within ``BOUNDS``. A step that
the lane does not set (the GPU lane's copies do) says nothing of the lane: ``lane`` then stays 1.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from .coefficients import Coefficients

BOUNDS = (1 / 3, 3.0)  # no coefficient is taken beyond these: a reference that needs more is noted, not followed
TURNS = 6  # the two coefficients solved in turn, until both move by less than 0.1%
BISECTIONS = 16  # 2.2 / 2**16 in log x: far finer than any measurement
# the step must move by this share of itself between the lane's bounds for the step to say anything of the lane
LANE_SENSITIVITY = 0.05


@dataclass(frozen=True)
class Calibration:
    backward: float = 1.0
    lane: float = 1.0
    note: str = ""


def calibrated(coeffs: Coefficients, backward: float, lane: float) -> Coefficients:
    """``coeffs`` with dostune's backward compute ``backward`` times the probes' and the overlap lane ``lane`` times."""
    shape = dataclasses.replace(coeffs.shape, lane_backward_slowdown=coeffs.shape.lane_backward_slowdown * lane,
                                lane_step_slowdown=coeffs.shape.lane_step_slowdown * lane)
    b = coeffs.backward
    if b is not None:
        b = dataclasses.replace(b, dostune_scale=b.dostune_scale * backward)
    return dataclasses.replace(coeffs, shape=shape, backward=b)


def _solve(f: Callable[[float], float], target: float) -> float:
    """The x in BOUNDS where the increasing ``f`` meets ``target`` (bisection on log x); a bound where it never does."""
    lo, hi = BOUNDS
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    a, b = math.log(lo), math.log(hi)
    for _ in range(BISECTIONS):
        m = (a + b) / 2
        if f(math.exp(m)) < target:
            a = m
        else:
            b = m
    # f may jump (a slower lane leaves one more subgroup to the step): the side nearer the target
    return min((math.exp(a), math.exp(b)), key=lambda x: abs(f(x) - target))


def calibrate(coeffs: Coefficients, predict_reference: Callable[[Coefficients], "object"], measured_bwd_s: float,
              measured_step_s: float, describe: str) -> Calibration:
    """The two coefficients that make ``predict_reference`` (the model's Prediction of the reference schedule under
    given coefficients) meet the reference's measured backward and step; ``describe``: the reference, for the note."""
    if coeffs.backward is None:
        return Calibration(note="the reference run is not used: the model profile has no backward to calibrate")

    def phases(backward: float, lane: float) -> tuple[float, float]:
        p = predict_reference(calibrated(coeffs, backward, lane))
        return p.bwd_s, p.step_s

    lo, hi = BOUNDS
    step_lo, step_hi = phases(1.0, lo)[1], phases(1.0, hi)[1]
    lane_counts = step_hi - step_lo >= LANE_SENSITIVITY * measured_step_s
    backward, lane = 1.0, 1.0
    for _ in range(TURNS):
        before = (backward, lane)
        backward = _solve(lambda x: phases(x, lane)[0], measured_bwd_s)
        if lane_counts:
            lane = _solve(lambda x: phases(backward, x)[1], measured_step_s)
        if max(abs(math.log(x / y)) for x, y in zip((backward, lane), before)) < 1e-3:
            break
    bwd_s, step_s = phases(backward, lane)
    at_bound = [name for name, x in (("backward", backward), ("CPU lane", lane)) if x in BOUNDS]
    note = (f"calibrated to the model profile's reference run of dostune ({describe}): its backward "
            f"{measured_bwd_s:.3f} s and step {measured_step_s:.3f} s took dostune's backward compute at "
            f"{backward:.2f}x the probes' and its CPU lane at {lane:.2f}x the lane probe's time")
    if not lane_counts:
        note += " (the CPU lane did not set the reference's step, so it stays at the probe's)"
    if at_bound:
        note += (f"; the {' and '.join(at_bound)} stopped at the bound {lo:.2f}-{hi:.0f}x, where the model predicts "
                 f"the reference's backward {bwd_s:.3f} s and step {step_s:.3f} s")
    return Calibration(backward=backward, lane=lane, note=note)
