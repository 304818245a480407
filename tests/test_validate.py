"""`dostune tune --validate`: the rows it records, its figure and what the command prints, on the CPU with a fake
measurement in place of the bench's GPU runs (which tests/test_gpu.py and scripts/gpu-bench.sh validate:MODEL run)."""
import json

import pytest

from dostune.bench.record import MethodResult
from dostune.errors import DostuneError, NotAvailable
from dostune.profile.paths import shipped_profile
from dostune.records import SetAside
from dostune.tune.record import TuneResult
from dostune.tune.search import TuneOptions, run_tune
from dostune.tune.validate import validate, validation_details
from dostune.tune.validation_figure import plot_validation


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    # scored without clipping, the regime of the validation's runs with clipping off (tests/test_tune_regime.py runs it
    # with clipping on)
    res, _, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=12, regime="no-clip",
                                     output_dir=tmp_path_factory.mktemp("tune")))
    return res


class FakeBench:
    """Measures each method as its prediction times ``scale`` (per phase), and remembers what it was asked to run."""

    def __init__(self, scale):
        self.scale, self.calls = scale, []

    def __call__(self, name, spec, opts, offload, progress):
        self.calls.append((name, opts, offload))
        k = len(self.calls) - 1
        if name == "dostune" and k == 2:
            return MethodResult(method=name, description="", ran=False, error="out of memory")
        f, b, s = self.scale
        base = (0.13, 0.25, 1.14) if name == "zero-offload" else (0.13, 0.24, 0.12)
        fwd, bwd, step = base[0] * f, base[1] * b, base[2] * s
        # later calls of a method run slower by 10% a call: a host that drifts
        drift = 1.0 + 0.1 * sum(c[2] is offload for c in self.calls[:-1])
        samples = {"fwd": [fwd * drift], "bwd": [bwd * drift], "step": [step * drift],
                   "iter": [(fwd + bwd + step) * drift]}
        steal = 0.01 * (k + 1)  # a made-up share of CPU time the hypervisor took, one per call
        aside = SetAside(runs=k, steal=[0.05] * k, seconds=[1.0] * k)  # and as many iterations set aside for it
        return MethodResult(method=name, description="", iter_s=samples["iter"][0], fwd_s=samples["fwd"][0],
                            bwd_s=samples["bwd"][0], step_s=samples["step"][0], peak_gpu_gib=20.0, samples=samples,
                            round_iter_s=samples["iter"], round_step_s=samples["step"], steal=steal,
                            round_steal=[steal], set_aside=aside)


def test_validate_records_every_phase_of_zero_offload_and_each_schedule(tuned):
    bench = FakeBench((1.1, 0.9, 1.5))
    rows = validate(tuned, 3, seq=1024, rounds=1, runner=bench, host_available=120 * 2**30).rows
    names = [c[0] for c in bench.calls]
    assert names == ["zero-offload", "dostune", "dostune", "dostune"]
    # clipping off: the model predicts steps that do not clip; ZeRO-Offload pinned where the host holds it,
    # dostune's own pinning in place (DeepSpeed's pin_memory off) with the tuned schedule
    for _, opts, off in bench.calls:
        assert opts.clip == 0.0 and opts.train.clip == 0.0 and opts.micro_batch == tuned.micro_batch
    assert bench.calls[0][2].pin_memory and bench.calls[0][2].sub_group_size == tuned.ds_sub_group_size
    assert not bench.calls[1][2].pin_memory and bench.calls[1][2].schedule.trace
    assert bench.calls[1][2].sub_group_size == tuned.top[0].sub_group_size
    # the schedule that failed to run is left out, not recorded as a measurement
    assert [v.label for v in rows] == ["zero-offload", "dostune #1", "dostune #3"]
    zo, first = rows[0], rows[1]
    assert zo.method == "zero-offload" and first.method == "dostune" and first.schedule == tuned.top[0].schedule
    assert zo.predicted_step_s == tuned.ds_offload.step_s and first.predicted_bwd_s == tuned.top[0].predicted.bwd_s
    assert first.measured_bwd_s == pytest.approx(0.24 * 0.9)
    assert first.error("fwd") == pytest.approx(abs(tuned.top[0].predicted.fwd_s - 0.143) / 0.143)
    assert first.step_error == pytest.approx(abs(first.predicted_step_s - 0.18) / 0.18)


