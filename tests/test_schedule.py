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
    with pytest.raises(ConfigError, match="needs grads_on_gpu"):
        ScheduleConfig.from_ds_config({"dostune": {"resident_subgroups": 1, "grads_on_gpu": False}})


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
    from dostune.optim.footprint import HALF_RING_BYTES, backward_lane_host_bytes, half_ring_count, pinned_host_bytes

    sizes = [100, 300, 200, 200, 100]
    # GPU lane 0-2 (0 resident); the CPU lane 3, 4; adaptive_swing may move 2 and 1 to it
    sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", resident_subgroups=1, overlap_backward=True,
                           adaptive_swing=2)
    plan = make_plan(5, sched)
    assert plan.cpu_order == [3, 4] and plan.swing_candidates == (2, 1)
    # shadows of all four it may update, and one ring buffer per subgroup of the widest (subgroup 1)
    assert backward_lane_host_bytes(sizes, plan, sched) == 12 * 800 + 4 * 300 * 2
    # fp32 params, gradients, exp_avg, exp_avg_sq and DeepSpeed's bf16 gradient buffer: 18 bytes per element (20 in fp32)
    assert pinned_host_bytes(sizes, plan, sched) == 18 * 900 + 12 * 800 + 4 * 300 * 2
    assert pinned_host_bytes(sizes, plan, sched, grad_buffer=4) == 20 * 900 + 12 * 800 + 4 * 300 * 2
    # the ring stops at HALF_RING_BYTES (at least two buffers)
    assert half_ring_count(40, HALF_RING_BYTES // 20) == 10 and half_ring_count(40, HALF_RING_BYTES) == 2
    # at the step the CPU lane converts into two buffers (cpu_convert), and keeps no shadows
    step = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", upload="cpu_convert")
    assert pinned_host_bytes(sizes, make_plan(5, step), step) == 18 * 900 + 2 * 200 * 2
