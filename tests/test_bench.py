import gc
import weakref

import pytest
import torch
from typer.testing import CliRunner

import dostune.train.engine as engine_mod
from dostune.bench import run as bench_run
from dostune.bench.pool import pool_rounds
from dostune.bench.record import BENCH_SCHEMA_VERSION, load_bench
from dostune.bench.report import markdown, plot_timeline
from dostune.cli.app import app
from dostune.errors import DostuneError
from dostune.host_steal import cpu_times

from stolen_host import FirstRunStolen


class _Lines:
    """A progress display that keeps each task's description and whether it was advanced to its total before the
    next one began."""

    def __init__(self):
        self.tasks = []  # [description, total, advanced]

    def start(self, description, total):
        self.tasks.append([description, total, 0])

    def advance(self, n=1):
        self.tasks[-1][2] += n


@pytest.fixture(scope="module")
def tiny_bench():
    engines = []
    real = engine_mod.build_engine

    def spy(*a, **k):
        e = real(*a, **k)
        engines.append(weakref.ref(e))
        return e

    engine_mod.build_engine = spy
    bench_run.QuietRuns = FirstRunStolen  # each method's first timed iteration is set aside
    try:
        opts = bench_run.BenchOptions(model="gpt2-tiny", micro_batch=2, seq=32, iters=3, warmup=1,
                                      methods=["dostune", "zero-offload"], sub_group_size=20_000,
                                      isolate=False)  # in this process, so the spy sees the engines
        lines = _Lines()
        res = bench_run.run_bench(opts, progress=lines, command="pytest")
    finally:
        engine_mod.build_engine = real
        bench_run.QuietRuns = FirstRunStolen.__base__
    gc.collect()
    return res, engines, lines.tasks


def test_methods_ran_with_same_math(tiny_bench):
    res, _, _ = tiny_bench
    assert list(res.methods) == ["zero-offload", "dostune"]  # DeepSpeed's baseline first, whatever the order asked
    z, d = res.methods["zero-offload"], res.methods["dostune"]
    assert z.ran and d.ran
    # bit-identical optimizer: identical loss sequence, of the warm-up and timed iterations whatever was set aside
    assert d.losses == z.losses and len(d.losses) == 4
    for m in (z, d):
        assert m.iter_s > 0 and m.step_s > 0 and m.fwd_s > 0 and m.bwd_s > 0 and m.update_gelem_s > 0
        assert m.iter.n == 3 and all(len(v) == 3 for v in m.samples.values())
        # the first timed iteration was stolen from (FirstRunStolen): set aside, and a fourth ran in its place
        assert m.set_aside.runs == 1 and m.set_aside.steal == [0.5] and m.set_aside.seconds[0] > 0
    assert d.timeline and {s.lane for s in d.timeline} >= {"cpu", "gpu"}
    # the share of CPU time the hypervisor took over the timed iterations, where /proc/stat says (Linux)
    for m in (z, d):
        assert (m.steal is None) == (cpu_times() is None) and m.round_steal == ([m.steal] if m.steal is not None else [])
        assert m.steal is None or 0.0 <= m.steal < 1.0
    # where the step's host time went, for reading a step longer than its lanes
    assert "step host time, median ms: before lanes " in d.description and "after lanes" in d.description


def test_the_build_shows_its_parts_each_finished_before_the_next(tiny_bench):
    # a large model's build takes minutes: the log says which part (and, if it dies, isolate says in which part)
    _, _, tasks = tiny_bench
    assert [t for t in tasks if "building" in t[0] and t[2] != t[1]] == []
    builds = [d for d, _, _ in tasks if "building" in d]
    assert builds == ["zero-offload: building the model", "zero-offload: building DeepSpeed's engine",
                      "dostune: building the model", "dostune: building DeepSpeed's engine",
                      "dostune: building dostune's lanes"]
    z = [d for d, _, _ in tasks if d.startswith("zero-offload")]
    assert z[:3] == builds[:2] + ["zero-offload: 1 warm-up + 3 timed iterations"]


