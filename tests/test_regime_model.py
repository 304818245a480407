"""The performance model's two regimes (perfmodel/lanes.py): no_clip, where overlap_backward's speculation succeeds,
and clip, where the partial norm stops it at the first subgroup and the CPU lane runs in the step; the lane balance's
settling in clip; the CPU-lane subgroups left out of speculation (speculative_subgroups), updated in place by the worker."""
import pytest

from dostune.optim.balance import LaneBalance
from dostune.optim.schedule import ScheduleConfig, make_plan
from dostune.perfmodel.backward import dostune_grad_bytes
from dostune.perfmodel.coefficients import Coefficients, StepShape
from dostune.perfmodel.inputs import ModelInputs
from dostune.perfmodel.lanes import lent_subgroups, speculating_subgroups
from dostune.perfmodel.model import predict
from dostune.perfmodel.step import simulated_lane_times, simulate_step
from dostune.profile.paths import profiles_dir
from test_perfmodel import node

GIGA = 1_000_000_000
PLAIN = 1e9 / 20e9 + 1e9 / 4e9 + 1e9 / 10e9  # the hand node's unscale + Adam + CPU convert of 1e9 elements, 16 threads
HALF_UP = 2e9 / 50e9  # one subgroup's half-precision upload, alone on the link


def test_clip_runs_the_whole_cpu_lane_in_the_step_at_the_steps_rates():
    sched = ScheduleConfig(gpu_fraction=0.0, cpu_threads=16, overlap_backward=True)
    sizes = [GIGA, GIGA]
    # both subgroups final inside a 2 s backward: no_clip updates them there and leaves nothing for the step
    spec = simulate_step(sizes, sched, node(), backward_s=2.0, ready_fraction=[0.6, 0.1])
    assert spec.lanes_s == 0.0
    # clip: nothing speculates; the worker recomputes both in the step, the last layers first, each upload under the
    # next update but the last's
    clip = simulate_step(sizes, sched, node(), backward_s=2.0, ready_fraction=[0.6, 0.1], regime="clip")
    cpu = [x for x in clip.spans if x.lane == "cpu"]
    assert [x.subgroup for x in cpu] == [1, 0] and cpu[0].start == 0.0
    assert clip.lanes_s == pytest.approx(2 * PLAIN + HALF_UP) and clip.cpu_busy_s == pytest.approx(2 * PLAIN)
    # at the lane kernel's own rate in the step (the model profile's step-lane probe)
    shape = StepShape(lane_step_slowdown=0.8, lane_backward_slowdown=1.2)
    measured = simulate_step(sizes, sched, node(), backward_s=2.0, ready_fraction=[0.6, 0.1], shape=shape,
                             regime="clip")
    assert measured.lanes_s == pytest.approx(2 * 0.8 * PLAIN + HALF_UP)
    # a schedule without overlap_backward runs its CPU lane in the step either way: the regimes agree
    plain = ScheduleConfig(gpu_fraction=0.5, cpu_threads=16)
    assert simulate_step(sizes, plain, node(), regime="clip").lanes_s == simulate_step(sizes, plain, node()).lanes_s


def test_subgroups_left_out_of_speculation_are_updated_in_place_by_the_worker_in_the_step():
    sizes = [GIGA, GIGA]
    shape = StepShape(lane_step_slowdown=0.8)

    def step(count):
        sched = ScheduleConfig(gpu_fraction=0.0, cpu_threads=16, overlap_backward=True, speculative_subgroups=count)
        return simulate_step(sizes, sched, node(), backward_s=2.0, ready_fraction=[0.6, 0.1], shape=shape)

    one = step(1)
    cpu = {x.subgroup: x for x in one.spans if x.lane == "cpu"}
    # the worker speculates on the highest index (its gradients are final first) during backward
    assert cpu[1].end < 0
    # subgroup 0, without a shadow: the same worker updates it in place from the step's start with the same kernel
    # (the lane's rate in the step), then its half-precision upload
    assert cpu[0].start == 0.0 and cpu[0].end == pytest.approx(0.8 * PLAIN)
    assert one.lanes_s == pytest.approx(0.8 * PLAIN + HALF_UP)
    # None: every subgroup speculates; 0: none does, both updated in place in the step
    assert step(None).lanes_s == 0.0
    assert step(0).lanes_s == pytest.approx(2 * 0.8 * PLAIN + HALF_UP)
    # the optimizer's own choice of which speculate (footprint.speculative_set): the highest indices
    sched = ScheduleConfig(gpu_fraction=0.25, overlap_backward=True, speculative_subgroups=2)
    plan = make_plan(4, sched)
    assert speculating_subgroups(plan, sched) == [3, 2]
    assert speculating_subgroups(plan, sched.model_copy(update={"speculative_subgroups": None})) == [3, 2, 1]


def test_every_cpu_lane_subgroups_gradients_are_read_from_the_half_precision_copy_under_overlap():
    sched = ScheduleConfig(gpu_fraction=0.25, overlap_backward=True, speculative_subgroups=1)
    plan = make_plan(4, sched)
    # subgroup 0 on the GPU keeps its gradients there; the worker's, speculative or not, read the half-precision copy
    assert dostune_grad_bytes([10] * 4, plan, sched, 2, False) == [0, 20, 20, 20]
    # a plan that streams none of the schedule's CPU-lane subgroups lends none
    assert lent_subgroups(plan, sched) == frozenset()


