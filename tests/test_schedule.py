import pytest

from dostune.errors import ConfigError
from dostune.optim.schedule import CPU, GPU, ScheduleConfig, assign_lanes, make_plan


def test_every_kth_subgroup_goes_to_gpu():
    assert assign_lanes(8, 0.25, "spread") == [CPU, CPU, CPU, GPU] * 2
    assert assign_lanes(6, 1 / 3, "spread") == [CPU, CPU, GPU] * 2
    assert assign_lanes(4, 0.5, "spread") == [CPU, GPU, CPU, GPU]


def test_extremes():
    assert assign_lanes(5, 0.0) == [CPU] * 5
    assert assign_lanes(5, 1.0) == [GPU] * 5
    assert assign_lanes(0, 0.5) == []


@pytest.mark.parametrize("n", [1, 7, 20, 33])
@pytest.mark.parametrize("f", [0.1, 0.25, 0.3, 0.5, 0.8])
def test_fraction_is_respected_and_spread(n, f):
    lanes = assign_lanes(n, f, "spread")
    gpu = [i for i, lane in enumerate(lanes) if lane == GPU]
    assert len(gpu) == int(n * f + 1e-9)
    # evenly spread: gaps between GPU subgroups differ by at most one
    gaps = [b - a for a, b in zip(gpu, gpu[1:])]
    assert not gaps or max(gaps) - min(gaps) <= 1


def test_bad_fraction():
    with pytest.raises(ValueError):
        assign_lanes(4, 1.5)


def test_first_and_last_placement():
    assert assign_lanes(6, 0.5, "first") == [GPU, GPU, GPU, CPU, CPU, CPU]
    assert assign_lanes(6, 0.5, "last") == [CPU, CPU, CPU, GPU, GPU, GPU]
    assert assign_lanes(7, 0.3, "first").count(GPU) == assign_lanes(7, 0.3, "spread").count(GPU) == 2
    with pytest.raises(ValueError):
        assign_lanes(4, 0.5, "middle")


def test_plan_rotates_staging_slots():
    plan = make_plan(8, ScheduleConfig(gpu_fraction=0.5, staging_buffers=2, gpu_placement="spread"))
    assert plan.gpu_subgroups == [1, 3, 5, 7]
    assert plan.cpu_order == [0, 2, 4, 6]
    assert [(s.subgroup, s.slot, s.waits_for) for s in plan.gpu_slots] == [
        (1, 0, None), (3, 1, None), (5, 0, 1), (7, 1, 3)]


def test_plan_single_buffer_serialises():
    plan = make_plan(3, ScheduleConfig(gpu_fraction=1.0, staging_buffers=1))
    assert [(s.slot, s.waits_for) for s in plan.gpu_slots] == [(0, None), (0, 0), (0, 1)]


def test_every_subgroup_in_exactly_one_lane():
    plan = make_plan(13, ScheduleConfig(gpu_fraction=0.3))
    assert sorted(plan.cpu_order + plan.gpu_subgroups) == list(range(13))


def test_config_section_parsing():
    assert ScheduleConfig.from_ds_config({"zero_optimization": {}}) is None
    s = ScheduleConfig.from_ds_config({"dostune": {"gpu_fraction": 0.5, "staging_buffers": 3}})
    assert s.gpu_fraction == 0.5 and s.staging_buffers == 3
    with pytest.raises(ConfigError, match="dostune.gpu_fraction"):
        ScheduleConfig.from_ds_config({"dostune": {"gpu_fraction": 2}})
    with pytest.raises(ConfigError, match="dostune.gpu_fractoin"):
        ScheduleConfig.from_ds_config({"dostune": {"gpu_fractoin": 0.5}})
    with pytest.raises(ConfigError, match="must be an object"):
        ScheduleConfig.from_ds_config({"dostune": [1]})