def test_each_method_records_its_measured_host_peak(tiny_bench):
    from dostune.bench.host_peak import peak_rss_bytes

    res, _, _ = tiny_bench
    for m in res.methods.values():
        # the process's peak RSS from the engine's build on, where /proc says; nothing page-locked without CUDA
        assert (m.host_peak_rss_gib is None) == (peak_rss_bytes() is None)
        assert m.host_peak_rss_gib is None or 0.1 < m.host_peak_rss_gib < 64
        assert (m.host_pinned_gib is None) == (not torch.cuda.is_available())


def test_engines_are_freed_between_methods(tiny_bench):
    _, engines, _ = tiny_bench
    assert len(engines) == 2
    assert all(ref() is None for ref in engines), "a finished engine is still referenced"


def test_result_round_trip_and_renderings(tiny_bench, tmp_path):
    from dostune.records import save_record

    res, _, _ = tiny_bench
    path = save_record(res, tmp_path / "bench.json")
    again = load_bench(path)
    assert again == res
    md = markdown(res)
    assert "| zero-offload |" in md and "| dostune |" in md and "1.00x" in md
    # each method's iteration set aside for steal (FirstRunStolen), beside the kept ones
    assert "Set aside for steal" in md
    assert ("- dostune: 1 timed iteration set aside, each run again: the hypervisor took 50.0% of the CPU while they "
            "ran (steal in /proc/stat); they took ") in md and f"the kept ones {res.methods['dostune'].iter_s:.3f} s" in md
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


def _fake(name: str, iters: list[float], peak: float, ran: bool = True):
    from dostune.bench.record import MethodResult
    from dostune.stats import Stat

    if not ran:
        return MethodResult(method=name, description=name, ran=False, error="boom")
    samples = {k: [x / 4 for x in iters] for k in ("fwd", "bwd", "step")} | {"iter": list(iters)}
    st = {k: Stat.of(v) for k, v in samples.items()}
    return MethodResult(method=name, description=name, iter_s=st["iter"].median, fwd_s=st["fwd"].median,
                        bwd_s=st["bwd"].median, step_s=st["step"].median, iter=st["iter"], fwd=st["fwd"],
                        bwd=st["bwd"], step=st["step"], peak_gpu_gib=peak, phase_peak_gib={"fwd": peak, "step": 1.0},
                        update_gelem_s=2.0, final_loss=1.5, losses=[2.0, 1.5], samples=samples,
                        round_iter_s=[st["iter"].median], round_step_s=[st["step"].median])


