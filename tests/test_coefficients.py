"""The model's coefficients from the profiles (perfmodel/coefficients.py) and each method's backward
(perfmodel/backward.py): measured where the profile has it, the documented fallback with a note where it does not."""
import json

import pytest

from dostune.optim.schedule import ScheduleConfig, make_plan
from dostune.perfmodel.backward import (BackwardInputs, copy_seconds, dostune_backward, dostune_grad_traffic,
                                        zero_offload_backward, zero_offload_grad_traffic)
from dostune.perfmodel.coefficients import (FALLBACK_BACKWARD_SLOWDOWN, FALLBACK_LANE_BACKWARD_SLOWDOWN,
                                            FALLBACK_PROLOGUE_SHARE, FALLBACK_RELEASE_SHARE, Coefficients)
from dostune.perfmodel.inputs import Cost, ModelInputs, NodeInputs, timed_backward
from dostune.perfmodel.model import predict
from dostune.perfmodel.step import lane_busy_in_backward
from dostune.perfmodel.zero_offload import predict_zero_offload
from dostune.profile.model_record import load_model_profile
from dostune.profile.paths import shipped_profile
from dostune.profile.record import Sample, fit_series, load_node_profile
from dostune.stats import Stat


def node(pageable=5e9, d2h_pageable=4e9, pinned=50e9):
    c = lambda r: Cost(overhead_s=0.0, rate=r)  # noqa: E731
    return NodeInputs(node="hand", h2d=c(pinned), d2h=c(pinned), h2d_duplex=c(40e9), d2h_duplex=c(40e9),
                      h2d_pageable=c(pageable), d2h_pageable=c(d2h_pageable), cpu_adam={8: c(2e9), 16: c(4e9)},
                      best_threads=16, default_threads=16, gpu_adam=c(100e9), convert_cpu=c(10e9),
                      convert_gpu=c(500e9), unscale_cpu=c(20e9), contention=1.0, contention_gbps=80.0)


def series(points):
    return fit_series("elements", [Sample(size=s, threads=16, seconds=Stat.of([t])) for s, t in points])


def model(**kw):
    base = dict(model="m", params=4 * 10**9, profile_schema=3, fwd_s=0.5, bwd_s=3.0, ds_step_s=2.0,
                ds_sub_group_size=10**9, step_overhead_s=0.1, offload_pinned=False)
    return ModelInputs(**{**base, **kw})


SIZES = [10**9] * 4


def test_grad_traffic_by_hand():
    # DeepSpeed: the half-precision copy down, the copy back up, then fp32 down again
    assert zero_offload_grad_traffic(10, 2) == (60, 20)
    assert zero_offload_grad_traffic(10, 4) == (80, 40)  # fp32 training
    sched = ScheduleConfig(gpu_fraction=0.5, grads_on_gpu=True, overlap_backward=True)
    plan = make_plan(4, sched)  # subgroups 0, 1 on the GPU lane, 2, 3 on the CPU lane during backward
    assert dostune_grad_traffic([10, 20, 30, 40], plan, sched, 2, fp16=False) == 2 * (30 + 40)
    assert dostune_grad_traffic([10, 20, 30, 40], plan, sched, 2, fp16=True) == 2 * (10 + 20 + 30 + 40)
    off = sched.model_copy(update={"overlap_backward": False, "grads_on_gpu": False})
    assert dostune_grad_traffic([10, 20, 30, 40], make_plan(4, off), off, 2, fp16=False) == 6 * 100


def test_backward_from_measured_compute_by_hand():
    n = node()
    m = model(bwd_no_copy_s=1.0, bwd_beside_lane_s=1.5, lane_threads=16, lane_beside_s_per_elem=1e-9)
    c = Coefficients.of(n, m, SIZES)
    b = c.backward
    assert b.compute_s == 1.0 and b.slowdown == pytest.approx(1.5) and b.visible == 1.0  # profiled pageable
    assert not [x for x in c.notes if "backward" in x]
    # ZeRO-Offload in its profiled form is what the profile measured; pinned, its compute and copies at pinned rates
    assert zero_offload_backward(b, n, pinned=False).bwd_s == pytest.approx(3.0)
    assert zero_offload_backward(b, n, pinned=True).bwd_s == pytest.approx(1.0 + (24e9 + 8e9) / 50e9)
    # dostune: compute, its own page-locked copies, and what the CPU lane beside it adds: in 0.6 s of lane work,
    # backward's work runs at 1/1.5 of its speed, so 0.2 s is lost
    sched = ScheduleConfig(gpu_fraction=0.5, grads_on_gpu=True, overlap_backward=True)
    p = dostune_backward(b, n, SIZES, make_plan(4, sched), sched, lane_busy_s=0.6)
    assert p.copies_s == pytest.approx(2 * 2e9 / 50e9)
    assert p.interference_s == pytest.approx(0.2)
    assert p.bwd_s == pytest.approx(1.0 + 0.08 + 0.2)


