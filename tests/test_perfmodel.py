import math

import pytest

from dostune.optim.schedule import ScheduleConfig
from dostune.perfmodel.coefficients import FALLBACK_LANE_BACKWARD_SLOWDOWN
from dostune.perfmodel.inputs import Cost, ModelInputs, NodeInputs
from dostune.perfmodel.memory import grad_ready_fractions, predict_memory
from dostune.perfmodel.model import best_gpu_fraction
from dostune.perfmodel.step import _advance, simulate_step
from dostune.perfmodel.subgroups import subgroup_sizes
from dostune.perfmodel.zero_offload import ds_offload_step_lanes


def node(h2d=50e9, d2h=50e9, duplex=40e9, cpu=4e9, gpu=100e9, unscale=20e9, conv_cpu=10e9, conv_gpu=500e9,
         contention=1.0, overhead=0.0):
    c = lambda r: Cost(overhead_s=overhead, rate=r)  # noqa: E731
    return NodeInputs(node="hand", h2d=c(h2d), d2h=c(d2h), h2d_duplex=c(duplex), d2h_duplex=c(duplex),
                      h2d_pageable=c(5e9), d2h_pageable=c(4e9), cpu_adam={8: c(cpu / 2), 16: c(cpu)}, best_threads=16, default_threads=16,
                      gpu_adam=c(gpu), convert_cpu=c(conv_cpu), convert_gpu=c(conv_gpu), unscale_cpu=c(unscale),
                      contention=contention, contention_gbps=80.0)


def test_subgroups_follow_deepspeed_rule():
    assert subgroup_sizes([5, 5, 5, 5], 10) == [10, 10]
    assert subgroup_sizes([3, 8, 2, 4], 10) == [11, 6]
    assert subgroup_sizes([3, 3], 100) == [6]
    assert subgroup_sizes([7, 7], 10, world_size=2) == [8]  # ceil(7/2) = 4 per rank


def test_advance_through_contended_segments():
    assert _advance(0.0, 1.0, []) == 1.0
    # 1 s of work; [0.5, 1.5) runs at half speed: 0.5 done by 0.5, 0.5 more takes 1.0 -> ends at 1.5
    assert _advance(0.0, 1.0, [(0.5, 1.5, 2.0)]) == pytest.approx(1.5)
    # segment too short to finish inside: 0.25 of work in [0.5,1.0) at half speed, remaining 0.25 free
    assert _advance(0.0, 1.0, [(0.5, 1.0, 2.0)]) == pytest.approx(1.25)


def test_all_cpu_step_by_hand():
    n = node()
    sizes = [1_000_000_000, 1_000_000_000]
    p = simulate_step(sizes, ScheduleConfig(gpu_fraction=0.0, cpu_threads=16), n)
    cpu = 1e9 / 20e9 + 1e9 / 4e9  # unscale + Adam per subgroup
    up = 4e9 / 50e9 + 1e9 / 500e9  # fp32 up alone (nothing else on the link) + GPU convert
    # second upload waits for the second CPU subgroup; the first upload overlaps it
    assert p.lanes_s == pytest.approx(2 * cpu + up)
    assert p.cpu_busy_s == pytest.approx(2 * cpu)


def test_single_gpu_subgroup_by_hand():
    n = node()
    p = simulate_step([1_000_000_000], ScheduleConfig(gpu_fraction=1.0, staging_buffers=1), n)
    expect = 12e9 / 50e9 + 1e9 / 100e9 + 12e9 / 50e9  # in (alone), kernel, out (alone)
    assert p.lanes_s == pytest.approx(expect)