def test_pool_rounds_pools_samples_and_keeps_the_worst_memory():
    a = _fake("dostune", [1.0, 2.0, 3.0], peak=5.0).model_copy(update={"swing": [0, 1, 1]})
    b = _fake("dostune", [4.0, 5.0, 6.0], peak=7.0).model_copy(update={"swing": [2, 2, 1]})
    p = pool_rounds([a, b])
    assert p.swing == [0, 1, 1, 2, 2, 1]  # v7: in the order of the samples
    assert p.iter_s == 3.5 and p.iter.n == 6 and p.iter.lo == 1.0 and p.iter.hi == 6.0
    assert p.samples["iter"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and p.round_iter_s == [2.0, 5.0]
    assert p.round_step_s == [0.5, 1.25]  # v6: each round's median step kept beside its iteration
    assert p.step_s == 3.5 / 4 and p.peak_gpu_gib == 7.0 and p.phase_peak_gib == {"fwd": 7.0, "step": 1.0}
    assert p.update_gelem_s == pytest.approx(2.0 * 0.5 / (3.5 / 4), abs=1e-3)  # same elements, pooled step time
    assert pool_rounds([a]) is a
    assert p.steal is None and p.round_steal == []  # no /proc/stat steal in either round
    # the host's steal: each round's kept, the pooled one their mean
    a.round_steal, b.round_steal = [0.01], [0.04]
    p = pool_rounds([a, b])
    assert p.round_steal == [0.01, 0.04] and p.steal == pytest.approx(0.025)
    failed = pool_rounds([a, _fake("dostune", [], 0.0, ran=False)])
    assert not failed.ran and failed.error == "boom"


def test_rounds_reverse_the_order_and_pool(monkeypatch):
    order = []
    times = {"zero-offload": [[4.0, 4.0], [6.0, 6.0]], "dostune": [[1.0, 1.0], [3.0, 3.0]]}

    def fake_run(name, spec, opts, offload, progress):
        order.append(name)
        return _fake(name, times[name][sum(1 for n in order if n == name) - 1], peak=1.0)

    monkeypatch.setattr(bench_run, "run_method", fake_run)
    opts = bench_run.BenchOptions(model="gpt2-tiny", seq=32, methods=["dostune", "zero-offload"], rounds=3)
    with pytest.raises(IndexError):  # a third round asks for a third set of figures: it ran
        bench_run.run_bench(opts, command="pytest")
    assert order == ["zero-offload", "dostune", "dostune", "zero-offload", "zero-offload"]
    order.clear()
    res = bench_run.run_bench(bench_run.BenchOptions(model="gpt2-tiny", seq=32, methods=["dostune", "zero-offload"],
                                                     rounds=2), command="pytest")
    assert order == ["zero-offload", "dostune", "dostune", "zero-offload"]
    assert res.rounds == 2 and res.methods["dostune"].iter_s == 2.0 and res.methods["zero-offload"].iter_s == 5.0
    assert res.speedup("dostune") == 2.5
    md = markdown(res)
    assert "2 rounds x 8 iterations" in md and "- `dostune`: 1.000, 3.000" in md
    assert "adaptive_swing" not in md  # no method swung
    res.methods["dostune"].swing = [0, 1, 2, 2]
    assert "- `dostune`: 0 1 | 2 2 (1 at 0, 1 at +1, 2 at +2)" in markdown(res)
    res.methods["dostune"].swing = [-2, -2, 0, 1]  # the GPU lane took two of the CPU lane's, then gave them back
    assert "- `dostune`: -2 -2 | 0 1 (2 at -2, 1 at 0, 1 at +1)" in markdown(res)
    with pytest.raises(DostuneError, match="--rounds"):
        bench_run.run_bench(bench_run.BenchOptions(model="gpt2-tiny", rounds=0))


def test_ratio_to_no_offload_pooled_and_per_round(monkeypatch):
    times = {"no-offload": [[1.0, 1.0], [2.0, 2.0]], "dostune": [[1.5, 1.5], [2.0, 2.0]]}
    seen = []

    def fake_run(name, spec, opts, offload, progress):
        seen.append(name)
        return _fake(name, times[name][seen.count(name) - 1], peak=1.0)

    monkeypatch.setattr(bench_run, "run_method", fake_run)
    res = bench_run.run_bench(bench_run.BenchOptions(model="gpt2-tiny", seq=32, methods=["no-offload", "dostune"],
                                                     rounds=2), command="pytest")
    pooled, per_round = res.over_ceiling("dostune")
    assert pooled == pytest.approx(1.75 / 1.5) and per_round == [1.5, 1.0]
    assert res.over_ceiling("no-offload") is None and res.over_ceiling("zero-offload") is None
    assert "- dostune: 1.17x no offload's iteration time (per round: 1.50x, 1.00x)" in markdown(res)


def test_version_1_bench_records_still_load(tiny_bench, tmp_path):
    import json

    res, _, _ = tiny_bench
    data = json.loads(res.model_dump_json())
    data["schema_version"] = 1
    del data["rounds"]
    for m in data["methods"].values():
        del m["samples"], m["round_iter_s"], m["round_step_s"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_bench(tmp_path / "old.json")
    assert old.rounds == 1 and old.methods["dostune"].iter_s == res.methods["dostune"].iter_s
    data["schema_version"] = BENCH_SCHEMA_VERSION + 1  # a newer dostune's
    (tmp_path / "new.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="schema_version"):
        load_bench(tmp_path / "new.json")


def test_dostune_configs_compared_in_one_run_each_with_its_own_schedule(monkeypatch):
    from dostune.optim.schedule import ScheduleConfig

    seen = []
    times = {"no-offload": [1.0, 1.0], "dostune": [1.5, 1.5], "dostune:b": [1.2, 1.2]}

    def fake_run(name, spec, opts, offload, progress):
        seen.append((name, offload.schedule.gpu_fraction if offload.schedule else None, offload.sub_group_size))
        return _fake(name, times[name], peak=1.0)

    monkeypatch.setattr(bench_run, "run_method", fake_run)
    a, b = ScheduleConfig(gpu_fraction=0.25), ScheduleConfig(gpu_fraction=0.5)
    opts = bench_run.BenchOptions(model="gpt2-tiny", seq=32, methods=["dostune", "no-offload"], rounds=2, schedule=a,
                                  dostune_sub_group_size=5_000, sub_group_size=9_000,
                                  variants=[bench_run.Variant("b", b, 7_000, "b/ds_config.json")])
    res = bench_run.run_bench(opts, command="pytest")
    assert [s[0] for s in seen] == ["no-offload", "dostune", "dostune:b", "dostune:b", "dostune", "no-offload"]
    assert ("dostune", 0.25, 5_000) in seen and ("dostune:b", 0.5, 7_000) in seen and ("no-offload", None, 9_000) in seen
    assert list(res.methods) == ["no-offload", "dostune", "dostune:b"]
    assert res.over_ceiling("dostune:b")[0] == pytest.approx(1.2)
    assert "- dostune:b: 1.20x no offload's iteration time" in markdown(res)
    assert opts.describe("dostune:b").endswith("schedule b (b/ds_config.json)")


def test_dostune_configs_need_dostune_and_distinct_labels():
    from dostune.optim.schedule import ScheduleConfig

    v = bench_run.Variant("b", ScheduleConfig())
    with pytest.raises(DostuneError, match="add dostune"):
        bench_run.BenchOptions(methods=["no-offload"], variants=[v]).resolved_methods()
    with pytest.raises(DostuneError, match="distinct labels"):
        bench_run.BenchOptions(methods=["dostune"], variants=[v, v]).resolved_methods()


def test_cli_bench_with_two_configs(monkeypatch, tmp_path):
    import json

    from dostune.cli.bench import config_label
    assert config_label(tmp_path / "tune-x" / "ds_config.json") == "tune-x"
    assert config_label(tmp_path / "my pick.json") == "my-pick"
    ran = []

    def fake_run(name, spec, opts, offload, progress):
        ran.append((name, offload.schedule.gpu_fraction if offload.schedule else None, offload.sub_group_size))
        return _fake(name, [1.0, 1.0], peak=1.0)

    monkeypatch.setattr(bench_run, "run_method", fake_run)
    paths = []
    for folder, frac, sgs in (("a", 0.25, 5_000), ("b", 0.5, 7_000), ("b2/b", 0.75, None)):
        p = tmp_path / folder / "ds_config.json"
        p.parent.mkdir(parents=True)
        zero = {"stage": 3} | ({"sub_group_size": sgs} if sgs else {})
        p.write_text(json.dumps({"zero_optimization": zero, "dostune": {"version": 1, "gpu_fraction": frac}}))
        paths.append(p)
    out = tmp_path / "res" / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--model", "gpt2-tiny", "--seq", "32", "--methods", "no-offload,dostune",
                                 "--sub-group-size", "9000", "--output", str(out)]
                           + [x for p in paths for x in ("--config", str(p))])
    assert r.exit_code == 0, r.output
    assert ran == [("no-offload", None, 9_000), ("dostune", 0.25, 5_000), ("dostune:b", 0.5, 7_000),
                   ("dostune:b-2", 0.75, 9_000)]
    res = load_bench(out)
    assert list(res.methods) == ["no-offload", "dostune", "dostune:b", "dostune:b-2"]
    assert "`dostune:b-2`" in out.with_suffix(".md").read_text()
    r = CliRunner().invoke(app, ["bench", "--methods", "no-offload", "--config", str(paths[0]), "--config",
                                 str(paths[1])])
    assert r.exit_code == 2 and "add dostune" in r.output
    ran.clear()
    r = CliRunner().invoke(app, ["bench", "--model", "gpt2-tiny", "--seq", "32", "--methods", "dostune",
                                 "--dostune-sub-group-size", "3000", "--output", str(out), "--config", str(paths[0]),
                                 "--config", str(paths[1])])
    assert r.exit_code == 0, r.output
    assert ran == [("dostune", 0.25, 3_000), ("dostune:b", 0.5, 3_000)]  # the override reaches every config


class _SwingingOptimizer:
    """A dostune optimizer's swing as measure() reads it: each step leaves the next from ``after`` (the last one
    stays); ``adaptive`` False: a schedule without adaptive_swing, which counts no steps by swing."""

    def __init__(self, after: list[int], adaptive: bool = True):
        self.after, self.adaptive, self.swing, self.steps = list(after), adaptive, 0, {}

    @property
    def dostune_swing_stats(self) -> dict:
        return {"steps_by_swing": dict(self.steps), "swing": self.swing}

    def step(self) -> None:
        if self.adaptive:
            self.steps[self.swing] = self.steps.get(self.swing, 0) + 1
            self.swing = self.after.pop(0) if len(self.after) > 1 else self.after[0]


class _FakeEngine:
    device = torch.device("cpu")

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self, **batch):
        return torch.tensor(1.0)

    def backward(self, loss):
        pass

    def step(self):
        getattr(self.optimizer, "step", lambda: None)()

    def train_micro_batch_size_per_gpu(self):
        return 1

    def gradient_accumulation_steps(self):
        return 1


