"""Long work keeps what it finished: every method's row reaches the disk as it completes, and a method whose
process dies (the out-of-memory killer, a crash) becomes a row saying so while the others run."""
import json
import multiprocessing
import signal

import pytest
from typer.testing import CliRunner

from bench_models import KILL_ONCE
from dostune.bench import isolate
from dostune.bench import run as bench_run
from dostune.bench.record import MethodResult, load_bench
from dostune.cli.app import app
from dostune.stats import Stat


def _ran(name, peak=None):
    st = Stat.of([1.0, 1.0])
    return MethodResult(method=name, description=name, iter_s=1.0, fwd_s=0.2, bwd_s=0.3, step_s=0.5, iter=st,
                        fwd=st, bwd=st, step=st, peak_gpu_gib=peak, update_gelem_s=1.0, final_loss=1.0, losses=[1.0])


def test_each_row_is_on_disk_as_soon_as_its_method_finishes(monkeypatch, tmp_path):
    def fake_run(name, spec, opts, offload, progress):
        if name == "dostune":
            raise KeyboardInterrupt  # the bench is stopped while the second method runs
        return _ran(name)

    monkeypatch.setattr(bench_run, "run_method", fake_run)
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--model", "gpt2-tiny", "--seq", "32", "--methods", "zero-offload,dostune",
                                 "--output", str(out)])
    assert r.exit_code == 130
    kept = load_bench(out)
    assert list(kept.methods) == ["zero-offload"] and kept.methods["zero-offload"].ran
    assert "| zero-offload |" in out.with_suffix(".md").read_text()


def test_twin_flow_matching_ratio_for_a_factory_model(monkeypatch):
    """A factory model has no analytic parameter count: it is counted (it was None and divided by)."""
    monkeypatch.setattr(bench_run, "run_method", lambda name, spec, opts, offload, progress:
                        _ran(name, peak={"zero-offload": 2.0, "dostune": 2.0 + 2**-20}.get(name, 1.0)))
    opts = bench_run.BenchOptions(model="bench_models:factory", seq=16,
                                  methods=["zero-offload", "dostune", "twin-flow-mem"])
    res = bench_run.run_bench(opts, command="pytest")
    params = res.params
    assert params == 64 * 32 + 32 * 128 + 128 + 128 * 32 + 32 + 32 * 64 + 64
    # 2**-20 GiB (1 KiB) of extra peak = (1 - ratio) * 16 bytes * params
    expected = round(1 - 1024 / (16 * params), 3)
    assert 0 < expected < 1 and res.methods["twin-flow-mem"].description.endswith(f"(ratio {expected})")


def test_death_is_named_by_signal_and_phase():
    assert isolate.death(-signal.SIGKILL, "building the engine") == (
        "killed by SIGKILL during building the engine, most likely out of host memory (the kernel's OOM killer)")
    assert isolate.death(-signal.SIGSEGV, "1 warm-up + 2 timed iterations") == (
        "crashed: SIGSEGV during 1 warm-up + 2 timed iterations")
    assert isolate.death(3, None) == "exited with code 3 without a result"


@pytest.mark.slow
def test_a_method_killed_in_its_process_is_a_row_and_the_others_run(tmp_path, monkeypatch):
    marker = tmp_path / "die"
    marker.write_text("")
    monkeypatch.setenv(KILL_ONCE, str(marker))
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--model", "bench_models:dies_once", "--micro-batch", "2", "--seq", "16",
                                 "--iters", "2", "--warmup", "1", "--methods", "zero-offload,dostune",
                                 "--sub-group-size", "2000", "--output", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    z, d = res["methods"]["zero-offload"], res["methods"]["dostune"]  # ZeRO-Offload runs first and is killed
    assert not z["ran"] and z["error"].startswith("killed by SIGKILL during 1 warm-up + 2 timed iterations")
    assert d["ran"] and d["iter_s"] > 0 and res["params"] > 0
    assert "did not run: zero-offload" in " ".join(r.output.split())


class _StopsAtTheFirstPhase:
    """The parent's progress display, where a stop lands: KeyboardInterrupt as the child reports its first phase."""

    def start(self, description, total):
        raise KeyboardInterrupt

    def advance(self, n=1):
        pass


@pytest.mark.slow
def test_a_stopped_method_ends_its_process(monkeypatch):
    """A SIGTERM sent to the bench's process alone (turned into KeyboardInterrupt there) does not reach the child,
    which must not go on measuring: it is terminated, not waited for."""
    children = []
    real = multiprocessing.get_context

    class Recording:
        def __init__(self, ctx):
            self.ctx = ctx

        def __getattr__(self, name):
            return getattr(self.ctx, name)

        def Process(self, *args, **kwargs):
            children.append(self.ctx.Process(*args, **kwargs))
            return children[-1]

    monkeypatch.setattr(isolate.mp, "get_context", lambda kind: Recording(real(kind)))
    opts = bench_run.BenchOptions(model="bench_models:factory", micro_batch=2, seq=16, iters=2, warmup=1,
                                  sub_group_size=2000)
    with pytest.raises(KeyboardInterrupt):
        isolate.run_isolated("zero-offload", opts, bench_run.method_offload("zero-offload", opts, None),
                             _StopsAtTheFirstPhase())
    assert len(children) == 1 and children[0].exitcode == -signal.SIGTERM
