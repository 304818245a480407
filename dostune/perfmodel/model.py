"""The analytic performance model of a schedule's iteration (equations in docs/performance-model.md).

``predict`` puts the optimizer step, simulated as the optimizer runs it (step.py), beside dostune's own backward
(backward.py), with the CPU lane of ``overlap_backward`` under it where its speculation succeeds (the ``no_clip``
regime), or in the step where clipping stops it (``clip``, lanes.py), and the schedule's memory (memory.py). Beside
it: the closed-form GPU-lane share the search starts from (``best_gpu_fraction``), and the number of GPU-lane
subgroups nearest a share of the elements (``gpu_count_for_share``). Every coefficient comes from the profiles
(coefficients.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..optim.footprint import GRAD_BYTES, STATE_BYTES
from ..optim.balance import LaneTimes, settled_swing
from ..optim.schedule import GPU, Plan, ScheduleConfig, assign_lanes, gpu_fraction_for, make_plan, updates_in_backward
from .backward import BackwardPrediction, dostune_backward, dostune_grad_bytes
from .coefficients import Coefficients
from .inputs import ModelInputs, NodeInputs
from .lanes import Regime
from .memory import MemoryPrediction, predict_memory
from .step import StepPrediction, lane_busy_in_backward, simulate_step, simulated_lane_times

# How often backward and the CPU lane under it are worked out against each other (backward.py): the lane's time in
# backward lengthens backward, which gives the lane more of it; the backward lengths settle within 1e-4 s in 3-4.
BACKWARD_PASSES = 6


def best_gpu_fraction(total: int, inp: NodeInputs, threads: int, grads_on_gpu: bool = True,
                      upload: str = "gpu_convert", iterations: int = 3) -> float:
    """Closed form (docs/performance-model.md): the share f of elements for the GPU lane that balances the
    CPU lane against the busier PCIe direction in steady state.

        CPU:  (1 - f) N c k          c = seconds per element of unscale + CPU Adam (+ CPU convert)
                                     k = contention slowdown under the DMA traffic the step itself makes
        H2D:  N (f b_in + (1 - f) b_up) / B_h2d     b_in = 12 (+4 without kept gradients), b_up = 4 (or 2)
        D2H:  N f 12 / B_d2h

    The step is the largest of the three; CPU falls and the copies rise with f, so the best f is where the
    CPU line meets the higher copy line: f = min((c k - b_up/B_h2d) / (c k + (b_in - b_up)/B_h2d),
    c k / (c k + 12/B_d2h)). k depends on the traffic, i.e. on f: k = 1 + (K - 1) min(1, traffic / K_traffic)
    with the profiled slowdown K at K_traffic GB/s; starting from k = K, a few substitutions converge.
    """
    c = inp.cpu_lane_seconds(total, threads, upload) / total
    b_in = STATE_BYTES + (0 if grads_on_gpu else GRAD_BYTES)
    b_up = 4 if upload == "gpu_convert" else 2
    h2d, d2h = inp.h2d_duplex.rate * inp.h2d_under_cpu, inp.d2h_duplex.rate  # the CPU lane computes throughout
    k = inp.contention
    f = 0.0
    for _ in range(max(1, iterations)):
        ck = c * k
        f_h2d = (ck - b_up / h2d) / (ck + (b_in - b_up) / h2d)
        f_d2h = ck / (ck + STATE_BYTES / d2h)
        f = min(1.0, max(0.0, min(f_h2d, f_d2h)))
        step = max((1 - f) * ck, (f * b_in + (1 - f) * b_up) / h2d, f * STATE_BYTES / d2h)  # seconds per element
        traffic_gbps = (f * b_in + (1 - f) * b_up + f * STATE_BYTES) / step / 1e9
        k = 1.0 + (inp.contention - 1.0) * min(1.0, traffic_gbps / inp.contention_gbps)
    return f


@dataclass
class Prediction:
    schedule: ScheduleConfig
    plan: Plan  # the optimizer's plan of the schedule, which the prediction simulates (the lane balance's, in clip)
    sub_group_size: int
    sizes: list[int]
    step: StepPrediction
    memory: MemoryPrediction  # of the schedule's own plan (the allowance the optimizer keeps over every swing)
    fwd_s: Optional[float]
    backward: Optional[BackwardPrediction]  # None without a model profile
    regime: Regime = "no_clip"
    swing: int = 0  # the lane balance's swing the prediction settled on (make_plan's; in clip)

    @property
    def bwd_s(self) -> Optional[float]:
        return self.backward.bwd_s if self.backward is not None else None

    @property
    def step_s(self) -> float:
        return self.step.step_s

    @property
    def iter_s(self) -> Optional[float]:
        if self.fwd_s is None or self.bwd_s is None:
            return None
        return self.fwd_s + self.bwd_s + self.step_s

    @property
    def objective_s(self) -> float:
        return self.iter_s if self.iter_s is not None else self.step_s

    @property
    def update_gelem_s(self) -> float:
        return sum(self.sizes) / self.step_s / 1e9


def predict(sizes: Sequence[int], sub_group_size: int, sched: ScheduleConfig, coeffs: Coefficients, m: ModelInputs,
            grad_alloc: Optional[Sequence[float]] = None, grad_ready: Optional[Sequence[float]] = None,
            regime: Regime = "no_clip") -> Prediction:
    """The schedule's iteration in ``regime`` (lanes.py): dostune's backward (backward.py) and the step simulated with
    the CPU lane under that backward, worked out against each other (``BACKWARD_PASSES``).

    In ``clip`` the CPU lane works in the step alone, so backward runs without it beside, and with adaptive_swing the
    lanes are those the lane balance settles on: its own rule (optim/balance.settled_swing), applied to the simulated
    lane ends step after step from the tuned split, within the schedule's swing range both ways."""
    plan = make_plan(len(sizes), sched)
    node = coeffs.node
    b = coeffs.backward
    lane_in_backward = sched.overlap_backward and grad_ready is not None and regime == "no_clip"

    def iteration(plan: Plan) -> tuple[Optional[BackwardPrediction], StepPrediction]:
        grad_bytes = None  # backward's gradient copies, as traffic beside the CPU lane where its rate leaves them out
        if b is not None and not coeffs.shape.lane_backward_with_copies:
            grad_bytes = dostune_grad_bytes(sizes, plan, sched, b.grad_bytes, b.fp16)

        def step_with(bwd_s: Optional[float]) -> StepPrediction:
            return simulate_step(sizes, sched, node, coeffs.overhead_s, backward_s=bwd_s, ready_fraction=grad_ready,
                                 plan=plan, shape=coeffs.shape, grad_bytes=grad_bytes, regime=regime)

        if b is None:
            return None, step_with(m.bwd_s)
        backward = dostune_backward(b, node, sizes, plan, sched)
        step = step_with(backward.bwd_s)
        for _ in range(BACKWARD_PASSES if lane_in_backward else 0):
            busy = lane_busy_in_backward(step, backward.bwd_s)
            nxt = dostune_backward(b, node, sizes, plan, sched, busy)
            settled = abs(nxt.bwd_s - backward.bwd_s) < 1e-4
            backward = nxt
            step = step_with(backward.bwd_s)
            if settled:
                break
        return backward, step

    memory = predict_memory(sizes, sched, m, grad_alloc, plan)
    backward, step = iteration(plan)
    swing = 0
    if regime == "clip" and sched.adaptive_swing and updates_in_backward(plan, sched):
        runs, cost = {0: (plan, backward, step)}, {}

        def times_at(k: int) -> Optional[LaneTimes]:
            if k not in runs:
                at = make_plan(len(sizes), sched, swing=k)
                runs[k] = (at, *iteration(at))
            at, _, st = runs[k]
            return simulated_lane_times(st, at, cost)

        swing = settled_swing(times_at, len(plan.swing_candidates), len(plan.lend_candidates))
        times_at(swing)  # the settled split's own run (the cap can end the search on a split not yet simulated)
        plan, backward, step = runs[swing]
    return Prediction(schedule=sched, plan=plan, sub_group_size=sub_group_size, sizes=list(sizes), step=step,
                      memory=memory, fwd_s=m.fwd_s, backward=backward, regime=regime, swing=swing)


def gpu_count_for_share(sizes: Sequence[int], share: float, placement: str = "first") -> int:
    """The number of GPU-lane subgroups whose elements come closest to ``share`` of all elements (subgroups
    differ in size, e.g. the embedding's), for a placement."""
    total = sum(sizes)
    n = len(sizes)

    def elem_share(k: int) -> float:
        lanes = assign_lanes(n, gpu_fraction_for(k, n), placement)
        return sum(s for s, lane in zip(sizes, lanes) if lane == GPU) / total

    return min(range(n + 1), key=lambda k: abs(elem_share(k) - share))
