"""The maintainer tools beside the package (tools/): the report across validations, today's model on validations
already measured, the traced CPU lane against the model's, and the registry of held-out shapes, on validations
made here by `dostune tune --validate` with a fake measurement in place of the GPU runs."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dostune.models.registry import PRESETS
from dostune.profile.paths import shipped_profile
from dostune.records import Span
from dostune.tune.record import TuneResult
from dostune.tune.search import TuneOptions, run_tune
from dostune.tune.validate import validate
from test_validate import FakeBench, _tune_validate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tools, beside the package
from tools import lane_check, repredict, validation_report  # noqa: E402

HOST = 120 * 2**30


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    res, _, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=12,
                                     output_dir=tmp_path_factory.mktemp("tune")))
    return res


def _validated(tuned, n=2, rounds=1, scale=(1.0, 1.05, 1.1)) -> TuneResult:
    res = tuned.model_copy(deep=True)
    res.validation = validate(res, n, seq=1024, rounds=rounds, runner=FakeBench(scale), host_available=HOST).rows
    return res


def test_the_report_has_a_row_per_model_and_method_and_fails_a_model_out_of_bounds(tuned, tmp_path):
    res = _validated(tuned)
    res.profile_steal, res.profile_set_aside = 0.05, 2
    off = _validated(tuned, n=1, scale=(1.0, 2.0, 1.0))
    off.model = "other"
    paths = [tmp_path / "a.json", tmp_path / "off.json"]
    for path, r in zip(paths, (res, off)):
        path.write_text(r.model_dump_json())
    out = tmp_path / "report.md"
    code = validation_report.main([*map(str, paths), "--output", str(out)])
    text = out.read_text()
    rows = validation_report.summarize([res, off])
    assert [(r["model"], r["method"]) for r in rows] == [("gpt2-1.3b", "dostune"), ("gpt2-1.3b", "zero-offload"),
                                                          ("other", "dostune"), ("other", "zero-offload")]
    assert code == 1 and not rows[3]["ok"] and "| other | 1.31B | zero-offload | 1 |" in text and "| NO |" in text
    # each median error beside the same in milliseconds, the host's drift, its steal and what was set aside for it
    d = rows[0]
    assert d["step_s"] == pytest.approx(res.median_error_s("step", "dostune"))
    assert f"| {d['iter']:.1%} ({1e3 * d['iter_s']:.0f} ms) | {d['step']:.1%} ({1e3 * d['step_s']:.0f} ms) |" in text
    assert rows[0]["drift"] == rows[1]["drift"] == res.host_drift()
    assert f"| {res.host_drift():.2f}x | 5.0% / 1.5% | 2 / 1 |" in text
    assert "host steal, profile / runs |" in text and "set aside, profile / runs |" in text
    # validations from before the steal and the rounds were recorded keep the table they had
    old = res.model_copy(update={"profile_steal": None, "profile_set_aside": None, "validation": [
        v.model_copy(update={"measured_steal": None, "set_aside": None}) for v in res.validation]})
    table = validation_report.markdown(validation_report.summarize([old]))
    assert "host steal" not in table and "set aside" not in table and "rounds apart" not in table
    assert validation_report.main([str(tmp_path / "missing.json")]) == 2


def test_the_report_holds_each_round_to_the_bounds_as_the_prediction_of_the_others(tuned):
    # FakeBench's host runs 10% slower on each later call of a method: rounds at x1.0, x1.1, x1.2
    res = _validated(tuned, n=2, rounds=3, scale=(1.0, 1.0, 1.0))
    table = validation_report.markdown(validation_report.summarize([res]))
    assert "| rounds apart |" in table and "| 20.0% / 20.0% |" in table
    # the first round (x1.0) against the others' median (x1.15) is off by 1 - 1 / 1.15; the second is that median
    first = next(v for v in res.validation if v.method == "dostune")
    assert validation_report.repeat_error(first, "iter", 0) == pytest.approx(1 - 1.0 / 1.15)
    assert validation_report.repeat_error(first, "step", 1) == pytest.approx(0.0)
    assert validation_report.repeat_error(first, "iter", 3) is None
    assert validation_report.repeat_median_error(res, "iter", "dostune", 0) == pytest.approx(1 - 1.0 / 1.15)
    assert validation_report.summarize([res])[0]["repeat"] == (False, True)
    assert "| a round as the other's |" in table and "| NO / yes |" in table
    single = _validated(tuned, n=1, rounds=1)
    assert validation_report.repeat_median_error(single, "iter", "dostune", 0) is None
    # across validations: by the prediction, and, where every row ran two rounds or more, by each round as the
    # others' prediction (the first round misses here, the second does not)
    rows = validation_report.summarize([res, single])
    assert validation_report.tally(rows) == {"models": 2, "within": sum(
        all(r["ok"] for r in rows if r["index"] == i) for i in (0, 1)), "repeated": 1,
        "repeated_within": int(all(r["ok"] for r in rows if r["index"] == 0)), "repeat_within": (0, 1)}
    assert "Of the 1 whose every row ran two rounds or more:" in validation_report.markdown(rows)
    assert "two rounds or more" not in validation_report.markdown(validation_report.summarize([single, single]))


def test_the_reports_table_counts_the_rows_whose_swing_moved(tuned):
    from test_validate import Swings

    res = tuned.model_copy(update={"validation": validate(tuned, 3, seq=1024, rounds=2, runner=Swings((1, 1, 1)),
                                                          host_available=HOST).rows})
    table = validation_report.markdown(validation_report.summarize([res]))
    assert "| swing moved |" in table and table.count("| 1 of 2 |") == 1
    assert table.splitlines()[-1].split("|")[-3].strip() == "-"  # ZeRO-Offload has no swing
    assert "swing" not in validation_report.markdown(validation_report.summarize([_validated(tuned, n=1)]))


def test_a_record_naming_the_registrys_old_module_reads_with_the_new(tuned, tmp_path):
    path = tmp_path / "old.json"
    path.write_text(tuned.model_copy(update={"model": "examples.validation_shapes:gpt2_0_9b"}).model_dump_json())
    assert validation_report.load(path).model == "tools.validation_shapes:gpt2_0_9b"


def test_a_repredicted_validation_is_what_tune_predicted_with_the_same_model(tuned):
    res = _validated(tuned, n=3, scale=(1.1, 0.9, 1.3))
    again = repredict.repredict(res.model_copy(update={"validation": [v.model_copy(update={
        "predicted_fwd_s": None, "predicted_bwd_s": None, "predicted_step_s": 0.0, "predicted_iter_s": None,
        "predicted_peak_gpu_gib": None}) for v in res.validation]}), Path(res.node_profile), Path(res.model_profile))
    assert [v.label for v in again.validation] == [v.label for v in res.validation]
    for before, now in zip(res.validation, again.validation):
        for ph in ("fwd", "bwd", "step", "iter"):
            assert now.predicted(ph) == pytest.approx(before.predicted(ph), rel=1e-9), (before.label, ph)
        assert now.predicted_peak_gpu_gib == pytest.approx(before.predicted_peak_gpu_gib, rel=1e-9)
        assert now.measured_iter_s == before.measured_iter_s
    assert again.ds_offload.iter_s == pytest.approx(res.ds_offload.iter_s, rel=1e-9)


def test_a_moved_validation_finds_the_profiles_beside_it(tuned, tmp_path, capsys):
    """Where tune's recorded paths are gone: the model profile beside the tune.json, and of the node profiles there
    the one created last before the tune."""
    res = tuned.model_copy(update={"node_profile": "/gone/node.json", "model_profile": "/gone/m.json",
                                   "created": "2026-05-02T10:00:00+00:00"})
    path = tmp_path / "shape.json"
    path.write_text(res.model_dump_json())
    assert validation_report.main(["--repredict", str(path)]) == 2
    assert "its model profile is neither at" in capsys.readouterr().err
    (tmp_path / "shape-profile.json").write_text("{}")
    for name, created in (("node-a.json", "2026-05-01T10:00:00+00:00"), ("node-b.json", "2026-05-02T09:00:00+00:00"),
                          ("node-c.json", "2026-05-03T10:00:00+00:00")):
        (tmp_path / name).write_text(json.dumps({"created": created}))
    assert repredict.profiles_of(res, path) == (tmp_path / "node-b.json", tmp_path / "shape-profile.json")


class Traced(FakeBench):
    """FakeBench whose schedules record a traced step: the CPU lane on two subgroups, one taken up during backward
    (before the step's start) and one in the step."""

    def __call__(self, name, spec, opts, offload, progress):
        got = super().__call__(name, spec, opts, offload, progress)
        if name == "dostune" and got.ran:
            got = got.model_copy(update={"timeline": [Span(lane="cpu", subgroup=0, start=-0.02, end=-0.01),
                                                      Span(lane="cpu", subgroup=1, start=0.0, end=0.03)]})
        return got


def test_the_lane_check_splits_a_rows_step_error_into_the_lanes_end_and_what_follows(tmp_path, monkeypatch, capsys):
    _, res = _tune_validate(tmp_path, monkeypatch, 1, 1, bench=Traced)
    rows = lane_check.check(tmp_path / "tune.json")
    [row] = rows
    v = next(v for v in res.validation if v.label == "dostune #1")
    assert row.label == "dostune #1" and row.backward_rate > 0 and row.step_rate > 0
    # predicted from the profiles the tune read, so the re-prediction is the recorded one
    assert row.step_error_s == pytest.approx(v.predicted_step_s - v.measured_step_s, abs=1e-9)
    assert row.lanes_end_s + row.after_lanes_s == pytest.approx(row.step_error_s, abs=1e-12)
    assert lane_check.main([str(tmp_path / "tune.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + 1 + 1 and out[-1].startswith("| median of 1 rows |")
    # without its bench record: one line, exit 2
    lonely = tmp_path / "lonely.json"
    lonely.write_text(res.model_copy(update={"validation_bench": str(tmp_path / "gone.json")}).model_dump_json())
    assert lane_check.main([str(lonely)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bench record is neither at" in err and len(err.splitlines()) == 1


def test_no_held_out_shape_repeats_an_architecture_but_those_named():
    # a held-out shape is unseen only if no earlier shape or preset has its architecture: a new shape that repeats one
    # fails here, and so does a repeat named in REPEATS that is not one
    from tools.validation_shapes import REPEATS, SHAPES

    def architecture(cfg):
        return tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "max_positions")

    first: dict = {}
    for name, cfg in [*PRESETS.items(), *SHAPES.items()]:
        key = architecture(cfg)
        if key in first:
            assert REPEATS.get(name) == first[key], f"{name} repeats {first[key]}'s architecture"
        else:
            assert name not in REPEATS, f"{name} is named a repeat of {REPEATS[name]} but is not one"
            first[key] = name
    assert set(REPEATS) <= set(SHAPES)