def test_profiled_pinned_backward_shows_how_much_of_the_copies_it_hides():
    n = node()
    copies = copy_seconds(n, 24e9, 8e9, pinned=True)  # 0.64 s
    b = Coefficients.of(n, model(offload_pinned=True, bwd_s=1.32, bwd_no_copy_s=1.0), SIZES).backward
    assert b.visible == pytest.approx(0.32 / copies)
    b = Coefficients.of(n, model(offload_pinned=True, bwd_s=0.9, bwd_no_copy_s=1.0), SIZES).backward
    assert b.visible == 0.0  # never negative


def test_older_profile_falls_back_and_says_so():
    n = node()
    m = model(profile_schema=2, bwd_s=9.0, bwd_traffic_bytes=(20e9, 6e9))
    c = Coefficients.of(n, m, SIZES)
    b = c.backward
    # compute: the profiled backward less the copies NVML counted, at the pageable rates it copied at
    assert b.compute_s == pytest.approx(9.0 - (20e9 / 4e9 + 6e9 / 5e9))
    # never less than the forward's
    assert Coefficients.of(n, model(profile_schema=2, bwd_traffic_bytes=(20e9, 6e9)), SIZES).backward.compute_s == 0.5
    assert b.slowdown == FALLBACK_BACKWARD_SLOWDOWN and b.visible == 1.0
    assert c.shape.prologue_share == FALLBACK_PROLOGUE_SHARE and c.shape.release_share == FALLBACK_RELEASE_SHARE
    assert c.shape.lane_backward_slowdown == FALLBACK_LANE_BACKWARD_SLOWDOWN
    # one note names every measurement the profile lacks and what stands in for each
    (note,) = [x for x in c.notes if "re-profile the model" in x]
    for what in ("backward without its gradient copies", "backward beside the CPU lane", "step by part",
                 "the CPU lane beside backward", "CPU Adam in its own engine", "1.49x slower", "85% and 58%",
                 "at 1x the node profile's CPU-lane time", "(2.800 of 9.000 s)", "the CPU lane as the step runs it"):
        assert what in note, what
    # without NVML's counts: the bytes DeepSpeed's path moves
    b = Coefficients.of(n, model(profile_schema=2, bwd_s=9.0), SIZES).backward
    assert b.compute_s == pytest.approx(9.0 - (24e9 / 4e9 + 8e9 / 5e9))
    # no model profile at all: nothing to say about it
    c = Coefficients.of(n, ModelInputs(model="m", params=10), SIZES)
    assert c.backward is None and not c.notes


def test_measured_step_shape_and_lane_speed():
    n = node()
    composed = 1 / 20e9 + 1 / 4e9 + 1 / 10e9  # unscale + CPU Adam + CPU conversion, seconds per element
    m = model(step_shares=(0.7, 0.4), lane_threads=16, lane_beside_s_per_elem=1.2 * composed,
              lane_alone_s_per_elem=0.8 * composed)
    s = Coefficients.of(n, m, SIZES).shape
    assert (s.prologue_share, s.release_share) == (0.7, 0.4)
    assert s.lane_backward_slowdown == pytest.approx(1.2) and s.lane_step_slowdown == pytest.approx(0.8)


def test_the_lane_beside_backward_is_never_faster_than_alone():
    # the probe read the lane beside backward faster than alone (back-to-back updates of one hot subgroup); training
    # ran it slower: the model takes the alone rate there
    n = node()
    composed = 1 / 20e9 + 1 / 4e9 + 1 / 10e9
    m = model(lane_threads=16, lane_beside_s_per_elem=0.7 * composed, lane_alone_s_per_elem=0.8 * composed)
    s = Coefficients.of(n, m, SIZES).shape
    assert s.lane_backward_slowdown == pytest.approx(0.8) and s.lane_step_slowdown == pytest.approx(0.8)


