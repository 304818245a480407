import gc
import weakref

import pytest
from typer.testing import CliRunner

import dostune.train.engine as engine_mod
from dostune.bench import run as bench_run
from dostune.bench.record import load_bench
from dostune.bench.report import markdown, plot_timeline
from dostune.cli.app import app
from dostune.errors import DostuneError


@pytest.fixture(scope="module")
def tiny_bench():
    engines = []
    real = engine_mod.build_engine

    def spy(*a, **k):
        e = real(*a, **k)
        engines.append(weakref.ref(e))
        return e

    engine_mod.build_engine = spy
    try:
        opts = bench_run.BenchOptions(model="gpt2-tiny", micro_batch=2, seq=32, iters=3, warmup=1,
                                      methods=["dostune", "zero-offload"], sub_group_size=20_000)
        res = bench_run.run_bench(opts, command="pytest")
    finally:
        engine_mod.build_engine = real
    gc.collect()
    return res, engines


def test_methods_ran_with_same_math(tiny_bench):
    res, _ = tiny_bench
    assert list(res.methods) == ["zero-offload", "dostune"]  # DeepSpeed's baseline first, whatever the order asked
    z, d = res.methods["zero-offload"], res.methods["dostune"]
    assert z.ran and d.ran
    assert d.losses == z.losses  # bit-identical optimizer: identical loss sequence
    for m in (z, d):
        assert m.iter_s > 0 and m.step_s > 0 and m.fwd_s > 0 and m.bwd_s > 0 and m.update_gelem_s > 0
        assert m.iter.n == 3
    assert d.timeline and {s.lane for s in d.timeline} >= {"cpu", "gpu"}


def test_engines_are_freed_between_methods(tiny_bench):
    _, engines = tiny_bench
    assert len(engines) == 2
    assert all(ref() is None for ref in engines), "a finished engine is still referenced"


def test_result_round_trip_and_renderings(tiny_bench, tmp_path):
    from dostune.profile.record import save_record

    res, _ = tiny_bench
    path = save_record(res, tmp_path / "bench.json")
    again = load_bench(path)
    assert again == res
    md = markdown(res)
    assert "| zero-offload |" in md and "| dostune |" in md and "1.00x" in md
    png = plot_timeline(res.methods["dostune"].timeline, tmp_path / "t.png", "test")
    assert png.exists() and png.stat().st_size > 1000


def test_twin_flow_matching_ratio():
    # 1 GiB of extra peak over ZeRO-Offload with 1.34e9 params: (1 - r) * 16 B * N = 1 GiB
    r = bench_run.twin_flow_matching_ratio(2**30 // 16 * 10, dostune_peak=21.0, offload_peak=20.0)
    assert r == pytest.approx(0.9, abs=1e-3)
    assert bench_run.twin_flow_matching_ratio(10**9, 19.0, 20.0) == 1.0


def test_bad_methods_are_rejected():
    with pytest.raises(DostuneError, match="unknown method"):
        bench_run.BenchOptions(methods=["zero-offload", "magic"]).resolved_methods()
    with pytest.raises(DostuneError, match="add dostune"):
        bench_run.BenchOptions(methods=["twin-flow-mem"]).resolved_methods()


def test_cli_bench_bad_input():
    r = CliRunner().invoke(app, ["bench", "--methods", "warp-drive"])
    assert r.exit_code == 2 and "unknown method" in r.output
    r = CliRunner().invoke(app, ["bench", "--schedule", "{not json"])
    assert r.exit_code == 2 and "--schedule is not valid JSON" in r.output
    r = CliRunner().invoke(app, ["bench", "--schedule", '{"gpu_fraction": 3}'])
    assert r.exit_code == 2 and "dostune.gpu_fraction" in r.output