def test_resident_subgroups_come_first_and_use_no_slot():
    plan = make_plan(6, ScheduleConfig(gpu_fraction=0.5, gpu_placement="first", staging_buffers=1,
                                       resident_subgroups=2))
    assert plan.resident == (0, 1)
    assert plan.gpu_subgroups == [0, 1, 2]
    assert [(s.subgroup, s.slot) for s in plan.gpu_slots] == [(2, 0)]
    assert [s.subgroup for s in plan.first_fills] == [2]
    with pytest.raises(ConfigError, match="GPU lane has only 3"):
        make_plan(6, ScheduleConfig(gpu_fraction=0.5, resident_subgroups=4))
    # DeepSpeed keeps the first subgroups on the GPU: the resident ones must be those
    for placement in ("spread", "last"):
        with pytest.raises(ConfigError, match="resident_subgroups needs gpu_placement 'first'"):
            ScheduleConfig.from_ds_config({"dostune": {"resident_subgroups": 1, "gpu_placement": placement}})
    # their gradients are on the GPU whatever grads_on_gpu says of the streamed ones
    assert ScheduleConfig.from_ds_config({"dostune": {"resident_subgroups": 1, "grads_on_gpu": False}})


@pytest.mark.parametrize("n", [1, 5, 7, 26, 38, 98, 130, 401])
def test_the_offload_ratio_for_a_resident_count_keeps_exactly_those_on_the_gpu(n):
    from dostune.optim.schedule import resident_offload_ratio, twin_flow_gpu_subgroups

    for r in range(n + 1):
        ratio = resident_offload_ratio(r, n)
        assert 0.0 <= ratio <= 1.0 and twin_flow_gpu_subgroups(ratio, n) == r, (r, ratio)
        assert len(repr(ratio)) <= 8, ratio  # a short decimal, written into the user's config
    assert resident_offload_ratio(0, n) == 1.0 and resident_offload_ratio(n, n) == 0.0
    with pytest.raises(ValueError):
        resident_offload_ratio(n + 1, n)


def test_a_ratio_that_places_other_subgroups_on_the_gpu_is_explained():
    from dostune.optim.schedule import resident_placement_problem

    sched = ScheduleConfig(gpu_fraction=0.5, resident_subgroups=2)
    assert resident_placement_problem(0.79, 10, sched) is None
    assert resident_placement_problem(1.0, 10, sched) == (
        "offload_optimizer.ratio 1 keeps 0 of the 10 subgroups on the GPU, but resident_subgroups is 2 (DeepSpeed "
        "keeps the first int((1 - ratio) * subgroups) on the GPU: set the ratio to 0.79)")
    # in floats (1 - 0.8) * 10 is just below 2: DeepSpeed keeps one, and the message says so
    assert "ratio 0.8 keeps 1 of the 10" in resident_placement_problem(0.8, 10, sched)
    assert "keeps 5 of the 10" in resident_placement_problem(0.5, 10, sched)
    assert "ratio to 1.0 and fewer resident_subgroups" in resident_placement_problem(1.0, 1, sched)


@pytest.mark.parametrize("key", ["prefetch_states", "backward_gpu_subgroups"])
def test_a_removed_key_is_refused_with_what_to_do(key):
    with pytest.raises(ConfigError, match=f"'{key}' was removed from dostune .*: delete it from the dostune section"):
        ScheduleConfig.from_ds_config({"dostune": {"gpu_fraction": 0.5, key: 0}})


@pytest.mark.parametrize("n", [1, 3, 7, 26, 60])
def test_the_fraction_for_a_count_selects_exactly_that_count(n):
    from dostune.optim.schedule import gpu_count, gpu_fraction_for

    for k in range(n + 1):
        f = gpu_fraction_for(k, n)
        assert gpu_count(n, f) == k == assign_lanes(n, f, "first").count(GPU) == assign_lanes(n, f, "spread").count(GPU)