def test_the_steps_lane_from_the_step_lane_probe():
    # schema 10: the step's lane from memory at the step's threads (8 here: the node's CPU Adam at 8 threads is half as
    # fast), and slowed beside copies by its own measure; backward keeps the backward probes' readings
    n = node()
    composed_8 = 1 / 20e9 + 1 / 2e9 + 1 / 10e9
    m = model(lane_threads=16, lane_beside_s_per_elem=1.2 * (1 / 20e9 + 1 / 4e9 + 1 / 10e9),
              lane_alone_s_per_elem=0.8 * (1 / 20e9 + 1 / 4e9 + 1 / 10e9), lane_step_threads=8,
              lane_step_s_per_elem=0.9 * composed_8, lane_step_copies_slowdown=1.3, lane_step_copies_gbps=50.0)
    s = Coefficients.of(n, m, SIZES).shape
    assert s.lane_step_slowdown == pytest.approx(0.9) and s.lane_step_contention == (1.3, 50.0)
    assert s.lane_backward_slowdown == pytest.approx(1.2)
    # a lane that read faster beside copies than alone is taken as not slowed by them
    m = m.model_copy(update={"lane_step_copies_slowdown": 0.95})
    assert Coefficients.of(n, m, SIZES).shape.lane_step_contention == (1.0, 50.0)
    assert not [x for x in Coefficients.of(n, m, SIZES).notes if "the CPU lane as the step runs it" in x]
    # older profiles: the step's lane at the backward probes' alone reading, the node's contention, and a note that
    # re-profiling measures it
    old = model(profile_schema=8, lane_threads=16, lane_beside_s_per_elem=1e-9, lane_alone_s_per_elem=1e-9)
    c = Coefficients.of(n, old, SIZES)
    assert c.shape.lane_step_contention is None
    (note,) = [x for x in c.notes if "re-profile the model" in x]
    assert "the CPU lane as the step runs it" in note and "the cached lane probe's rate" in note
    # a schema-10 profile measured without a GPU has none (its own notes say why): re-profiling would not measure it
    cpu = old.model_copy(update={"profile_schema": 10})
    assert not [x for x in Coefficients.of(n, cpu, SIZES).notes if "the CPU lane as the step runs it" in x]


def test_cpu_adam_and_unscale_at_the_rates_the_engine_ran_them():
    n = node()
    adam = series([(10**8, 10**8 / 4e9 * 1.25), (2 * 10**8, 2 * 10**8 / 4e9 * 1.25)])
    m = model(ds_cpu_adam=adam, ds_unscale=series([(10**8, 10**8 / 10e9)]))
    c = Coefficients.of(n, m, SIZES)
    assert c.node.cpu_adam[16].rate == pytest.approx(4e9 / 1.25) and c.node.cpu_adam[8].rate == pytest.approx(2e9 / 1.25)
    assert c.node.unscale_cpu.rate == pytest.approx(10e9)
    assert any("0.80x the node profile's rate" in x and "unscale at 0.50x" in x for x in c.notes)


def test_zero_offload_step_is_the_profiles_at_its_sub_group_size():
    n = node()
    m = model(bwd_no_copy_s=1.0)
    c = Coefficients.of(n, m, SIZES)
    z = predict_zero_offload(c, m, SIZES, 10**9)
    assert z.measured_step and z.step_s == 2.0 and z.iter_s == pytest.approx(0.5 + 3.0 + 2.0) and not z.pinned
    other = predict_zero_offload(c, m, [5 * 10**8] * 8, 5 * 10**8)
    assert not other.measured_step and other.step_s == pytest.approx(other.lanes_s + 0.1)


