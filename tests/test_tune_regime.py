"""`dostune tune --regime`: schedules scored for steps that clip, that do not, or the worse of the two, decided from
the model profile's gradient norms by default; and `--neighbours`: the pick measured beside the schedules one step
from it, and its regret. On the CPU, with a made-up measurement in place of the bench's GPU runs."""
import json

import pytest
from typer.testing import CliRunner

from dostune.bench.record import MethodResult
from dostune.cli.app import app
from dostune.errors import DostuneError
from dostune.optim.schedule import ScheduleConfig, gpu_count
from dostune.perfmodel.lanes import REGIMES
from dostune.profile.paths import profiles_dir, shipped_profile
from dostune.tune.record import TuneResult
from dostune.tune.regime import regime_at, scoring
from dostune.tune.search import TuneOptions, build_space, run_tune, trial_record
from dostune.tune.validate import regret, validate

SHIPPED_MODEL = "h100-pcie5-gpt2-1.3b-b8-s1024.json"


def with_norms(tmp_path, norms) -> str:
    """The shipped gpt2-1.3b model profile, as if it had recorded ``norms`` (its own predates them)."""
    data = json.loads((profiles_dir() / SHIPPED_MODEL).read_text())
    data.update(grad_norms=norms, clip_threshold=1.0)
    path = tmp_path / f"norms-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_regime_is_decided_from_the_norms_against_the_clipping():
    assert regime_at([3.0, 2.5, 4.0], 1.0) == "clip"
    assert regime_at([3.0, 0.5, 0.4], 1.0) == "no_clip"  # clipped in one of three: most steps speculate
    assert regime_at([3.0, 2.5, 4.0], 0.0) == "no_clip"  # clipping off
    assert regime_at([None, 3.0], 1.0) == "clip"  # a skipped step counts for neither
    assert regime_at([], 1.0) is None
    regime, why, note = scoring("measured", 1.0, [3.0, 2.5, 4.0])
    assert (regime, why) == ("clip", "measured: 3 of the model profile's 3 timed iterations had a gradient norm over "
                                     "--clip 1")
    assert "--regime no-clip" in note  # what to do for pretrained weights
    assert scoring("measured", 5.0, [3.0, 2.5, 4.0])[::2] == ("no_clip", None)
    regime, _, note = scoring("measured", 1.0, [])  # a profile from before the norms
    assert regime == "both" and "profile the model again" in note
    assert scoring("measured", 1.0, None)[0] == "no_clip"  # no model profile: nothing overlaps backward
    assert scoring("no-clip", 1.0, [3.0])[:2] == ("no_clip", "--regime no-clip")
    assert scoring("both", 1.0, [3.0])[0] == "both"
    with pytest.raises(DostuneError, match="--regime must be one of measured, clip, no-clip, both"):
        scoring("sometimes", 1.0, None)
    with pytest.raises(DostuneError, match="--clip 0 turns clipping off"):
        scoring("clip", 0.0, None)


@pytest.fixture(scope="module")
def spaces(tmp_path_factory):
    """The gpt2-1.3b space on the shipped profiles, scored in each of the three ways."""
    out = {}
    for asked, scored in (("no-clip", "no_clip"), ("clip", "clip"), ("both", "both")):
        out[scored] = build_space(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), regime=asked))[0]
    return out


def test_the_regime_changes_the_score_not_the_space(spaces):
    spec, clip, both = spaces["no_clip"], spaces["clip"], spaces["both"]
    assert spec.choices() == clip.choices() == both.choices()
    assert list(spec.all_candidates())[::50] == list(both.all_candidates())[::50]
    overlap = next(c for c in spec.closed_form_candidates() if c.overlap_backward)
    a, b, worst = spec.evaluate(overlap), clip.evaluate(overlap), both.evaluate(overlap)
    assert (a.regime, b.regime) == ("no_clip", "clip") and b.iter_s > a.iter_s
    # both: the slower of the two, with the same resident subgroups
    assert worst.regime == "clip" and worst.iter_s == b.iter_s and worst.schedule == a.schedule == b.schedule
    plain = next(c for c in spec.closed_form_candidates() if not c.overlap_backward)
    assert spec.evaluate(plain).iter_s == clip.evaluate(plain).iter_s == both.evaluate(plain).iter_s
    # the record holds the scored prediction and both regimes'
    rec = trial_record(both, worst)
    assert rec.predicted.regime == "clip" and set(rec.regimes) == set(REGIMES)
    assert rec.iter_in("no_clip") == pytest.approx(a.iter_s) and rec.iter_in("clip") == pytest.approx(b.iter_s)


