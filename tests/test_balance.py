"""adaptive_swing's decision (dostune.optim.balance) on made-up lane times, the plans it moves between either way, and
the GPU memory those may allocate."""
from dataclasses import astuple
from typing import Optional

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
    b = LaneBalance(to_cpu=4, window=3)
    assert feed(b, FAST, 3) == [0, 0, 3]  # waits for a full window, then makes every move the rule allows at once:
    # 0.015k < 0.080 - 0.009k for k = 1, 2, 3 (0.045 < 0.053) but not 4 (0.060 > 0.044)
    assert feed(b, FAST, 3) == [3, 3, 4]  # a full window again after every move; never beyond to_cpu
    assert feed(b, SLOW, 3) == [4, 4, 3]  # back: 0.090 + 0.009 < 0.110, but not 0.099 + 0.009 < 0.110 - 0.018
    assert feed(b, SLOW, 12)[-1] == 0
    assert feed(b, SLOW, 3) == [0, 0, 0]  # never below 0 without CPU-lane subgroups to hand over (to_gpu 0)


def test_settles_where_the_rule_stops_in_one_move_and_stays_there():
    # The bench-swing9-zo timeline: with 3 moved over the CPU lane ended 45 ms and the GPU lane 97 ms into the
    # step, at 15 and 12 ms a subgroup: at 4 the CPU lane would end at 60 and the GPU lane at 85 ms; at 5 the CPU
    # lane would end last (75 vs 73 ms), so the rule stops at 4, and gets there in one move from 0.
    at = host(cpu_end0=-0.010, gpu_end0=0.133, cpu_sub=0.015, gpu_sub=0.012)
    b = LaneBalance(to_cpu=9, window=3)
    assert run(b, at, 12) == [0, 0, 4] + [4] * 9
    # a host that turns slow (with 4 moved the CPU lane now ends at 220 ms, the GPU lane at 37) moves back in one
    # decision too, once the slow steps are the window's median
    slow = host(cpu_end0=0.140, gpu_end0=0.085, cpu_sub=0.020, gpu_sub=0.012)
    assert run(b, slow, 3) == [4, 0, 0]


def test_never_beyond_to_cpu_and_unmeasured_steps_change_nothing():
    b = LaneBalance(to_cpu=1, window=1)
    assert feed(b, FAST, 5) == [1, 1, 1, 1, 1]
    assert b.observe(None) == 1
    assert LaneBalance(to_cpu=0, window=1).observe(FAST) == 0


def test_holds_when_neither_move_is_predicted_to_end_the_step_sooner():
    # moving one more to the CPU lane: 0.060 + 0.015 = 0.075 is not < 0.080 - 0.009; back: 0.080 + 0.009 > 0.060
    even = LaneTimes(cpu_end=0.060, gpu_end=0.080, cpu_sub=0.015, gpu_sub=0.009)
    b = LaneBalance(to_cpu=3, window=1)
    b.swing = 1
    assert feed(b, even, 5) == [1] * 5


def test_decides_on_the_median_so_one_outlier_does_not_move_the_boundary():
    b = LaneBalance(to_cpu=3, window=3)
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


def lanes(gpu_sub: float, cpu_sub: float, streamed0: int, cpu0: int, hidden_end: Optional[float] = None):
    """Lane times as a function of the swing on a host where the GPU lane streams ``streamed0`` subgroups at
    ``gpu_sub`` each and the CPU lane has ``cpu0`` at ``cpu_sub`` each. ``hidden_end`` None: the CPU lane runs all of
    its own in the step (clipping stopped speculation); else they all end during backward at ``hidden_end``, and only
    those moved over from the GPU lane run in the step."""
    def at(swing: int) -> LaneTimes:
        if hidden_end is None:
            cpu_end = (cpu0 + swing) * cpu_sub
        else:
            cpu_end = swing * cpu_sub if swing > 0 else hidden_end
        return LaneTimes(cpu_end=cpu_end, gpu_end=(streamed0 - swing) * gpu_sub, cpu_sub=cpu_sub, gpu_sub=gpu_sub)
    return at