def test_validate_rounds_alternate_the_order_and_pool_every_round(tuned):
    bench = FakeBench((1.0, 1.0, 1.0))
    run = validate(tuned, 2, seq=1024, rounds=3, runner=bench, host_available=120 * 2**30)
    # ZeRO-Offload, #1, #2 (fails in its first round: not run again), then reversed, then forward again
    order = [(c[0], c[2].sub_group_size, (c[2].schedule.gpu_fraction if c[2].schedule else None)) for c in bench.calls]
    zo, one, two = order[0], order[1], order[2]
    assert order == [zo, one, two, one, zo, zo, one]
    assert [c[1].rounds for c in bench.calls] == [3] * 7
    rows = run.rows
    assert [v.label for v in rows] == ["zero-offload", "dostune #1"]
    # the median of the three rounds' samples (x1.0, x1.1, x1.2 as the host drifts), not the first round's
    assert rows[0].measured_step_s == pytest.approx(1.14 * 1.1)
    assert rows[1].measured_bwd_s == pytest.approx(0.24 * 1.1)
    # the bench record keeps every method's pooled samples, the failed one with its error
    assert run.bench.rounds == 3 and run.bench.clip == 0.0 and run.bench.model == tuned.model
    assert sorted(run.bench.methods) == ["dostune #1", "dostune #2", "zero-offload"]
    assert run.bench.methods["dostune #1"].samples["iter"] == pytest.approx([0.49, 0.49 * 1.1, 0.49 * 1.2])
    assert not run.bench.methods["dostune #2"].ran and run.bench.methods["dostune #2"].error == "out of memory"
    # each row keeps its rounds' own medians, each round a fresh process: how far the measurement moved between them
    assert rows[0].measured_round_step_s == pytest.approx([1.14, 1.14 * 1.1, 1.14 * 1.2])
    assert rows[1].measured_round_iter_s == pytest.approx([0.49, 0.49 * 1.1, 0.49 * 1.2])
    assert rows[1].round_spread("iter") == pytest.approx(0.2) and rows[0].round_spread("step") == pytest.approx(0.2)
    res = tuned.model_copy(update={"validation": rows})
    assert res.round_spread("step", "dostune") == pytest.approx(0.2)
    assert any(line.startswith("the same schedule measured in separate processes differed by dostune 20.0% / 20.0%, "
                               "zero-offload 20.0% / 20.0%") for line in validation_details(res))
    one_round = validate(tuned, 1, seq=1024, rounds=1, runner=FakeBench((1.0, 1.0, 1.0)), host_available=120 * 2**30)
    assert one_round.rows[0].round_spread("iter") is None
    single = tuned.model_copy(update={"validation": one_round.rows})
    assert single.round_spread("iter") is None
    assert not any("separate processes" in line for line in validation_details(single))
    with pytest.raises(DostuneError, match="at least 1 round"):
        validate(tuned, 1, seq=1024, rounds=0, runner=bench, host_available=120 * 2**30)


def test_validate_runs_zero_offload_pageable_where_the_host_cannot_pin_it(tuned):
    bench = FakeBench((1.0, 1.0, 1.0))
    rows = validate(tuned, 1, seq=1024, rounds=1, runner=bench, host_available=26 * 2**30).rows
    assert not bench.calls[0][2].pin_memory and "pin_memory false" in rows[0].label
    bench = FakeBench((1.0, 1.0, 1.0))
    rows = validate(tuned, 1, seq=1024, rounds=1, runner=bench,
                    host_available=2 * 2**30).rows  # not even pageable: not run
    assert [c[0] for c in bench.calls] == ["dostune"] and rows[0].method == "dostune"


def test_validate_needs_a_gpu_without_a_runner(tuned):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(NotAvailable, match="needs a CUDA GPU"):
        validate(tuned, 1, seq=1024)