def _hand_coefficients(**shape):
    return Coefficients(node=node(), overhead_s=0.0, shape=StepShape(**shape), backward=None)


def test_clip_settles_the_split_where_the_lane_balance_stops():
    """A GPU lane far longer than the CPU lane's step: the balance moves streamed GPU-lane subgroups to the CPU lane
    while its rule says the step ends sooner, and the prediction is of the split it stops at."""
    sizes = [GIGA] * 8
    sched = ScheduleConfig(gpu_fraction=7 / 8, cpu_threads=16, overlap_backward=True, adaptive_swing=6)
    m = ModelInputs(model="hand", params=sum(sizes), fwd_s=0.1, bwd_s=2.0)
    ready = [1.0 - i / 8 for i in range(8)]
    coeffs = _hand_coefficients()
    tuned = predict(sizes, GIGA, sched, coeffs, m, grad_ready=ready, regime="clip")
    assert tuned.regime == "clip" and 0 < tuned.swing <= 6
    assert tuned.plan == make_plan(8, sched, swing=tuned.swing)
    # where it stopped, the rule makes no further move on the simulated lane ends
    balance = LaneBalance(sched.adaptive_swing, window=1)
    balance.swing = tuned.swing
    assert balance.observe(simulated_lane_times(tuned.step, tuned.plan, {})) == tuned.swing
    # and the split it settled on ends the step sooner than the tuned one would in clip
    unbalanced = predict(sizes, GIGA, sched.model_copy(update={"adaptive_swing": 0}), coeffs, m, grad_ready=ready,
                         regime="clip")
    assert unbalanced.swing == 0 and tuned.step_s < unbalanced.step_s
    # no_clip keeps the tuned split (the search scores the other splits as candidates of their own)
    spec = predict(sizes, GIGA, sched, coeffs, m, grad_ready=ready)
    assert spec.swing == 0 and spec.plan == make_plan(8, sched)
    # the memory is the schedule's own in either regime (the optimizer sizes its allowance for every swing)
    assert tuned.memory == spec.memory


@pytest.fixture(scope="module")
def gpt2_space():
    from dostune.tune.search import TuneOptions, build_space

    folder = profiles_dir()
    return build_space(TuneOptions(model="gpt2-1.3b", profile=folder / "h100-pcie5.json",
                                   model_profile=folder / "h100-pcie5-gpt2-1.3b-b8-s1024.json"))[0]


def test_clip_leaves_backward_without_the_lane_and_the_step_with_all_of_it(gpt2_space):
    sched = ScheduleConfig(gpu_fraction=0.4, overlap_backward=True, cpu_threads=8)
    spec = gpt2_space.predict_schedule(100_000_000, sched)
    clip = gpt2_space.predict_schedule(100_000_000, sched, "clip")
    assert spec.regime == "no_clip" and clip.regime == "clip"
    # backward: the same compute and copies, nothing of the lane's interference in clip
    assert clip.backward.compute_s == spec.backward.compute_s and clip.backward.copies_s == spec.backward.copies_s
    assert spec.backward.interference_s > 0 and clip.backward.interference_s == 0 == clip.backward.lane_busy_s
    assert all(x.start >= 0 for x in clip.step.spans if x.lane == "cpu")
    assert clip.step_s > spec.step_s and clip.iter_s > spec.iter_s
    # without overlap_backward nothing depends on clipping
    plain = ScheduleConfig(gpu_fraction=0.4)
    assert gpt2_space.predict_schedule(100_000_000, plain, "clip").iter_s == \
        gpt2_space.predict_schedule(100_000_000, plain).iter_s


def test_cpu_lane_uploads_queue_behind_the_gpu_lanes_own_inputs_not_the_lent_ones():
    """The H2D engine serves copies in submission order: the CPU lane's uploads wait for the GPU lane's own inputs,
    but go up beside those of a subgroup lent to the GPU lane (a kernel widens its half-precision gradients between
    its copies on the same stream)."""
    sched = ScheduleConfig(gpu_fraction=0.25, cpu_threads=16, overlap_backward=True, adaptive_swing=2,
                           staging_buffers=2)
    plan = make_plan(4, sched, swing=-1)
    assert lent_subgroups(plan, sched) == frozenset({1})
    step = simulate_step([GIGA] * 4, sched, node(), backward_s=2.0, ready_fraction=[1.0, 0.75, 0.5, 0.25],
                         plan=plan, regime="clip")
    inputs = {x.subgroup: x for x in step.spans if x.lane == "h2d"}
    ups = [x for x in step.spans if x.lane == "up"]
    assert ups and all(x.start >= inputs[0].end for x in ups)
    assert ups[0].start < inputs[1].end  # up while the lent subgroup's inputs come in
    # as tuned, nothing lent: every upload waits for all of the GPU lane's inputs
    tuned = simulate_step([GIGA] * 4, sched, node(), backward_s=2.0, ready_fraction=[1.0, 0.75, 0.5, 0.25],
                          regime="clip")
    last_in = max(x.end for x in tuned.spans if x.lane == "h2d")
    assert all(x.start >= last_in for x in tuned.spans if x.lane == "up")