def test_pinned_host_memory_counts_what_the_cpu_lane_allocates():
    from dostune.optim.footprint import (HALF_RING_BYTES, backward_lane_host_bytes, half_ring_count,
                                         lane_buffer_bytes, pinned_host_bytes)
    from dostune.optim.schedule import host_half_gradients

    sizes = [100, 300, 200, 200, 100]
    # GPU lane 0-2 (0 resident); the CPU lane 3, 4; adaptive_swing may move 2 and 1 to it
    sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", resident_subgroups=1, overlap_backward=True,
                           adaptive_swing=2)
    plan = make_plan(5, sched)
    assert plan.cpu_order == [3, 4] and plan.swing_candidates == (2, 1)
    # shadows of all four it may update, and one ring buffer per subgroup of the widest (subgroup 1)
    lanes = 12 * 800 + 4 * 300 * 2
    assert backward_lane_host_bytes(sizes, plan, sched) == lane_buffer_bytes(sizes, plan, sched) == lanes
    # fp32 params, gradients, exp_avg and exp_avg_sq of every subgroup but the resident one (16 bytes per element),
    # but no fp32 gradients for the CPU lane's own (3 and 4), which it reads in half precision, and DeepSpeed's bf16
    # gradient buffer over all of them (2; 4 in fp32)
    assert host_half_gradients(5, sched) == {3, 4}
    assert pinned_host_bytes(sizes, plan, sched) == 16 * 800 - 4 * 300 + 2 * 900 + lanes
    assert pinned_host_bytes(sizes, plan, sched, grad_buffer=4) == 16 * 800 - 4 * 300 + 4 * 900 + lanes
    # the ring stops at HALF_RING_BYTES (at least two buffers)
    assert half_ring_count(40, HALF_RING_BYTES // 20) == 10 and half_ring_count(40, HALF_RING_BYTES) == 2
    # at the step the CPU lane converts into two buffers (cpu_convert), keeps no shadows, and reads DeepSpeed's fp32
    # gradients
    step = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", upload="cpu_convert")
    assert host_half_gradients(5, step) == frozenset()
    assert pinned_host_bytes(sizes, make_plan(5, step), step) == 18 * 900 + 2 * 200 * 2


@pytest.mark.parametrize("count,shadowed", [(None, {4, 3, 2, 1}), (5, {4, 3, 2, 1}), (3, {4, 3, 2}), (2, {4, 3}),
                                            (1, {4}), (0, set())])
def test_shadows_only_for_the_speculative_subgroups(count, shadowed):
    """speculative_subgroups k: the k subgroups the CPU lane may get whose gradients are final first (the highest
    indices; a swing candidate only within k); host memory counts their shadows alone, and the ring as before."""
    from dostune.optim.footprint import backward_lane_host_bytes, pinned_host_bytes, speculative_set

    sizes = [100, 300, 200, 200, 100]
    sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", overlap_backward=True, adaptive_swing=2,
                           speculative_subgroups=count)  # CPU lane 3, 4; 2 and 1 may swing to it
    plan = make_plan(5, sched)
    assert speculative_set(plan, sched) == shadowed
    # every swing of the schedule has the same set (shadows are allocated once, at start-up)
    assert all(speculative_set(make_plan(5, sched, swing=k), sched) == shadowed for k in (1, 2))
    ring = 4 * 300 * 2
    assert backward_lane_host_bytes(sizes, plan, sched) == 12 * sum(sizes[i] for i in shadowed) + ring
    assert pinned_host_bytes(sizes, plan, sched) == 18 * 900 - 4 * 300 + 12 * sum(sizes[i] for i in shadowed) + ring
    # no overlap: nothing speculates, whatever the count
    off = sched.model_copy(update={"overlap_backward": False})
    assert speculative_set(make_plan(5, off), off) == frozenset() and backward_lane_host_bytes(sizes, plan, off) == 0


def test_resident_subgroups_hold_gpu_memory_not_host_memory():
    """A resident subgroup's fp32 params, gradients and Adam states: 16 bytes per element on the GPU for the run
    (its gradient is no kept buffer of the step), none on the host; DeepSpeed's Twin-Flow at the ratio that keeps
    the same subgroups on the GPU offloads exactly the same state."""
    from dostune.optim.footprint import (deepspeed_offload_host_bytes, gpu_step_bytes, offloaded_host_bytes,
                                         pinned_host_bytes, resident_bytes)
    from dostune.optim.schedule import resident_offload_ratio

    sizes = [100, 300, 200, 200, 100]
    for r in range(4):
        sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", resident_subgroups=r, staging_buffers=1)
        plan = make_plan(5, sched)
        assert resident_bytes(sizes, plan) == 16 * sum(sizes[:r])
        streamed = sizes[r:3]
        slots = max(streamed, default=0) * 12
        # slots, the upload buffer (the widest CPU-lane subgroup in fp32), the streamed ones' kept gradients
        assert gpu_step_bytes(sizes, plan, sched) == slots + 200 * 4 + 4 * sum(streamed) + 16 * sum(sizes[:r])
        host = pinned_host_bytes(sizes, plan, sched)
        assert host == offloaded_host_bytes(sizes, r) == 16 * sum(sizes[r:]) + 2 * 900
        assert host == deepspeed_offload_host_bytes(sizes, False, ratio=resident_offload_ratio(r, 5))
    assert offloaded_host_bytes(sizes, 0, grad_buffer=4) == deepspeed_offload_host_bytes(sizes, False, grad_buffer=4)
