"""The model profile's reference run of dostune (profile/reference.py) and the performance model calibrated to it
(perfmodel/calibration.py), on the CPU: the run with a fake measurement in place of the bench's processes, the
calibration on a committed held-out profile of the H100 with made-up reference measurements."""
import json

import pytest

from dostune.bench.record import MethodResult
from dostune.optim.schedule import ScheduleConfig
from dostune.perfmodel.calibration import BOUNDS
from dostune.profile.reference import (REFERENCE_SCHEDULE, REFERENCE_SUB_GROUP_SIZE, describe_reference,
                                       measure_reference)
from dostune.stats import Stat
from dostune.tune.repredict import profiles_of
from dostune.tune.search import TuneOptions, build_space
from dostune.tune.validation_report import load

HELD_OUT = "results/h100/heldout-8/llama_2_5b.json"  # schema 8: no reference run of its own


class FakeRuns:
    """Each call one round of dostune: phases from ``seconds`` plus 0.01 s a call; ``fail`` makes that call fail."""

    def __init__(self, seconds=(0.1, 0.3, 0.2), fail=None):
        self.seconds, self.fail, self.calls = seconds, fail, []

    def __call__(self, name, spec, opts, offload, progress):
        self.calls.append((name, opts, offload))
        if len(self.calls) == self.fail:
            return MethodResult(method=name, description="", ran=False, error="CUDA out of memory\ntraceback...")
        f, b, s = (x + 0.01 * (len(self.calls) - 1) for x in self.seconds)
        samples = {"fwd": [f, f], "bwd": [b, b], "step": [s, s], "iter": [f + b + s] * 2}
        return MethodResult(method=name, description="", iter_s=f + b + s, fwd_s=f, bwd_s=b, step_s=s,
                            iter=Stat.of(samples["iter"]), fwd=Stat.of(samples["fwd"]), bwd=Stat.of(samples["bwd"]),
                            step=Stat.of(samples["step"]), samples=samples, round_iter_s=[f + b + s],
                            round_step_s=[s])


def test_the_reference_runs_the_fixed_schedule_as_a_validation_runs_a_row():
    runs = FakeRuns()
    ref, note = measure_reference("gpt2-tiny", 2, 32, "bf16", False, 20_000, runner=runs)
    assert note is None and [c[0] for c in runs.calls] == ["dostune", "dostune"]
    for _, opts, offload in runs.calls:  # each round its own call (bench/isolate.py: a fresh process)
        assert opts.clip == 0.0 and opts.train.clip == 0.0 and opts.micro_batch == 2 and opts.seq == 32
        assert offload.sub_group_size == REFERENCE_SUB_GROUP_SIZE and not offload.pin_memory
        assert offload.schedule == REFERENCE_SCHEDULE.model_copy(update={"trace": True})
    # both rounds' iterations pooled
    assert ref.rounds == 2 and ref.bwd_s.median == pytest.approx(0.305) and ref.step_s.n == 4
    assert ScheduleConfig.model_validate(ref.schedule) == REFERENCE_SCHEDULE
    assert describe_reference(ref) == "gpu_fraction 0.2, overlap_backward, 25M-element subgroups"


def test_a_reference_that_fails_leaves_a_note_and_no_run():
    ref, note = measure_reference("gpt2-tiny", 2, 32, "bf16", False, 20_000, runner=FakeRuns(fail=2))
    assert ref is None
    assert note.startswith("the reference schedule did not run (CUDA out of memory): the performance model is not "
                           "calibrated")