def test_the_gpu_lane_takes_cpu_lane_subgroups_while_the_cpu_lane_ends_last_and_gives_them_back():
    # Speculation stopped (clipping): the CPU lane carries its 8 subgroups in the step (248 ms), the GPU lane
    # streams 4 (80 ms). Taking one: GPU 100 < CPU 217 ms, two: 120 < 186, three: 140 < 155; a fourth would make the
    # GPU lane end last (160 > 124), so the rule stops at -3, in one decision, and holds there.
    clipped = lanes(gpu_sub=0.020, cpu_sub=0.031, streamed0=4, cpu0=8)
    b = LaneBalance(to_cpu=4, to_gpu=8, window=3)
    assert run(b, clipped, 9) == [0, 0, -3] + [-3] * 6
    # Clipping stops (speculation succeeds): the CPU lane's own subgroups end during backward, the GPU lane with 7
    # ends last. Once those steps are the window's median the rule gives back two (each predicted to run in the step
    # once its gradients are final), then moves on a window at a time, each time on what the last move measured; it
    # settles at +1 (GPU lane 60 ms, CPU lane 31: one more to the CPU lane would end it at 62 > 40) 8 steps after
    # the change, and holds there.
    fast = lanes(gpu_sub=0.020, cpu_sub=0.031, streamed0=4, cpu0=8, hidden_end=-0.010)
    assert run(b, fast, 12) == [-3, -1, -1, -1, 0, 0, 0, 1, 1, 1, 1, 1]
    # clipping again: one decision takes it through 0 to -3 (the GPU lane takes back its own, then the CPU lane's)
    assert run(b, clipped, 3) == [1, -3, -3]


def test_never_beyond_to_gpu():
    slow = LaneTimes(cpu_end=1.0, gpu_end=0.010, cpu_sub=0.030, gpu_sub=0.010)
    b = LaneBalance(to_cpu=2, to_gpu=2, window=1)
    assert feed(b, slow, 3) == [-2, -2, -2]
    with pytest.raises(ValueError):
        LaneBalance(to_cpu=1, to_gpu=-1)


def test_the_gpu_lane_takes_the_cpu_lanes_lowest_subgroups_streamed_and_never_as_resident():
    # first placement: the boundary between the lanes moves one subgroup at a time either way
    sched = ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", adaptive_swing=2)
    base = make_plan(5, sched)
    assert base.swing_candidates == (1, 0) and base.lend_candidates == (2, 3) and base.swing_range == range(-2, 3)
    plan = make_plan(5, sched, swing=-2)
    assert plan.lanes == [GPU, GPU, GPU, GPU, CPU] and plan.cpu_order == [4] and plan.lent == (2, 3)
    assert [s.subgroup for s in plan.gpu_slots] == [0, 1, 2, 3] and [s.slot for s in plan.gpu_slots] == [0, 1, 0, 1]
    assert make_plan(5, sched, swing=-1).lent == (2,) and make_plan(5, sched, swing=2).lent == ()
    for bad in (-3, 3):
        with pytest.raises(ValueError, match="outside this schedule's range -2..2"):
            make_plan(5, sched, swing=bad)
    # with a resident subgroup (resident ones are the first: DeepSpeed keeps their state on the GPU) the lent ones
    # stream beside the GPU lane's own streamed ones; subgroup 0 stays the one resident
    kept = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", adaptive_swing=2, resident_subgroups=1)
    plan = make_plan(5, kept, swing=-2)
    assert plan.resident == (0,) and [s.subgroup for s in plan.gpu_slots] == [1, 2, 3, 4] and plan.cpu_order == []
    assert plan.gpu_subgroups == [0, 1, 2, 3, 4] and plan.lent == (3, 4)
    # a lent subgroup the GPU lane cannot get memory for falls back like its own
    fell = make_plan(5, sched, swing=-1, fallback=frozenset({0, 1, 2}))
    assert fell.fallback == (0, 1, 2) and fell.lent == () and fell.gpu_slots == [] and fell.cpu_order == [3, 4]
    # nothing to take without a streamed GPU-lane subgroup (no slots, no measured cost of one more)
    assert make_plan(5, ScheduleConfig(gpu_fraction=0.0, adaptive_swing=3)).swing_range == range(0, 1)
    assert make_plan(5, ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", resident_subgroups=2,
                                       adaptive_swing=3)).swing_range == range(0, 1)