def test_measured_scores_clipping_where_the_profiles_norms_clip(tmp_path):
    out = tmp_path / "out"
    res, _, space = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=8, output_dir=out,
                                         model_profile=with_norms(tmp_path, [4.1, 3.7, 3.9])))
    assert space.regime == res.regime == "clip" and res.clip == 1.0 and res.profile_grad_norms == [4.1, 3.7, 3.9]
    assert all(r.predicted.regime == "clip" and set(r.regimes) == set(REGIMES) for r in res.top)
    assert any("tuned for steps that clip" in n and "--regime no-clip" in n for n in res.notes)
    assert "schedules scored for clipping (measured: 3 of the model profile's 3 timed iterations had a gradient " \
           "norm over --clip 1)" in res.details
    # the scored regime is part of the study's problem: the same study is not resumed under another
    with pytest.raises(DostuneError, match="made for other profiles or limits"):
        run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=8, output_dir=out,
                             regime="no-clip", model_profile=with_norms(tmp_path, [4.1, 3.7, 3.9])))
    # over the norms: no clipping, nothing to note
    res, _, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=8, clip=10.0,
                                     output_dir=tmp_path / "over", model_profile=with_norms(tmp_path, [4.1, 3.7, 3.9])))
    assert res.regime == "no_clip" and not any("tuned for steps that clip" in n for n in res.notes)