def _space(tmp_path, reference=None):
    """The held-out shape's space, its model profile given ``reference`` ((schedule, bwd, step) seconds)."""
    res = load(HELD_OUT)
    node, model = profiles_of(res, __import__("pathlib").Path(HELD_OUT))
    if reference is not None:
        sched, bwd, step = reference
        prof = json.loads(model.read_text())
        stat = lambda x: json.loads(Stat.of([x]).model_dump_json())  # noqa: E731
        prof["reference"] = dict(schedule=sched.model_dump(exclude_defaults=True),
                                 sub_group_size=REFERENCE_SUB_GROUP_SIZE, rounds=2, iterations=12, fwd_s=stat(0.15),
                                 bwd_s=stat(bwd), step_s=stat(step), iter_s=stat(0.15 + bwd + step))
        model = tmp_path / "model-profile.json"
        model.write_text(json.dumps(prof))
    opts = TuneOptions(model=res.model, profile=node, model_profile=model, micro_batch=res.micro_batch,
                       precision=res.precision)
    return build_space(opts)[0]


def _reference(space, sched=REFERENCE_SCHEDULE):
    return space.predict_schedule(REFERENCE_SUB_GROUP_SIZE, sched)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _space(tmp_path_factory.mktemp("plain"))


def test_calibrated_the_model_meets_the_reference_it_was_given(plain, tmp_path):
    p = _reference(plain)
    space = _space(tmp_path, (REFERENCE_SCHEDULE, p.bwd_s * 1.1, p.step_s * 1.3))
    q = _reference(space)
    assert q.bwd_s == pytest.approx(p.bwd_s * 1.1, rel=0.005)
    # the step moves in jumps (a slower lane leaves one more subgroup to it): the nearest the lane reaches
    assert q.step_s == pytest.approx(p.step_s * 1.3, rel=0.03)
    note = space.coeffs.notes[-1]
    assert note.startswith("calibrated to the model profile's reference run of dostune (gpu_fraction 0.2, "
                           "overlap_backward, 25M-element subgroups): its backward")
    assert "backward compute at 1.10x the probes' and its CPU lane at 1.3" in note
    # ZeRO-Offload is its own measurement: nothing of dostune's reference moves it
    assert space.zero_offload().iter_s == pytest.approx(plain.zero_offload().iter_s)
    # and every schedule the tuner scores moves with the coefficients, not the reference alone
    other = ScheduleConfig(gpu_fraction=0.4, overlap_backward=True, cpu_threads=16)
    assert space.predict_schedule(50_000_000, other).iter_s > plain.predict_schedule(50_000_000, other).iter_s


def test_a_reference_the_model_already_predicts_changes_nothing(plain, tmp_path):
    p = _reference(plain)
    space = _space(tmp_path, (REFERENCE_SCHEDULE, p.bwd_s, p.step_s))
    assert "backward compute at 1.00x the probes' and its CPU lane at 1.00x" in space.coeffs.notes[-1]
    sched = ScheduleConfig(gpu_fraction=0.3, overlap_backward=True)
    assert space.predict_schedule(25_000_000, sched).iter_s == pytest.approx(
        plain.predict_schedule(25_000_000, sched).iter_s, rel=2e-3)


def test_a_reference_beyond_the_bounds_is_noted_not_followed(plain, tmp_path):
    p = _reference(plain)
    space = _space(tmp_path, (REFERENCE_SCHEDULE, p.bwd_s * 10, p.step_s))
    note = space.coeffs.notes[-1]
    assert f"backward compute at {BOUNDS[1]:.2f}x" in note and "the backward stopped at the bound 0.33-3x" in note
    assert _reference(space).bwd_s < p.bwd_s * 10


def test_a_step_the_cpu_lane_does_not_set_leaves_the_lane_alone(plain, tmp_path):
    # without overlap_backward the lane is DeepSpeed's own update at the engine's measured rates: nothing to calibrate
    sched = ScheduleConfig(gpu_fraction=0.2)
    p = _reference(plain, sched)
    space = _space(tmp_path, (sched, p.bwd_s * 1.2, p.step_s * 1.5))
    note = space.coeffs.notes[-1]
    assert "its CPU lane at 1.00x the lane probe's time (the CPU lane did not set the reference's step" in note
    assert space.coeffs.shape == plain.coeffs.shape
