"""adaptive_swing's decision (dostune.optim.balance) on made-up lane times, and the plans it moves between."""
from dataclasses import astuple

import pytest

from dostune.errors import ConfigError
from dostune.optim.balance import LaneBalance, LaneTimes
from dostune.optim.schedule import CPU, GPU, ScheduleConfig, make_plan, swing_candidates

# a fast host (the H100 timeline of rounds-clip0-f): the CPU lane done during backward, the GPU lane 80 ms
FAST = LaneTimes(cpu_end=-0.008, gpu_end=0.080, cpu_sub=0.015, gpu_sub=0.009)
# a slow host (rounds-clip0-c): the CPU lane ends last
SLOW = LaneTimes(cpu_end=0.110, gpu_end=0.090, cpu_sub=0.018, gpu_sub=0.009)


def feed(b: LaneBalance, times, n: int) -> list[int]:
    return [b.observe(times) for _ in range(n)]


def host(cpu_end0: float, gpu_end0: float, cpu_sub: float = 0.015, gpu_sub: float = 0.009):
    """Lane times as a function of the swing: each subgroup moved over lengthens the CPU lane (from the step's
    start at the earliest) by cpu_sub and shortens the GPU lane by gpu_sub."""
    def at(swing: int) -> LaneTimes:
        cpu_end = cpu_end0 + swing * cpu_sub if cpu_end0 > 0 or swing == 0 else swing * cpu_sub
        return LaneTimes(cpu_end=cpu_end, gpu_end=gpu_end0 - swing * gpu_sub, cpu_sub=cpu_sub, gpu_sub=gpu_sub)
    return at


def run(b: LaneBalance, at, n: int) -> list[int]:
    return [b.observe(at(b.swing)) for _ in range(n)]


def test_moves_subgroups_to_the_cpu_lane_while_the_gpu_lane_ends_last_and_back_when_the_cpu_lane_does():
    b = LaneBalance(max_swing=4, window=3)
    assert feed(b, FAST, 3) == [0, 0, 3]  # waits for a full window, then makes every move the rule allows at once:
    # 0.015k < 0.080 - 0.009k for k = 1, 2, 3 (0.045 < 0.053) but not 4 (0.060 > 0.044)
    assert feed(b, FAST, 3) == [3, 3, 4]  # a full window again after every move; never beyond max_swing
    assert feed(b, SLOW, 3) == [4, 4, 3]  # back: 0.090 + 0.009 < 0.110, but not 0.099 + 0.009 < 0.110 - 0.018
    assert feed(b, SLOW, 12)[-1] == 0
    assert feed(b, SLOW, 3) == [0, 0, 0]  # never below 0


def test_settles_where_the_rule_stops_in_one_move_and_stays_there():
    # The bench-swing9-zo timeline: with 3 moved over the CPU lane ended 45 ms and the GPU lane 97 ms into the
    # step, at 15 and 12 ms a subgroup: at 4 the CPU lane would end at 60 and the GPU lane at 85 ms; at 5 the CPU
    # lane would end last (75 vs 73 ms), so the rule stops at 4, and gets there in one move from 0.
    at = host(cpu_end0=-0.010, gpu_end0=0.133, cpu_sub=0.015, gpu_sub=0.012)
    b = LaneBalance(max_swing=9, window=3)
    assert run(b, at, 12) == [0, 0, 4] + [4] * 9
    # a host that turns slow (with 4 moved the CPU lane now ends at 220 ms, the GPU lane at 37) moves back in one
    # decision too, once the slow steps are the window's median
    slow = host(cpu_end0=0.140, gpu_end0=0.085, cpu_sub=0.020, gpu_sub=0.012)
    assert run(b, slow, 3) == [4, 0, 0]


def test_never_beyond_max_swing_and_unmeasured_steps_change_nothing():
    b = LaneBalance(max_swing=1, window=1)
    assert feed(b, FAST, 5) == [1, 1, 1, 1, 1]
    assert b.observe(None) == 1
    assert LaneBalance(max_swing=0, window=1).observe(FAST) == 0


def test_holds_when_neither_move_is_predicted_to_end_the_step_sooner():
    # moving one more to the CPU lane: 0.060 + 0.015 = 0.075 is not < 0.080 - 0.009; back: 0.080 + 0.009 > 0.060
    even = LaneTimes(cpu_end=0.060, gpu_end=0.080, cpu_sub=0.015, gpu_sub=0.009)
    b = LaneBalance(max_swing=3, window=1)
    b.swing = 1
    assert feed(b, even, 5) == [1] * 5


def test_decides_on_the_median_so_one_outlier_does_not_move_the_boundary():
    b = LaneBalance(max_swing=3, window=3)
    outlier = LaneTimes(cpu_end=-0.05, gpu_end=0.5, cpu_sub=0.01, gpu_sub=0.01)
    even = LaneTimes(cpu_end=0.060, gpu_end=0.080, cpu_sub=0.015, gpu_sub=0.009)
    assert feed(b, even, 2) + [b.observe(outlier)] == [0, 0, 0]


def test_swing_takes_the_highest_streamed_gpu_subgroups_never_resident_ones():
    sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", resident_subgroups=1, adaptive_swing=5)
    assert swing_candidates(5, sched) == [2, 1]  # subgroup 0 is resident
    plan = make_plan(5, sched, swing=1)
    assert plan.lanes == [GPU, GPU, CPU, CPU, CPU] and plan.cpu_order == [2, 3, 4]
    assert plan.resident == (0,) and [s.subgroup for s in plan.gpu_slots] == [1]
    assert make_plan(5, sched, swing=2).gpu_subgroups == [0]
    assert make_plan(5, sched) == make_plan(5, ScheduleConfig(gpu_fraction=0.6, gpu_placement="first",
                                                                resident_subgroups=1))
    assert swing_candidates(5, ScheduleConfig(gpu_fraction=0.6)) == []


def test_lane_times_from_spans_carry_each_lanes_cost_across_steps():
    from dostune.optim.balance import lane_times

    cost = {}
    # all of the CPU lane's work during backward (negative times): its cost is what it took there, for now
    t = lane_times([(-0.05, -0.04), (-0.03, -0.018)], gpu_end=0.08, streamed=8, cost=cost)
    assert astuple(t) == pytest.approx((-0.018, 0.08, 0.011, 0.01))  # cpu_end, gpu_end, cpu_sub, gpu_sub
    # a subgroup in the step replaces that; a step without streamed subgroups keeps the GPU lane's last cost
    t = lane_times([(-0.03, -0.02), (0.0, 0.02)], gpu_end=0.002, streamed=0, cost=cost)
    assert astuple(t) == pytest.approx((0.02, 0.002, 0.02, 0.01))
    assert lane_times([(-0.03, -0.02)], gpu_end=0.05, streamed=2, cost=cost).cpu_sub == 0.02
    assert lane_times([], gpu_end=0.05, streamed=2, cost={}) is None  # no CPU-lane cost known yet