def test_figure_record_and_what_the_host_did(tuned, tmp_path):
    res = tuned.model_copy(deep=True)
    res.validation = validate(res, 2, seq=1024, rounds=1, runner=FakeBench((1.0, 1.05, 1.1)),
                              host_available=120 * 2**30).rows
    res.profile_steal, res.profile_set_aside = 0.05, 2
    png = plot_validation(res, tmp_path / "validation.png")
    assert png.stat().st_size > 10_000
    res.validation_figure = str(png)
    path = tmp_path / "tune.json"
    path.write_text(res.model_dump_json())
    again = TuneResult.model_validate_json(path.read_text())
    assert again.validation == res.validation and again.validation_figure == str(png)
    assert again.median_error("step", "zero-offload") == pytest.approx(abs(res.ds_offload.step_s - 1.254) / 1.254)
    # a tune.json of schema 2 (before the phases were recorded) still reads, and one of schema 7 (before details)
    old = json.loads(path.read_text())
    old["schema_version"] = 2
    for v in old["validation"]:
        for k in ("method", "predicted_fwd_s", "predicted_bwd_s", "measured_fwd_s", "measured_bwd_s",
                  "predicted_peak_gpu_gib", "measured_steal", "set_aside", "measured_round_iter_s",
                  "measured_round_step_s"):
            del v[k]
    del old["validation_figure"], old["profile_steal"], old["profile_set_aside"], old["details"]
    assert TuneResult.model_validate(old).median_iter_error is not None
    # the host's drift: ZeRO-Offload measured (x1.0, x1.05, x1.1 per phase here) over the profile's measurement of it
    zo = res.ds_offload
    drift = (0.13 + 0.25 * 1.05 + 1.254) / zo.iter_s
    assert again.host_drift("step") == pytest.approx(1.254 / zo.step_s)
    assert again.host_drift() == pytest.approx(drift)
    # the host's steal: the profile's, and the mean of the validated runs' (FakeBench: 1% and 2% here, one failed)
    assert [v.measured_steal for v in again.validation] == [0.01, 0.02]
    assert again.profile_steal == 0.05 and again.validation_steal() == pytest.approx(0.015)
    # and the timed iterations set aside for it: the profile's 2, the runs' 0 and 1 (FakeBench)
    assert [v.set_aside for v in again.validation] == [0, 1] and again.validation_set_aside() == 1
    details = validation_details(again)
    assert f"ZeRO-Offload ran {drift:.2f}x the iteration its model profile measured" in details[2]
    assert details[-1] == ("the hypervisor took 5.0% of the CPU while the model profile timed its iterations (2 timed "
                           "iterations set aside for it) and 1.5% over the validated runs (1 timed iteration set aside "
                           "for it): CPU work runs slower under steal, so a difference between the two moves every "
                           "error; profile and validate when the host is quiet")
    no_zo = again.model_copy(update={"validation": [v for v in again.validation if v.method == "dostune"]})
    assert no_zo.host_drift() is None and not any("ZeRO-Offload ran" in line for line in validation_details(no_zo))


def _tune_validate(tmp_path, monkeypatch, n: int, rounds: int, bench=FakeBench, flags=()):
    """`dostune tune --validate N` with FakeBench's made-up measurements where no GPU is: its output, and the
    tune.json it wrote."""
    from typer.testing import CliRunner

    import dostune.tune.validate as validate_module
    from dostune.cli.app import app

    monkeypatch.setattr("dostune.cli.tune.cuda_available", lambda: True)
    monkeypatch.setattr(validate_module, "validate", lambda res, n, **kw: validate(
        res, n, **kw, runner=bench((1.0, 1.0, 1.5)), host_available=120 * 2**30))
    r = CliRunner().invoke(app, ["tune", "--trials", "6", "--output-dir", str(tmp_path), "--validate", str(n),
                                 "--validate-rounds", str(rounds), *flags])
    assert r.exit_code == 0, r.output
    # the output on one line, without the table's borders
    flat = " ".join(r.output.translate({ord(c): " " for c in "│┃"}).split())
    return flat, TuneResult.model_validate_json((tmp_path / "tune.json").read_text())


