import json

import pytest

from dostune.errors import ProfileError
from dostune.profile.node import NodeProfileOptions, measure_node
from dostune.profile.record import (NODE_SCHEMA_VERSION, LinearCost, Sample, fit_series, load_node_profile,
                                    node_profile_schema)
from dostune.records import save_record
from dostune.stats import Stat, linear_fit, upper_middle


@pytest.fixture(scope="module")
def tiny_profile():
    return measure_node(NodeProfileOptions.tiny(), command="pytest")


def test_linear_fit_recovers_line():
    a, b, r2 = linear_fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert a == pytest.approx(1) and b == pytest.approx(2) and r2 == pytest.approx(1)


def test_fit_series_has_bandwidth_and_overhead():
    pts = [Sample(size=s, seconds=Stat.of([1e-5 + s / 50e9])) for s in (4 << 20, 64 << 20, 1 << 30)]
    s = fit_series("bytes", pts)
    assert s.fit.rate_per_s == pytest.approx(50e9, rel=1e-6)
    assert s.fit.overhead_s == pytest.approx(1e-5, rel=1e-3)
    assert s.fit.time(1 << 30) == pytest.approx(1e-5 + (1 << 30) / 50e9)


def test_fit_series_never_reports_negative_overhead():
    pts = [Sample(size=s, seconds=Stat.of([t])) for s, t in ((1000, 1e-7), (2000, 5e-7), (4000, 9e-7))]
    s = fit_series("elements", pts)
    assert s.fit.overhead_s == 0 and s.fit.rate_per_s > 0


def test_stat_of_reports_median_and_spread():
    s = Stat.of([3.0, 1.0, 2.0])
    assert (s.median, s.lo, s.hi, s.n) == (2.0, 1.0, 3.0, 3)
    assert s.rel_spread == pytest.approx(0.5)


def test_upper_middle_is_a_measured_sample():
    assert upper_middle([3.0, 1.0, 2.0]) == 2.0
    # an even count gives the upper of the two middle samples, not their mean (Stat.of's median)
    assert upper_middle([4.0, 1.0, 3.0, 2.0]) == 3.0
    assert Stat.of([4.0, 1.0, 3.0, 2.0]).median == 2.5
    with pytest.raises(ValueError):
        upper_middle([])


def test_the_modes_repeats_and_the_record_says_which_measured_it(tiny_profile):
    # --thorough: the repeats of every node profile measured before the modes; the default takes fewer
    assert (NodeProfileOptions().mode, NodeProfileOptions().repeats) == ("standard", 3)
    assert (NodeProfileOptions.thorough().mode, NodeProfileOptions.thorough().repeats) == ("thorough", 5)
    assert tiny_profile.mode == "quick" and tiny_profile.repeats == 2


def test_profile_goes_to_profiles_where_tune_looks_for_it(tmp_path, monkeypatch):
    """`dostune profile` writes profiles/NODE.json in the current folder, and the node profile `dostune tune` takes
    by default (on a GPU machine) is that file; until it exists, a one-line error says how to make it."""
    import os

    from typer.testing import CliRunner

    from dostune.cli.app import app
    from dostune.profile.paths import measured_node_profile

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError, match="`dostune profile` writes this node's profile there") as e:
        measured_node_profile()
    assert "dostune profile" in e.value.hint
    r = CliRunner().invoke(app, ["profile", "--quick"])
    assert r.exit_code == 0, r.output
    written = tmp_path / "profiles" / f"cpu-{os.cpu_count()}c.json"
    assert load_node_profile(written).name == written.stem and measured_node_profile().resolve() == written
    r = CliRunner().invoke(app, ["profile", "--quick", "--thorough"])
    assert r.exit_code == 2 and "contradict" in r.output


def test_cpu_measurements_on_tiny_sizes(tiny_profile):
    p = tiny_profile
    assert p.schema_version == NODE_SCHEMA_VERSION
    assert p.cpu_adam.best_threads in p.cpu_adam.by_threads
    series = p.cpu_adam.by_threads[p.cpu_adam.best_threads]
    assert [pt.size for pt in series.points] == [100_000, 400_000]
    assert all(pt.seconds.median > 0 and pt.seconds.n == 2 for pt in series.points)
    # DeepSpeedCPUAdam does at least 50 M elements/s even on a tiny, busy CI core
    assert series.fit.rate_per_s > 5e7
    assert p.convert.cpu.fit.rate_per_s > 5e7