def test_backward_and_the_lane_under_it_agree(tmp_path):
    """predict() works dostune's backward and the CPU lane under it out against each other: the lane's time within
    the predicted backward is what the backward was charged for."""
    n = node()
    m = model(bwd_no_copy_s=1.0, bwd_beside_lane_s=1.6)
    c = Coefficients.of(n, m, SIZES)
    sched = ScheduleConfig(gpu_fraction=0.25, grads_on_gpu=True, overlap_backward=True, cpu_threads=16)
    p = predict(SIZES, 10**9, sched, c, m, grad_ready=[0.9, 0.6, 0.3, 0.1])
    busy = lane_busy_in_backward(p.step, p.bwd_s)
    assert 0 < busy < p.bwd_s
    assert p.backward.lane_busy_s == pytest.approx(busy, abs=2e-4)
    assert p.bwd_s == pytest.approx(1.0 + p.backward.copies_s + busy * (1 - 1 / 1.6), abs=2e-4)
    off = predict(SIZES, 10**9, sched.model_copy(update={"overlap_backward": False}), c, m)
    assert off.backward.interference_s == 0 and off.bwd_s < p.bwd_s + 1.0


def test_timed_backward_leaves_out_the_recorded_iteration_of_older_profiles(tmp_path):
    prof = load_model_profile(shipped_profile("h100-pcie5-gpt2-1.3b-b8-s1024.json"))
    assert timed_backward(prof) == prof.phases["bwd"].time_s.median  # 5 samples: the median stands
    data = json.loads(prof.model_dump_json())
    data["phases"]["bwd"]["time_s"] = {"median": 0.5, "lo": 0.4, "hi": 0.6, "n": 3}
    data["backward_s"] = 0.6
    assert timed_backward(type(prof).model_validate(data)) == pytest.approx(0.45)
    data["phases"]["bwd"]["time_s"] = {"median": 0.5, "lo": 0.4, "hi": 0.6, "n": 2}
    assert timed_backward(type(prof).model_validate(data)) == pytest.approx(0.4)
    data["backward_s"] = 0.55  # not one of the samples: left as it is
    assert timed_backward(type(prof).model_validate(data)) == 0.5
    data["schema_version"] = 3  # schema 3 does not time the recorded iteration
    data["backward_s"] = 0.6
    assert timed_backward(type(prof).model_validate(data)) == 0.5


def test_the_older_shipped_node_profile_says_what_it_lacks():
    # the H100 profile was measured before profiles held the pageable device-to-host rate and the copies under CPU Adam
    older = load_node_profile(shipped_profile("h100-pcie5.json"))
    n = NodeInputs.from_profile(older)
    assert n.d2h_pageable == n.h2d_pageable
    assert any("pageable device-to-host" in x and "re-profile the node" in x for x in n.notes)
    assert n.h2d_under_cpu == 1.0 and any("while CPU Adam computes" in x and "re-profile the node" in x
                                          for x in n.notes)
    data = json.loads(older.model_dump_json())
    data["schema_version"] = 4
    data["copies"]["d2h_pageable"] = json.loads(json.dumps(data["copies"]["h2d_pageable"]))
    data["copies"]["d2h_pageable"]["fit"]["rate_per_s"] = 7e9
    data["contention"]["h2d_under_cpu"] = 0.85
    p = type(older).model_validate(data)
    n = NodeInputs.from_profile(p)
    assert n.d2h_pageable.rate == 7e9 and n.h2d_under_cpu == 0.85 and not n.notes


def test_backward_inputs_type():
    b = BackwardInputs(1.0, 1.5, 1.0, 2, False, 3.0, False, (1.0, 1.0))
    assert zero_offload_backward(b, node(), pinned=False).copies_s == 2.0


def test_the_page_locked_copy_probe_gives_the_hidden_share_also_where_zero_offload_ran_pageable():
    n = node()
    copy = copy_seconds(n, 4e9, 0, pinned=True)  # the probe copied 4 GB: 0.08 s at the node's rate
    m = model(offload_pinned=False, bwd_s=3.0, bwd_no_copy_s=1.0, bwd_pinned_copy=(1.02, 4e9))
    assert Coefficients.of(n, m, SIZES).backward.visible == pytest.approx(0.02 / copy)
    # without the probe, a pageable profile says nothing of page-locked copies: taken whole
    assert Coefficients.of(n, model(offload_pinned=False, bwd_s=3.0, bwd_no_copy_s=1.0), SIZES).backward.visible == 1.0
    # the probe wins over ZeRO-Offload's pinned backward (it measures the copies dostune makes); never negative
    m = model(offload_pinned=True, bwd_s=1.32, bwd_no_copy_s=1.0, bwd_pinned_copy=(0.95, 4e9))
    assert Coefficients.of(n, m, SIZES).backward.visible == 0.0