def test_tune_prints_both_regimes_and_the_one_it_scored(tmp_path):
    r = CliRunner().invoke(app, ["tune", "--trials", "6", "--output-dir", str(tmp_path / "o"), "--regime", "both"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.translate({ord(c): " " for c in "│┃"}).split())
    res = TuneResult.model_validate_json((tmp_path / "o" / "tune.json").read_text())
    assert res.regime == "both" and "scored for the worse of clipping and no clipping" in flat
    assert "iteration s no-clip iter s clip iter s speedup" in flat
    best = res.best
    assert (f"{best.predicted.iter_s:.3f} {best.iter_in('no_clip'):.3f} {best.iter_in('clip'):.3f}" in flat)
    assert best.predicted.iter_s == max(best.iter_in("no_clip"), best.iter_in("clip"))
    for bad, says in ((["--regime", "often"], "--regime must be one of measured, clip, no-clip, both"),
                      (["--regime", "clip", "--clip", "0"], "--regime clip scores schedules for steps that clip, "
                                                            "but --clip 0 turns clipping off")):
        r = CliRunner().invoke(app, ["tune", "--trials", "2", "--output-dir", str(tmp_path / "bad"), *bad])
        assert r.exit_code != 0 and says in " ".join(r.output.split()) and "Traceback" not in r.output
        assert not (tmp_path / "bad" / "tune.json").exists()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tune whose pick overlaps backward, with a resident subgroup, in the middle of the sub_group_sizes: every
    knob has a step either way."""
    tmp = tmp_path_factory.mktemp("tuned")
    res, _, space = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=6, output_dir=tmp,
                                         regime="no-clip", model_profile=with_norms(tmp, [4.1, 3.7, 3.9]),
                                         max_peak_increase=0.10))  # the equal-memory limit the test reads
    sched = ScheduleConfig(gpu_fraction=6 / 14, overlap_backward=True, cpu_threads=space.lane_threads,
                           resident_subgroups=1, expected_subgroups=14)
    p = space.scored(space.candidate_of(100_000_000, sched), 1)
    return res.model_copy(update={"top": [trial_record(space, p)] + res.top[:2]}), space


def test_the_neighbourhood_moves_each_main_knob_one_step_either_way(tuned):
    res, space = tuned
    pick = ScheduleConfig.model_validate(res.top[0].schedule)
    limit = space.max_peak_gib
    try:
        space.max_peak_gib = None  # no peak limit: every neighbour fits
        found, left_out = space.neighbours(100_000_000, pick)
    finally:
        space.max_peak_gib = limit
    labels = [label for label, _ in found]
    assert labels == ["GPU lane 5/14", "GPU lane 7/14", "sub_group_size 5e+07", "sub_group_size 2e+08", "0 resident",
                      "2 resident", "overlap_backward off"]
    assert left_out == []
    by = dict(found)
    for label in ("GPU lane 5/14", "GPU lane 7/14"):
        s = by[label].schedule
        assert (s.resident_subgroups, s.overlap_backward, by[label].sub_group_size) == (1, True, 100_000_000)
    assert [by[k].schedule.resident_subgroups for k in ("0 resident", "2 resident")] == [0, 2]
    assert by["0 resident"].schedule.gpu_fraction == pick.gpu_fraction
    off = by["overlap_backward off"].schedule
    assert not off.overlap_backward and off.adaptive_swing == 0 and off.gpu_fraction == pick.gpu_fraction
    # another sub_group_size keeps the GPU lane's share of the elements, as many resident as the limits allow
    half = by["sub_group_size 5e+07"]
    n = len(half.sizes)
    assert half.sub_group_size == 50_000_000 and abs(gpu_count(n, half.schedule.gpu_fraction) / n - 6 / 14) < 0.05
    # the tune's peak limit (ZeRO-Offload's peak and 10%) leaves a second resident subgroup out, and says by how much
    found, left_out = space.neighbours(100_000_000, pick)
    over = by["2 resident"].memory.peak_gpu_gib - limit
    assert [label for label, _ in found] == [x for x in labels if x != "2 resident"]
    assert left_out == [f"2 resident: predicted over the peak GPU memory limit by {over:.2f} GiB"]
    assert all(space.feasible(p) for _, p in found)


class BySchedule:
    """Measures each dostune schedule's iteration from its GPU lane's size (``fast``: that many GPU-lane subgroups
    runs 0.40 s, each one away 0.02 s slower), ZeRO-Offload at 1.5 s; remembers what it was asked."""

    def __init__(self, fast: int):
        self.fast, self.calls = fast, []

    def __call__(self, name, spec, opts, offload, progress):
        self.calls.append((name, opts, offload))
        if name == "zero-offload":
            it = 1.5
        else:
            sched = offload.schedule
            n = sched.expected_subgroups
            it = 0.40 + 0.02 * abs(gpu_count(n, sched.gpu_fraction) * 14 // n - self.fast)
        samples = {"fwd": [0.1], "bwd": [0.2], "step": [it - 0.3], "iter": [it]}
        return MethodResult(method=name, description="", iter_s=it, fwd_s=0.1, bwd_s=0.2, step_s=it - 0.3,
                            peak_gpu_gib=20.0, samples=samples, round_iter_s=[it], round_step_s=[it - 0.3])


def _neighbours(tuned):
    res, space = tuned
    found, _ = space.neighbours(res.top[0].sub_group_size, ScheduleConfig.model_validate(res.top[0].schedule))
    return [(label, trial_record(space, p)) for label, p in found]


def test_the_pick_and_its_neighbours_run_in_one_interleaved_run_and_give_its_regret(tuned):
    res, _ = tuned
    near = _neighbours(tuned)
    bench = BySchedule(fast=7)  # the neighbour with one more GPU-lane subgroup measures fastest
    run = validate(res, 0, seq=1024, rounds=2, runner=bench, host_available=120 * 2**30, neighbours=near, clip=1.0)
    labels = ["dostune #1"] + [f"neighbour: {label}" for label, _ in near]
    assert [v.label for v in run.rows] == labels and len(run.rows) >= 6
    # one run: every method once a round, the order reversed in the second, clipping at 1.0 for each
    names = [c[2].schedule.model_dump_json() for c in bench.calls]
    assert names[len(labels):] == names[:len(labels)][::-1]
    assert all(opts.clip == 1.0 and opts.train.clip == 1.0 for _, opts, _ in bench.calls)
    assert run.bench.clip == 1.0
    # each row beside the prediction of the regime its runs were in: the profile's norms clip at 1.0
    pick = run.rows[0]
    assert all(v.regime == "clip" for v in run.rows)
    assert pick.predicted_iter_s == pytest.approx(res.top[0].iter_in("clip"))
    assert next(v for v in run.rows if v.neighbour == "GPU lane 7/14").predicted_iter_s == pytest.approx(
        dict(near)["GPU lane 7/14"].iter_in("clip"))
    # regret: the pick's pooled median over the fastest measured
    assert run.regret == pytest.approx(0.42 / 0.40) and run.regret_best == "neighbour: GPU lane 7/14"
    # clipping off: the no-clip predictions
    off = validate(res, 0, seq=1024, rounds=1, runner=BySchedule(fast=6), host_available=120 * 2**30, neighbours=near)
    assert all(v.regime == "no_clip" for v in off.rows) and off.regret == 1.0 and off.regret_best == "dostune #1"
    assert off.rows[0].predicted_iter_s == pytest.approx(res.top[0].iter_in("no_clip"))
    assert off.rows[0].predicted_iter_s < pick.predicted_iter_s  # the pick overlaps backward: clipping costs it
    # with --validate N as well: ZeRO-Offload and the N best first, then the neighbours, in the same rounds
    both = validate(res, 2, seq=1024, rounds=1, runner=BySchedule(fast=6), host_available=120 * 2**30,
                    neighbours=near)
    assert [v.label for v in both.rows][:3] == ["zero-offload", "dostune #1", "dostune #2"]
    assert len(both.rows) == 3 + len(near) and both.rows[0].regime is None
    # without neighbours no regret is claimed
    assert validate(res, 1, seq=1024, rounds=1, runner=BySchedule(fast=6), host_available=120 * 2**30).regret is None
    assert regret([]) == (None, None)


def test_tune_neighbours_writes_the_regret_and_prints_the_neighbourhood(tmp_path, monkeypatch):
    import dostune.tune.validate as validate_module

    monkeypatch.setattr("dostune.cli.tune.cuda_available", lambda: True)
    monkeypatch.setattr(validate_module, "validate", lambda res, n, **kw: validate(
        res, n, **kw, runner=BySchedule(fast=0), host_available=120 * 2**30))
    r = CliRunner().invoke(app, ["tune", "--trials", "6", "--output-dir", str(tmp_path), "--neighbours",
                                 "--validate-rounds", "1", "--validate-clip", "1.0", "--regime", "no-clip"])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.translate({ord(c): " " for c in "│┃"}).split())
    res = TuneResult.model_validate_json((tmp_path / "tune.json").read_text())
    assert res.validation_clip == 1.0 and res.regret is not None and res.regret >= 1.0
    rows = [v for v in res.validation if v.method == "dostune"]
    assert rows[0].label == "dostune #1" and len(rows) >= 6 and all(v.neighbour for v in rows[1:])
    assert res.regret == pytest.approx(rows[0].measured_iter_s / min(v.measured_iter_s for v in rows))
    assert "the pick and its neighbours, measured (clipping at 1)" in flat
    if res.regret_best == "dostune #1":
        assert "regret 1.00x: the pick measured fastest of the" in flat and "schedules measured" in flat
    else:
        assert f"regret {res.regret:.2f}x: the pick measured {res.regret - 1:.1%} slower than {res.regret_best}" in flat
