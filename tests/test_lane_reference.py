"""The model profile's lane reference (profile/lane_reference.py) and the performance model's lane rates taken from it
(perfmodel/lane_reference.py)."""
import json
from pathlib import Path

import pytest

from dostune.bench.record import MethodResult
from dostune.optim.schedule import REMOVED_KEYS, ScheduleConfig
from dostune.profile.lane_reference import REFERENCE_SCHEDULE, measure_lane_reference
from dostune.profile.model_record import LaneReference, load_model_profile
from dostune.records import Span, save_record
from dostune.tune.repredict import profiles_of
from dostune.tune.search import TuneOptions, build_space
from dostune.tune.validation_report import load

ROOT = Path(__file__).resolve().parents[1]
# a validation whose rows ran overlap_backward, their CPU lanes traced in validation-bench.json
HELD_OUT = ROOT / "results/h100/heldout-22/llama_1_42b.json"


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def _result(timeline, ran=True, error=None):
    return MethodResult(method="dostune", description="dostune", ran=ran, error=error, iter_s=1.0, fwd_s=0.2,
                        bwd_s=0.5, step_s=0.3, samples={"fwd": [0.2], "bwd": [0.5], "step": [0.3], "iter": [1.0]},
                        timeline=timeline)


def test_the_reference_keeps_each_rounds_cpu_lane_and_runs_each_in_its_own_call():
    calls = []

    def runner(name, spec, opts, offload, progress):
        calls.append((name, offload.schedule, offload.sub_group_size, opts.clip, opts.iters))
        return _result([Span(lane="cpu", subgroup=3, start=-0.05, end=-0.04),
                        Span(lane="gpu", subgroup=0, start=0.0, end=0.01),
                        Span(lane="cpu", subgroup=2, start=0.01, end=0.02 + len(calls) / 100)])

    ref, note = measure_lane_reference("gpt2-tiny", 2, 32, "bf16", False, 20_000, runner=runner)
    assert note is None and ref.rounds == 2 and len(calls) == 2
    # each round as `tune --validate` runs a row: the schedule traced, gradient clipping off
    assert all(c[0] == "dostune" and c[1].trace and c[1].overlap_backward and c[3] == 0.0 for c in calls)
    assert ScheduleConfig.model_validate(ref.schedule) == REFERENCE_SCHEDULE
    assert [[(s.subgroup, s.end) for s in t] for t in ref.traces] == [[(3, -0.04), (2, 0.03)], [(3, -0.04), (2, 0.04)]]
    assert "lane reference: dostune with gpu_fraction 0.2, overlap_backward" in ref.describe()


def test_a_reference_that_fails_or_traces_no_lane_is_a_note_not_an_error():
    failed = lambda *a: _result([], ran=False, error="CUDA out of memory\ntraceback")  # noqa: E731
    ref, note = measure_lane_reference("gpt2-tiny", 2, 32, "bf16", False, 20_000, runner=failed)
    assert ref is None and note.startswith("the lane reference did not run (CUDA out of memory)")
    ref, note = measure_lane_reference("gpt2-tiny", 2, 32, "bf16", False, 20_000, runner=lambda *a: _result([]))
    assert ref is None and "traced no CPU-lane update" in note


def test_the_reference_runs_dostune_on_the_cpu():
    """The real runner, in this process: the CPU lane's updates come back traced."""
    from dostune.bench.run import run_method_here

    ref, note = measure_lane_reference("gpt2-tiny", 2, 32, "bf16", False, 20_000, runner=run_method_here, rounds=1,
                                       iters=1, sub_group_size=100_000)
    assert note is None and ref.traces[0] and all(s.lane == "cpu" and s.end >= s.start for s in ref.traces[0])


def _row_reference(k: int) -> LaneReference:
    """Row #k of the held-out validation as a lane reference: its schedule and traced CPU lane."""
    row = [v for v in load(HELD_OUT).validation if v.method == "dostune"][k - 1]
    timeline = json.loads(HELD_OUT.with_name("llama_1_42b-bench.json").read_text())["methods"][f"dostune #{k}"]
    spans = [Span(**x) for x in timeline["timeline"] if x["lane"] == "cpu"]
    return LaneReference(schedule={a: x for a, x in row.schedule.items() if a not in REMOVED_KEYS},
                         sub_group_size=row.sub_group_size, rounds=1, iterations=12, traces=[spans])