def test_each_timed_iteration_records_the_swing_its_step_ran_with(monkeypatch):
    """Which split a process settled into, beside the times it took (processes of one schedule may differ): the
    swing each kept iteration's step ran with, an iteration set aside for steal dropped with its times."""
    from types import SimpleNamespace

    from dostune.profile.timing import NullProgress

    monkeypatch.setattr(bench_run, "QuietRuns", FirstRunStolen)  # the first timed iteration is set aside
    spec = SimpleNamespace(batch=lambda mb, seq, gen, device: {})
    # warm-up runs with 0 and leaves 1; the set-aside iteration runs with 1; the three kept with 2, 3, 1
    m = bench_run.measure(_FakeEngine(_SwingingOptimizer([1, 2, 3, 1, 0])), spec, seq=8, iters=3, warmup=1, seed=0,
                          progress=NullProgress())
    assert m["set_aside"].runs == 1 and len(m["samples"]["iter"]) == 3
    assert m["swing"] == [2, 3, 1]
    # signed: CPU-lane subgroups on the GPU lane (warm-up leaves -1, which the set-aside iteration runs)
    lent = bench_run.measure(_FakeEngine(_SwingingOptimizer([-1, -2, 0])), spec, seq=8, iters=2, warmup=1, seed=0,
                             progress=NullProgress())
    assert lent["swing"] == [-2, 0]
    fixed = bench_run.measure(_FakeEngine(_SwingingOptimizer([0], adaptive=False)), spec, seq=8, iters=2, warmup=1,
                              seed=0, progress=NullProgress())
    assert fixed["swing"] == []
    plain = bench_run.measure(_FakeEngine(object()), spec, seq=8, iters=2, warmup=1, seed=0, progress=NullProgress())
    assert plain["swing"] == []  # DeepSpeed's own optimizer has no swing