def test_overlap_backward_by_hand():
    n = node()
    sizes = [1_000_000_000, 1_000_000_000]
    sched = ScheduleConfig(gpu_fraction=0.0, cpu_threads=16, overlap_backward=True)
    # unscale + Adam + convert, in backward (with 15 threads: the profiled 16's rates)
    cpu = (1e9 / 20e9 + 1e9 / 4e9 + 1e9 / 10e9) * FALLBACK_LANE_BACKWARD_SLOWDOWN
    # 2 s of backward; subgroup 1 (last layers) is final 10% in, subgroup 0 at 60%: both finish inside backward
    p = simulate_step(sizes, sched, n, backward_s=2.0, ready_fraction=[0.6, 0.1])
    spans = {x.subgroup: x for x in p.spans if x.lane == "cpu"}
    assert spans[1].start == pytest.approx(-1.8) and spans[0].start == pytest.approx(-0.8)
    assert spans[0].end == pytest.approx(-0.8 + cpu)
    assert p.lanes_s == 0.0 and p.cpu_busy_s == 0.0  # nothing left for the step
    # subgroup 0 final only at the end of backward: its update (now at the step's speed) is the step
    late = simulate_step(sizes, sched, n, backward_s=2.0, ready_fraction=[1.0, 0.1])
    plain = 1e9 / 20e9 + 1e9 / 4e9 + 1e9 / 10e9
    assert late.lanes_s == pytest.approx(plain + 2e9 / 50e9)  # + its half-precision upload
    # the lane's kernel alone at 0.8 of the node's CPU-lane time: what it has left for the step goes that much faster;
    # during backward it runs 1.2 times the node's
    from dostune.perfmodel.coefficients import StepShape

    shape = StepShape(lane_step_slowdown=0.8, lane_backward_slowdown=1.2)
    measured = simulate_step(sizes, sched, n, backward_s=2.0, ready_fraction=[1.0, 0.1], shape=shape)
    assert measured.lanes_s == pytest.approx(0.8 * plain + 2e9 / 50e9)
    first = next(x for x in measured.spans if x.lane == "cpu" and x.subgroup == 1)
    assert first.end - first.start == pytest.approx(1.2 * plain)
    # without readiness (no model profile) the CPU lane runs in the step as before
    assert simulate_step(sizes, sched, n).lanes_s == simulate_step(sizes, ScheduleConfig(gpu_fraction=0.0,
                                                                                         cpu_threads=16), n).lanes_s


def test_grad_ready_fractions_interpolate_the_profile():
    # profile: two subgroups of 100 elements, final at 0.8 s and 0.2 s of a 1 s backward
    assert grad_ready_fractions([50, 100, 50], [100, 100], [0.8, 0.2], 1.0) == [0.8, 0.8, 0.2]
    assert grad_ready_fractions([100], [100], [None], 1.0) is None


def test_staging_slot_reuse_serialises_with_one_buffer():
    n = node()
    sizes = [1_000_000_000] * 3
    one = simulate_step(sizes, ScheduleConfig(gpu_fraction=1.0, staging_buffers=1), n).lanes_s
    two = simulate_step(sizes, ScheduleConfig(gpu_fraction=1.0, staging_buffers=2), n).lanes_s
    assert two < one
    # one slot: three in-kernel-out chains back to back; the first copy in and the last copy out run alone,
    # the other four at the duplex rate
    assert one == pytest.approx(2 * 12e9 / 50e9 + 4 * 12e9 / 40e9 + 3 * 1e9 / 100e9)


def test_the_steps_lane_slows_beside_copies_by_its_own_measure():
    # overlap_backward, one CPU-lane subgroup final at the end of backward (its update is the step's) beside a GPU-lane
    # subgroup streaming: in the step the lane takes the model profile's step-lane contention, not the node's
    from dostune.perfmodel.coefficients import StepShape

    sizes = [1_000_000_000] * 2
    sched = ScheduleConfig(gpu_fraction=0.5, overlap_backward=True, cpu_threads=16)

    def step(contention, shape):
        p = simulate_step(sizes, sched, node(contention=contention), backward_s=2.0, ready_fraction=[0.5, 1.0],
                          shape=shape)
        return {x.subgroup: x for x in p.spans if x.lane == "cpu"}[1]

    plain = 1e9 / 20e9 + 1e9 / 4e9 + 1e9 / 10e9
    node_only = step(1.0, StepShape())  # neither slows it: the step's lane at its full rate
    assert node_only.start == 0.0 and node_only.end == pytest.approx(plain)
    assert step(2.0, StepShape()).end > 1.3 * plain  # older profiles: the node's contention
    # the GPU lane's copies (0.24 s in, 0.3 s out) run under most of it: any traffic doubles the lane's time
    assert step(1.0, StepShape(lane_step_contention=(2.0, 1.0))).end > 1.3 * plain
    # with the lane's own measure the node's contention does not count
    assert step(2.0, StepShape(lane_step_contention=(1.0, 1.0))).end == pytest.approx(plain)