def test_gradients_of_lent_subgroups_stream_in_and_the_rest_stay_where_they_were():
    from dostune.optim.schedule import kept_gradients, streamed_gradients

    sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", adaptive_swing=2, resident_subgroups=1)
    plan = make_plan(5, sched, swing=-2)  # 0 resident, 1 and 2 streamed, 3 and 4 lent
    assert plan.lent == (3, 4)
    # the resident subgroup's gradients are in DeepSpeed's own buffer on the GPU, kept by none of these
    assert kept_gradients(plan, True) == {1, 2} and streamed_gradients(plan, True) == {3, 4}
    assert kept_gradients(plan, False) == set() and streamed_gradients(plan, False) == {1, 2, 3, 4}


def test_the_step_staging_allowance_is_the_most_any_swing_allocates():
    from dostune.optim.footprint import GRAD_BYTES, STATE_BYTES, gpu_step_bytes, plan_step_bytes, staging_slots

    sizes = [100, 100, 100, 100, 50]
    sched = ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", adaptive_swing=2, staging_buffers=2)
    base = make_plan(5, sched)
    each = {k: plan_step_bytes(sizes, make_plan(5, sched, swing=k), sched, cpu_in_backward=False)
            for k in base.swing_range}
    # swing -1: two slots of 100 with room for the lent subgroup's gradients, subgroups 0 and 1's kept gradients,
    # the upload buffer of the CPU lane's widest (100)
    assert staging_slots(sizes, make_plan(5, sched, swing=-1), 2, True) == (2, 100, True)
    assert each[-1] == 2 * 100 * (STATE_BYTES + GRAD_BYTES) + 200 * GRAD_BYTES + 100 * 4
    assert each[0] == 2 * 100 * STATE_BYTES + 200 * GRAD_BYTES + 100 * 4
    assert each[2] == 100 * 4  # everything on the CPU lane: its upload buffer alone
    assert gpu_step_bytes(sizes, base, sched) == max(each.values()) == each[-1]
    # without a swing the allowance is the tuned split's; the CPU lane during backward has no upload buffer
    fixed = sched.model_copy(update={"adaptive_swing": 0})
    assert gpu_step_bytes(sizes, make_plan(5, fixed), fixed) == each[0]
    ov = fixed.model_copy(update={"overlap_backward": True})
    assert gpu_step_bytes(sizes, make_plan(5, ov), ov) == each[0] - 100 * 4


def test_a_swing_range_that_cannot_fit_on_the_gpu_is_refused_at_start_up():
    from types import SimpleNamespace

    from dostune.optim.footprint import check_staging_fits

    opt = SimpleNamespace(fp16_partitioned_groups_flat_numel=[10**8] * 4)
    sched = ScheduleConfig(gpu_fraction=0.5, gpu_placement="first", staging_buffers=2, upload="cpu_convert")
    fits = 2 * 10**8 * 12 + 2 * 10**8 * 4  # the tuned split: two slots, two subgroups' kept gradients
    check_staging_fits(opt, sched, capacity_bytes=fits)
    with pytest.raises(ConfigError, match="stages .* GiB on the GPU during the step") as e:
        check_staging_fits(opt, sched.model_copy(update={"adaptive_swing": 1}), capacity_bytes=fits)
    assert "adaptive_swing" in e.value.hint  # taking a CPU-lane subgroup needs room for its gradients in the slots


def test_where_the_rule_settles_on_predicted_lane_times():
    from dostune.optim.balance import settled_swing

    # the two hosts above, predicted instead of measured: clipping settles at -3, a fast host at +1
    assert settled_swing(lanes(gpu_sub=0.020, cpu_sub=0.031, streamed0=4, cpu0=8), to_cpu=4, to_gpu=8) == -3
    fast = lanes(gpu_sub=0.020, cpu_sub=0.031, streamed0=4, cpu0=8, hidden_end=-0.010)
    assert settled_swing(fast, to_cpu=4, to_gpu=8) == 1 == settled_swing(fast, to_cpu=4, to_gpu=8, swing=-3)
    assert settled_swing(fast, to_cpu=0, to_gpu=8) == 0  # nothing may move to the CPU lane
    # lane times that send it back and forth: it stops after a bounded number of decisions
    flip = lambda k: SLOW if k > 0 else FAST  # noqa: E731
    assert settled_swing(flip, to_cpu=4, to_gpu=0) in range(0, 5)