def test_no_gpu_is_reported_not_crashed(tiny_profile):
    import torch

    if torch.cuda.is_available():
        pytest.skip("machine has a GPU")
    p = tiny_profile
    assert p.gpu is None and p.copies is None and p.gpu_adam is None and p.convert.gpu is None
    assert any("GPU measurements not available" in n for n in p.notes)
    assert not p.has_gpu


def test_round_trip(tiny_profile, tmp_path):
    path = save_record(tiny_profile, tmp_path / "p.json")
    again = load_node_profile(path)
    assert again == tiny_profile
    assert json.loads(path.read_text())["kind"] == "dostune.node-profile"


def _write(tmp_path, data):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return f


def test_load_errors_name_the_problem(tiny_profile, tmp_path):
    good = json.loads(tiny_profile.model_dump_json())

    with pytest.raises(ProfileError, match="does not exist"):
        load_node_profile(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_node_profile(_write(tmp_path, "{nope"))
    with pytest.raises(ProfileError, match="schema_version"):
        load_node_profile(_write(tmp_path, {k: v for k, v in good.items() if k != "schema_version"}))
    with pytest.raises(ProfileError, match="older dostune"):
        load_node_profile(_write(tmp_path, {**good, "schema_version": 0}))

    broken = json.loads(json.dumps(good))
    del broken["cpu_adam"]["best_threads"]
    with pytest.raises(ProfileError, match=r"field 'cpu_adam.best_threads'"):
        load_node_profile(_write(tmp_path, broken))

    broken = json.loads(json.dumps(good))
    broken["host"]["logical_cores"] = "many"
    with pytest.raises(ProfileError, match=r"field 'host.logical_cores'"):
        load_node_profile(_write(tmp_path, broken))

    with pytest.raises(ProfileError, match="unexpected|Extra inputs"):
        load_node_profile(_write(tmp_path, {**good, "typo_field": 1}))


def test_schema_is_json_schema():
    schema = node_profile_schema()
    assert schema["title"] == "NodeProfile"
    assert "copies" in schema["properties"]


def test_linear_cost_time():
    c = LinearCost(overhead_s=1e-3, rate_per_s=1e9, r2=1.0)
    assert c.time(1e9) == pytest.approx(1.001)
def test_the_shipped_node_profiles_load():
    from dostune.profile.paths import shipped_profile

    p = load_node_profile(shipped_profile())  # the default
    assert p.has_gpu and "H200" in p.gpu.name
    p = load_node_profile(shipped_profile("h100-pcie5.json"))
    assert p.has_gpu and "H100" in p.gpu.name




def test_written_files_get_the_usual_mode(tmp_path):
    """Not mkstemp's 0600: a profile or a result is for others to read (0644 under the common umask 022)."""
    import os

    from dostune import records as record

    old = os.umask(0o022)
    record._file_mode.cache_clear()
    try:
        path = record.atomic_write_text(tmp_path / "sub" / "x.json", "{}\n")
    finally:
        os.umask(old)
        record._file_mode.cache_clear()
    assert path.stat().st_mode & 0o777 == 0o644 and path.read_text() == "{}\n"
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary file left


def test_rate_under_load_compares_the_chunks_inside_and_after_the_busy_window():
    from dostune.profile.throughput import rate_under_load

    # 1 ms chunks while the host computes in [0, 4 ms], 0.5 ms chunks after it
    ends = [0.001, 0.002, 0.003, 0.004, 0.0045, 0.005, 0.0055]
    assert rate_under_load(ends, 0.0, 0.004) == pytest.approx(0.5)
    # a chunk straddling either edge counts for neither side
    assert rate_under_load(ends, 0.0005, 0.004) == pytest.approx(0.5)
    assert rate_under_load(ends, 0.0, 0.0042) == pytest.approx(0.5)
    assert rate_under_load(ends, 0.0, 0.0053) is None  # fewer than two chunks after it
    assert rate_under_load(ends, 0.0025, 0.004) is None  # fewer than two inside it