def test_contention_slows_the_cpu_lane():
    sizes = [500_000_000] * 4
    sched = ScheduleConfig(gpu_fraction=0.5, cpu_threads=16)
    calm = simulate_step(sizes, sched, node(contention=1.0))
    busy = simulate_step(sizes, sched, node(contention=1.6))
    assert busy.cpu_busy_s > calm.cpu_busy_s


@pytest.mark.parametrize("f", [0.0, 0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("buffers", [1, 2, 4])
def test_faster_pcie_never_predicts_slower(f, buffers):
    sizes = [300_000_000, 250_000_000, 400_000_000, 100_000_000, 350_000_000, 200_000_000]
    sched = ScheduleConfig(gpu_fraction=f, staging_buffers=buffers, cpu_threads=16)
    prev = math.inf
    for scale in (0.5, 1.0, 1.5, 2.0, 4.0):
        t = simulate_step(sizes, sched, node(h2d=50e9 * scale, d2h=50e9 * scale, duplex=40e9 * scale,
                                             contention=1.5)).step_s
        assert t <= prev + 1e-12
        prev = t


def test_closed_form_balances_cpu_and_copies():
    n = node(contention=1.0)
    f = best_gpu_fraction(10**9, n, 16)
    c = 1 / 20e9 + 1 / 4e9
    f_h2d = (c - 4 / 40e9) / (c + 8 / 40e9)
    f_d2h = c / (c + 12 / 40e9)
    assert f == pytest.approx(min(f_h2d, f_d2h))
    assert 0 < f < 1


def test_deepspeed_step_by_hand():
    n = node()
    sizes = [10**9, 10**9]
    per = 1e9 / 20e9 + 1e9 / 4e9 + 1e9 / 10e9 + 2e9 / 5e9  # unscale, adam, CPU convert, pageable half upload
    assert ds_offload_step_lanes(sizes, n) == pytest.approx(2 * per)


def test_memory_prediction():
    m = ModelInputs(model="x", params=4 * 10**8, peak_fwd_gib=10.0, peak_bwd_gib=12.0, peak_step_gib=2.0)
    sizes = [10**8] * 4
    sched = ScheduleConfig(gpu_fraction=0.5, staging_buffers=2, grads_on_gpu=True)
    mem = predict_memory(sizes, sched, m, grad_alloc_fraction=[0.9, 0.7, 0.5, 0.3])
    slots = 2 * 10**8 * 12
    up = 10**8 * 4
    kept = 2 * 10**8 * 4
    assert mem.extra_step_gib == pytest.approx((slots + up + kept) / 2**30)
    # "first" placement: subgroups 0 and 1 keep gradients, allocated 70% and 90% into backward, when backward
    # has freed 7 and 9 GiB of its 10 GiB: the 0.37 GiB each never lift backward's peak
    assert mem.extra_bwd_gib == 0.0
    assert mem.peak_gpu_gib == pytest.approx(max(12.0, 2.0 + mem.extra_step_gib))
    early = predict_memory(sizes, sched, m, grad_alloc_fraction=[0.0, 0.0, 0.5, 0.3])
    assert early.extra_bwd_gib == pytest.approx(kept / 2**30)
    # overlap_backward shadows the CPU lane's states; adaptive_swing adds those of the subgroups it may move
    ov = sched.model_copy(update={"overlap_backward": True})
    swing = ov.model_copy(update={"adaptive_swing": 1})
    extra = predict_memory(sizes, swing, m).pinned_host_gib - predict_memory(sizes, ov, m).pinned_host_gib
    assert extra == pytest.approx(12 * 10**8 / 2**30)


def test_step_prefetch_during_deepspeeds_prologue_by_hand():
    from dostune.perfmodel.coefficients import FALLBACK_PROLOGUE_SHARE as STEP_PROLOGUE_SHARE
    from dostune.perfmodel.coefficients import FALLBACK_RELEASE_SHARE as STEP_RELEASE_SHARE

    n = node()
    sched = ScheduleConfig(gpu_fraction=1.0, staging_buffers=1)
    # the copy in starts at the step's start, prologue = 0.85 * 0.2 s before the lanes' time 0
    p = simulate_step([1_000_000_000], sched, n, overhead_s=0.2)
    h2d = [s for s in p.spans if s.lane == "h2d"]
    assert h2d[0].start == pytest.approx(-STEP_PROLOGUE_SHARE * 0.2)
    assert p.lanes_s == pytest.approx(12e9 / 50e9 - STEP_PROLOGUE_SHARE * 0.2 + 1e9 / 100e9 + 12e9 / 50e9)
    # a prologue longer than the copy hides all of it; the kernel still waits for the gradient norm, which comes
    # before DeepSpeed's parameter release (the last STEP_RELEASE_SHARE of the overhead before time 0)
    long = simulate_step([1_000_000_000], sched, n, overhead_s=1.0)
    kernel = [s for s in long.spans if s.lane == "gpu"][0]
    assert -STEP_PROLOGUE_SHARE + 12e9 / 50e9 < -STEP_RELEASE_SHARE  # the copy in is done before the norm is
    assert kernel.start == pytest.approx(-STEP_RELEASE_SHARE)
    assert long.lanes_s == 0.0  # everything ended under the release: the step is DeepSpeed's overhead alone
    mid = simulate_step([1_000_000_000], sched, n, overhead_s=0.5)  # the write-back outlasts the release
    assert mid.lanes_s == pytest.approx(12e9 / 50e9 - STEP_PROLOGUE_SHARE * 0.5 + 1e9 / 100e9 + 12e9 / 50e9)


def test_resident_subgroups_stream_nothing_by_hand():
    n = node()
    sizes = [1_000_000_000] * 3
    sched = ScheduleConfig(gpu_fraction=1.0, staging_buffers=1, resident_subgroups=2)
    p = simulate_step(sizes, sched, n)
    assert {s.subgroup for s in p.spans if s.lane in ("h2d", "d2h")} == {2}
    # the two resident kernels first, then subgroup 2 (its copy in overlaps them), kernel, copy out alone
    assert p.lanes_s == pytest.approx(max(2 * 1e9 / 100e9, 12e9 / 50e9) + 1e9 / 100e9 + 12e9 / 50e9)
    assert p.lanes_s < simulate_step(sizes, sched.model_copy(update={"resident_subgroups": 0}), n).lanes_s
    m = ModelInputs(model="x", params=3 * 10**9, peak_fwd_gib=10.0, peak_bwd_gib=12.0, peak_step_gib=2.0)
    mem, none = (predict_memory(sizes, sched.model_copy(update={"resident_subgroups": r}), m) for r in (2, 0))
    # resident states are held in every phase: 24 GB on top of backward's peak
    assert mem.peak_gpu_gib == pytest.approx(max(12.0 + 24e9 / 2**30, 2.0 + mem.extra_step_gib))
    assert mem.extra_step_gib - none.extra_step_gib == pytest.approx(24e9 / 2**30)


def test_backward_gradient_copies_slow_the_lane_under_backward():
    from dostune.perfmodel.step import gradient_copy_spans

    n = node(contention=2.0)  # 2x slower under 80 GB/s of copies
    # subgroup 1 final 10% into a 2 s backward, subgroup 0 at 60%: each one's bytes stream up to its moment
    spans = gradient_copy_spans([40e9, 20e9], [0.6, 0.1], 2.0, n)
    by = {x.subgroup: x for x in spans}
    assert (by[1].start, by[1].end) == (pytest.approx(-2.0), pytest.approx(-1.8))  # from backward's start
    assert (by[0].start, by[0].end) == (pytest.approx(-1.8), pytest.approx(-0.8))  # from the one before it
    for x, nbytes in ((by[0], 40e9), (by[1], 20e9)):
        assert x.gbps * 1e9 * (x.end - x.start) == pytest.approx(nbytes)
    # never faster than the node's device-to-host rate (50 GB/s): 15 GB in the 0.2 s from 20% to 30% of backward would
    # be 75 GB/s; they take 0.3 s instead, from earlier, but not from before backward's start
    assert gradient_copy_spans([15e9, 0], [0.3, 0.2], 2.0, n)[0].start == pytest.approx(-1.7)
    assert gradient_copy_spans([20e9, 0], [0.15, 0.1], 2.0, n)[0].start == pytest.approx(-2.0)
    # in the step: the lane's first subgroup under those copies takes longer than without them
    sizes = [1_000_000_000, 1_000_000_000]
    sched = ScheduleConfig(gpu_fraction=0.0, cpu_threads=16, overlap_backward=True)
    quiet = simulate_step(sizes, sched, n, backward_s=2.0, ready_fraction=[0.6, 0.1])
    copied = simulate_step(sizes, sched, n, backward_s=2.0, ready_fraction=[0.6, 0.1], grad_bytes=[2e9, 2e9])
    first = lambda p: next(x for x in p.spans if x.lane == "cpu" and x.subgroup == 1)  # noqa: E731
    assert first(copied).end - first(copied).start > first(quiet).end - first(quiet).start
    assert not [x for x in copied.spans if x.lane == "grad"]  # traffic only: not a lane of the step


def test_host_to_device_copies_slow_under_the_cpu_lane():
    sizes = [1_000_000_000] * 4
    idle = node()
    loaded = node().model_copy(update={"h2d_under_cpu": 0.8})

    def gpu_inputs(p):
        return sum(x.end - x.start for x in p.spans if x.lane == "h2d")

    # the CPU lane computes all the while the GPU lane's inputs come in: each takes 1/0.8 as long
    heavy_cpu = ScheduleConfig(gpu_fraction=0.25, staging_buffers=2, cpu_threads=16)
    assert gpu_inputs(simulate_step(sizes, heavy_cpu, loaded)) == pytest.approx(
        gpu_inputs(simulate_step(sizes, heavy_cpu, idle)) / 0.8)
    # once the CPU lane is done, the rest of an input comes in at the idle host's rate
    mixed = ScheduleConfig(gpu_fraction=0.5, staging_buffers=2, cpu_threads=16)
    fast, slow = simulate_step(sizes, mixed, idle), simulate_step(sizes, mixed, loaded)
    cpu_end = max(x.end for x in slow.spans if x.lane == "cpu")
    last_in = max((x for x in slow.spans if x.lane == "h2d"), key=lambda x: x.end)
    alone = next(x.end - x.start for x in fast.spans if x.lane == "h2d" and x.subgroup == last_in.subgroup)
    assert last_in.start < cpu_end < last_in.end
    assert last_in.end == pytest.approx(cpu_end + alone - (cpu_end - last_in.start) * 0.8)
    # no CPU lane, nothing computing on the host: the copies run at the idle host's rates
    gpu_only = ScheduleConfig(gpu_fraction=1.0, staging_buffers=2)
    assert simulate_step(sizes, gpu_only, loaded).lanes_s == pytest.approx(simulate_step(sizes, gpu_only, idle).lanes_s)