def _space(tmp_path, ref):
    res = load(HELD_OUT)
    node, mp = profiles_of(res, HELD_OUT)
    if ref is not None:
        mp = save_record(load_model_profile(mp).model_copy(update={"lane_reference": ref}), tmp_path / "m.json")
    return build_space(TuneOptions(model=res.model, profile=node, model_profile=mp, micro_batch=res.micro_batch,
                                   precision=res.precision))[0]


def test_the_lane_takes_the_references_rates_and_the_traced_timing(tmp_path):
    plain, ref = _space(tmp_path, None), _row_reference(1)
    assert not plain.coeffs.shape.traced_timing
    space = _space(tmp_path, ref)
    shape = space.coeffs.shape
    assert shape.traced_timing and any(n.startswith("the CPU lane's rates from the model profile's lane reference")
                                       for n in space.coeffs.notes)
    # the lane's time per element, in backward and in the step, scaled by the traced over the modelled for the
    # reference's own schedule (the probes' rates, the traced timing)
    from dataclasses import replace

    from dostune.perfmodel.lane_reference import lane_s_per_element

    sched = ScheduleConfig.model_validate(ref.schedule)
    plain.coeffs = replace(plain.coeffs, shape=replace(plain.coeffs.shape, traced_timing=True))
    p = plain.predict_schedule(ref.sub_group_size, sched)
    modelled = [(x.subgroup, x.start, x.end) for x in p.step.spans if x.lane == "cpu"]
    traced = [(s.subgroup, s.start, s.end) for s in ref.traces[0]]
    k = [lane_s_per_element(traced, p.sizes, 0.0, b) / lane_s_per_element(modelled, p.sizes, p.step.backward_end_s, b)
         for b in (True, False)]
    assert shape.lane_backward_slowdown == pytest.approx(k[0] * plain.coeffs.shape.lane_backward_slowdown)
    assert shape.lane_step_slowdown == pytest.approx(k[1] * plain.coeffs.shape.lane_step_slowdown)
    assert k[0] != pytest.approx(1.0, abs=0.01)
    # a reference whose lane ran 1.3x slower makes the lane 1.3x slower and the predicted step longer
    slow = ref.model_copy(update={"traces": [[s.model_copy(update={"end": s.start + 1.3 * (s.end - s.start)})
                                              for s in ref.traces[0]]]})
    slower = _space(tmp_path, slow).coeffs.shape
    assert slower.lane_backward_slowdown == pytest.approx(1.3 * shape.lane_backward_slowdown, rel=0.05)
    assert (_space(tmp_path, slow).predict_schedule(ref.sub_group_size, sched).step_s
            > space.predict_schedule(ref.sub_group_size, sched).step_s)


def test_a_reference_with_no_lane_update_the_model_places_keeps_the_probes(tmp_path):
    ref = _row_reference(1).model_copy(update={"traces": [[Span(lane="cpu", subgroup=999, start=0.0, end=0.1)]]})
    space = _space(tmp_path, ref)
    assert not space.coeffs.shape.traced_timing
    assert any("traced no CPU-lane update the model also places" in n for n in space.coeffs.notes)


def test_the_traced_timing_ends_backward_at_the_steps_start(tmp_path):
    space = _space(tmp_path, _row_reference(1))
    sched = ScheduleConfig.model_validate(_row_reference(1).schedule)
    p = space.predict_schedule(_row_reference(1).sub_group_size, sched)
    prologue = space.coeffs.shape.prologue_share * space.coeffs.overhead_s
    assert p.step.backward_end_s == pytest.approx(-prologue) and prologue > 0
    # the lane's first update starts in backward, before the step's start
    assert min(x.start for x in p.step.spans if x.lane == "cpu") < p.step.backward_end_s