def test_tune_validate_prints_measured_beside_predicted_and_keeps_the_rest_in_tune_json(tmp_path, monkeypatch):
    """One table: each validated row's measured iteration, its speedup over ZeRO-Offload's and the prediction's
    error beside the prediction; what the host did is in tune.json's details, and printed with --verbose."""
    # the H100 profiles: their model profile predates the steal
    older = ["--profile", str(shipped_profile("h100-pcie5.json"))]
    out, res = _tune_validate(tmp_path, monkeypatch, 1, 1, flags=older)
    assert [v.method for v in res.validation] == ["zero-offload", "dostune"]
    zo, first = res.validation
    assert "measured s measured speedup error" in out
    assert (f"dostune #1 (config) {first.sub_group_size:.3g}" in out
            and f"{first.measured_iter_s:.3f} {zo.measured_iter_s / first.measured_iter_s:.2f}x "
                f"{first.predicted_iter_s / first.measured_iter_s - 1:+.1%}" in out)
    assert f"{zo.measured_iter_s:.3f} 1.00x {zo.predicted_iter_s / zo.measured_iter_s - 1:+.1%}" in out
    assert "dostune #2 " in out and "- - -" in out  # searched, not validated
    # the rest: kept, not printed
    assert res.details[-len(validation_details(res)):] == validation_details(res)
    assert "detail:" not in out and "ZeRO-Offload ran" not in out and "--verbose prints" in out
    # the model profile predates the steal; FakeBench's runs say 1% and 2%
    assert res.profile_steal is None and [v.measured_steal for v in res.validation] == [0.01, 0.02]
    assert not any("separate processes" in line for line in res.details)  # one round: nothing to compare
    assert not any("adaptive_swing moved" in line for line in res.details)  # FakeBench's schedules record no swing
    assert (tmp_path / "validation-bench.json").exists() and (tmp_path / "validation.png").exists()
    out, res = _tune_validate(tmp_path / "v", monkeypatch, 1, 1, flags=[*older, "--verbose"])
    for line in validation_details(res):
        assert f"detail: {line}" in out
    assert (f"ZeRO-Offload ran {res.host_drift():.2f}x the iteration its model profile measured (its step "
            f"{res.host_drift('step'):.2f}x)") in out
    assert ("the hypervisor took an unknown share of the CPU while the model profile timed its iterations and 1.5% "
            "over the validated runs (1 timed iteration set aside for it)") in out
    assert "measured vs predicted" in out and "predicted phase breakdown" in out


def test_tune_validate_says_how_far_its_rounds_were_apart(tmp_path, monkeypatch):
    """Two rounds, each method in a fresh process twice: how far the same schedule moved between them (FakeBench's
    host runs 10% slower on a method's second call; its #2 runs out of memory in its first round and is left out)."""
    out, res = _tune_validate(tmp_path, monkeypatch, 2, 2, flags=["--verbose"])
    assert [len(v.measured_round_iter_s) for v in res.validation] == [2, 2]
    assert ("the same schedule measured in separate processes differed by dostune 10.0% / 10.0%, zero-offload "
            "10.0% / 10.0% (iteration / step, slowest round over fastest, median over rows): errors of that size are "
            "this host's own variation; more --validate-rounds average more of it out") in out


class Swings(FakeBench):
    """FakeBench whose first schedule's swing moved GPU-lane subgroups in its timed iterations (3, 3, 4 in each
    round), whose others moved none; ZeRO-Offload has no swing."""

    def __call__(self, name, spec, opts, offload, progress):
        got = super().__call__(name, spec, opts, offload, progress)
        if name == "dostune" and got.ran:
            first = next(c[2] for c in self.calls if c[0] == "dostune")
            got = got.model_copy(update={"swing": [3, 3, 4] if offload is first else [0, 0, 0]})
        return got


def test_validate_records_the_split_the_swing_ran_and_names_the_rows_that_moved(tuned, tmp_path, monkeypatch):
    """The model predicts the tuned split; adaptive_swing may run another. Each row keeps the split of every timed
    iteration, and tune.json's details name the rows that moved, since their measured step is another split's."""
    rows = validate(tuned, 3, seq=1024, rounds=2, runner=Swings((1.0, 1.0, 1.0)), host_available=120 * 2**30).rows
    zo, first, third = rows  # (FakeBench's #2 runs out of memory)
    assert zo.measured_swing is None and zo.swung() is None
    assert first.measured_swing == [3, 3, 4, 3, 3, 4] and first.swung() == (3, 4)
    assert third.measured_swing == [0] * 6 and third.swung() is None  # recorded, but nothing moved
    _, res = _tune_validate(tmp_path, monkeypatch, 3, 1, bench=Swings)
    assert [(v.label, v.swung()) for v in res.validation] == [("zero-offload", None), ("dostune #1", (3, 4)),
                                                               ("dostune #3", None)]
    assert ("adaptive_swing moved subgroups between the lanes (+k: to the CPU lane, -k: to the GPU lane) while "
            "measuring dostune #1 (+3 typically, +4 at most): those rows ran another split than the one predicted") \
        in " ".join(res.details)
    # the GPU lane taking the CPU lane's subgroups is a move too
    lent = zo.model_copy(update={"measured_swing": [0, -2, -1]})
    assert lent.swung() == (-1, -2)


class StopsAt(FakeBench):
    """FakeBench stopped as its ``at``-th call begins: by Ctrl-C (KeyboardInterrupt), or by ``signal`` sent to this
    process; ``first_call`` sees the output directory as the first measurement starts."""

    def __init__(self, scale, at, signal=None, first_call=lambda: None):
        super().__init__(scale)
        self.at, self.signal, self.first_call = at, signal, first_call

    def __call__(self, name, spec, opts, offload, progress):
        if not self.calls:
            self.first_call()
        if len(self.calls) == self.at:
            if self.signal is None:
                raise KeyboardInterrupt
            import os

            os.kill(os.getpid(), self.signal)
        return super().__call__(name, spec, opts, offload, progress)


def test_a_stopped_validation_keeps_the_rounds_that_finished(tuned):
    # round 1: ZeRO-Offload, #1, #2 (FakeBench's third call fails: out of memory); round 2 reversed, #2 left out:
    # #1, then ZeRO-Offload, stopped as it starts
    run = validate(tuned, 2, seq=1024, rounds=2, runner=StopsAt((1.0, 1.0, 1.0), at=4), host_available=120 * 2**30)
    assert run.stopped == ("validation stopped in round 2 of 2: each row pools the rounds its method finished "
                           "(zero-offload 1, dostune #1 2, dostune #2 0)")
    assert [v.label for v in run.rows] == ["zero-offload", "dostune #1"]
    assert run.bench.methods["dostune #1"].round_iter_s and len(run.bench.methods["dostune #1"].round_iter_s) == 2
    assert len(run.bench.methods["zero-offload"].round_iter_s) == 1 and not run.bench.methods["dostune #2"].ran
    whole = validate(tuned, 2, seq=1024, rounds=2, runner=FakeBench((1.0, 1.0, 1.0)), host_available=120 * 2**30)
    assert whole.stopped is None


def test_tune_validate_stopped_by_sigterm_writes_the_config_and_what_it_measured(tmp_path, monkeypatch):
    import signal

    from typer.testing import CliRunner

    import dostune.tune.validate as validate_module
    from dostune.cli.app import app

    on_disk = []
    bench = StopsAt((1.0, 1.0, 1.0), at=2, signal=signal.SIGTERM, first_call=lambda: on_disk.extend(
        p.name for p in (tmp_path / "ds_config.json", tmp_path / "tune.json") if p.exists()))
    real = validate_module.validate
    monkeypatch.setattr("dostune.cli.tune.cuda_available", lambda: True)
    monkeypatch.setattr(validate_module, "validate", lambda res, n, **kw: real(
        res, n, **kw, runner=bench, host_available=120 * 2**30))
    before = signal.getsignal(signal.SIGTERM)
    r = CliRunner().invoke(app, ["tune", "--trials", "6", "--output-dir", str(tmp_path), "--validate", "2",
                                 "--validate-rounds", "1"])
    assert r.exit_code == 128 + signal.SIGTERM, r.output
    assert signal.getsignal(signal.SIGTERM) is before  # the command's handler is gone with it
    # the search's config and record were written before the first measurement began
    assert on_disk == ["ds_config.json", "tune.json"]
    res = TuneResult.model_validate_json((tmp_path / "tune.json").read_text())
    assert [v.label for v in res.validation] == ["zero-offload", "dostune #1"]
    assert "validation stopped in round 1 of 1: each row pools the rounds its method finished (zero-offload 1, " \
           "dostune #1 1, dostune #2 0)" in res.notes
    assert (tmp_path / "validation-bench.json").exists() and (tmp_path / "validation.png").exists()
    out = " ".join(r.output.split())
    assert "stopped during the validation (SIGTERM): the config and tune.json are written" in out
