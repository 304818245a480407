"""The CPU regression gate (dostune/bench/gate.py): its statistic, its verdict, its baseline (a pinned commit), the
test-only slowdown switch, and one real run of both workers on a tiny model."""
import json
import math
import shutil
import subprocess
import time
from xml.etree import ElementTree as ET

import pytest
from typer.testing import CliRunner

from dostune.bench import gate
from dostune.bench.check import compare_gate, junit_xml
from dostune.cli.app import app
from dostune.errors import ConfigError


def test_low_quantile_interpolates_between_order_statistics():
    assert gate.low_quantile([5, 1, 2, 3, 4], 0.25) == 2.0
    assert gate.low_quantile([4.0, 1.0], 0.2) == pytest.approx(1.6)
    assert gate.low_quantile([3.0], 0.2) == 3.0


def _run(ratio, wall=1.0, n=40, engines=(1.0, 1.0)):
    return gate.GateRun(ratio=ratio, wall_ratio=wall, engine_ratios=list(engines), current_cpu_s=[0.03] * n, baseline_cpu_s=[0.03] * n,
                        current_wall_s=[0.03] * n, baseline_wall_s=[0.03] * n, lanes=["cpu", "gpu"], speculative=0,
                        slow_cpu_lane=0.0, seconds=30.0)


BASE = gate.GateBaseline(baseline_commit="a" * 40, pinned="2026-11-24T00:00:00+00:00")


def test_verdict_is_the_ratio_against_the_tolerance_alone():
    ok = compare_gate(BASE, _run(1.049), 0.05)
    assert ok.exit_code == 0 and ok.findings[0].name == "gate/step" and ok.findings[0].baseline == 1.0
    bad = compare_gate(BASE, _run(1.051), 0.05)
    assert bad.exit_code == 1
    assert "aaaaaaaaaaaa" in bad.findings[0].note
    root = ET.fromstring(junit_xml(bad))
    assert root.get("failures") == "1" and "worse by 5.1%" in root.find("testcase/failure").get("message")
    assert compare_gate(BASE, _run(0.8), 0.05).exit_code == 0  # faster is never a regression
    # the noise shown: half the spread of the engine pairs' own ratios, relative (not part of the verdict)
    assert compare_gate(BASE, _run(1.0, engines=(0.96, 1.04)), 0.05).findings[0].noise == pytest.approx(0.04)


def _write_base(tmp_path, **over):
    p = tmp_path / "gate.json"
    p.write_text(BASE.model_copy(update=over).model_dump_json())
    return p


def test_cli_runs_the_gate_for_a_gate_baseline(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "run_gate", lambda base, progress=None: _run(1.2, wall=1.3))
    base = _write_base(tmp_path)
    junit = tmp_path / "check.xml"
    r = CliRunner().invoke(app, ["check", "--baseline", str(base), "--max-regression", "8%", "--junit", str(junit),
                                 "--json"])
    assert r.exit_code == 1, r.output
    assert "REGRESSION" in r.output and "wall clock: 1.300" in r.output
    out = json.loads(r.stdout)
    assert out["findings"][0]["current"] == 1.2
    assert out["gate"]["baseline_commit"] == "a" * 40 and out["gate"]["wall_ratio"] == 1.3
    assert "current_cpu_s" not in out["gate"]  # the summary, not every sample
    assert ET.parse(junit).getroot().get("failures") == "1"
    monkeypatch.setattr(gate, "run_gate", lambda base, progress=None: _run(1.02))
    assert CliRunner().invoke(app, ["check", "--baseline", str(base), "--max-regression", "8%"]).exit_code == 0


def test_cli_refuses_current_and_unreadable_gate_baselines(tmp_path):
    base = _write_base(tmp_path)
    r = CliRunner().invoke(app, ["check", "--baseline", str(base), "--current", str(base)])
    assert r.exit_code == 2 and "does not apply to a gate baseline" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(base.read_text()), "baseline_commit": "HEAD"}))
    r = CliRunner().invoke(app, ["check", "--baseline", str(bad)])
    assert r.exit_code == 2 and "baseline_commit" in r.output


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _repo_with_this_dostune(path):
    """A git repository whose one commit holds this tree's dostune package."""
    path.mkdir()
    shutil.copytree(gate.package_root() / "dostune", path / "dostune",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _git(path, "init", "-q")
    _git(path, "add", "dostune")
    _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "pinned")
    return path, _git(path, "rev-parse", "HEAD")


def test_pin_takes_a_clean_commit_and_refuses_uncommitted_changes(tmp_path):
    repo, sha = _repo_with_this_dostune(tmp_path / "repo")
    base = gate.pin("HEAD", "why not", repo=repo)
    assert base.baseline_commit == sha and base.pinned.endswith(": why not")
    (repo / "dostune" / "__init__.py").write_text("# changed\n")
    with pytest.raises(gate.GateError, match="uncommitted changes"):
        gate.pin("HEAD", repo=repo)
    assert gate.pin(sha, repo=repo).baseline_commit == sha  # an explicit commit needs no clean tree


def test_a_commit_no_repository_has_is_refused_with_the_fetch_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(gate.GateError, match="no git repository here has that commit") as e:
        gate.repository("0" * 40)
    assert "git fetch origin " + "0" * 40 in e.value.hint


def test_slowdown_switch_parsing_and_wrapper(monkeypatch):
    monkeypatch.delenv(gate.SLOW_CPU_LANE_ENV, raising=False)
    assert gate.cpu_lane_slowdown() == 0.0
    assert gate.cpu_lane_seams().wrap_update is None  # unset: the engines are built as users build them
    monkeypatch.setenv(gate.SLOW_CPU_LANE_ENV, "0.2")
    assert gate.cpu_lane_slowdown() == 0.2
    for bad in ("fast", "-0.1", "nan"):
        monkeypatch.setenv(gate.SLOW_CPU_LANE_ENV, bad)
        with pytest.raises(ConfigError, match=gate.SLOW_CPU_LANE_ENV):
            gate.cpu_lane_slowdown()

    def work(x):
        t = time.perf_counter() + 0.02
        while time.perf_counter() < t:
            pass
        return x + 1

    assert gate.slowed(work, 0.0) is work
    slower = gate.slowed(work, 1.0)
    t0 = time.perf_counter()
    assert slower(1) == 2
    assert time.perf_counter() - t0 >= 0.04  # the call's 0.02 s, then as long again
    monkeypatch.setenv(gate.SLOW_CPU_LANE_ENV, "1.0")
    slower = gate.cpu_lane_seams().wrap_update(work)  # the seam this tree's worker builds its engines with
    t0 = time.perf_counter()
    assert slower.__wrapped__ is work and slower(1) == 2 and time.perf_counter() - t0 >= 0.04


def test_a_regression_from_a_noisy_run_is_measured_again_and_the_second_run_decides(tmp_path, monkeypatch):
    """The gate's false alarm on a busy machine: +7.8% with engine pairs 10% apart. Only a regression whose own run
    disagrees by more than the tolerance runs again; a quiet regression and any pass do not."""
    from dostune.bench.check import check_gate

    def runs_in_turn(*runs):
        left = list(runs)
        monkeypatch.setattr(gate, "run_gate", lambda base, progress=None: left.pop(0))
        return left

    said = []
    noisy_alarm, quiet_pass = _run(1.078, engines=(0.97, 1.19)), _run(1.01, engines=(1.0, 1.02))
    assert noisy_alarm.noise > 0.07
    left = runs_in_turn(noisy_alarm, quiet_pass)
    rep, runs = check_gate(BASE, 0.07, say=said.append)
    assert rep.exit_code == 0 and runs == [noisy_alarm, quiet_pass] and not left
    assert len(said) == 1 and "+7.8%" in said[0] and "measuring again" in said[0]
    runs_in_turn(noisy_alarm, _run(1.14, engines=(1.10, 1.18)))  # a real slowdown fails the second run too
    rep, runs = check_gate(BASE, 0.07)
    assert rep.exit_code == 1 and len(runs) == 2 and rep.findings[0].current == 1.14
    left = runs_in_turn(_run(1.14, engines=(1.12, 1.16)), quiet_pass)  # quiet: judged at once
    assert check_gate(BASE, 0.07)[0].exit_code == 1 and left == [quiet_pass]
    left = runs_in_turn(_run(1.0, engines=(0.85, 1.15)), quiet_pass)  # a noisy pass is not repeated
    assert check_gate(BASE, 0.07)[0].exit_code == 0 and left == [quiet_pass]
    # the CLI names both runs in --json when there were two
    runs_in_turn(noisy_alarm, quiet_pass)
    r = CliRunner().invoke(app, ["check", "--baseline", str(_write_base(tmp_path)), "--max-regression", "7%",
                                 "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["gate"]
    assert out["ratio"] == 1.01 and [x["ratio"] for x in out["runs"]] == [1.078, 1.01]
    assert out["runs"][0]["noise"] == pytest.approx(noisy_alarm.noise)


@pytest.mark.slow
def test_one_gate_run_of_both_workers(tmp_path, monkeypatch):
    """The real thing on a tiny model: both workers build, take turns, report; the CPU lane runs in the step (no
    update during backward: clipping is certain), and the slowdown switch reaches this tree's worker only."""
    repo, sha = _repo_with_this_dostune(tmp_path / "repo")
    monkeypatch.chdir(repo)  # the commit is found in the current folder's repository
    monkeypatch.setenv(gate.SLOW_CPU_LANE_ENV, "0.5")
    settings = gate.GateSettings(model="gpt2-tiny", sub_group_size=20_000, pairs=4, warmup=1, engines=2,
                                 schedule={**gate.GATE_SCHEDULE, "gpu_fraction": 0.4})
    run = gate.run_gate(gate.GateBaseline(baseline_commit=sha, pinned="t", settings=settings))
    assert run.lanes.count("gpu") == 2 and "cpu" in run.lanes
    assert run.speculative == 0 and run.slow_cpu_lane == 0.5
    assert len(run.current_cpu_s) == len(run.baseline_wall_s) == 4 and len(run.engine_ratios) == 2
    assert math.isfinite(run.ratio) and run.ratio > 0
    # the verdict's ratio pairs engine k with engine k: the geometric mean of the pairs' own ratios
    assert run.ratio == pytest.approx(math.sqrt(run.engine_ratios[0] * run.engine_ratios[1]))
    # a worker that stops says why in one line (here: both refuse an unknown model)
    bad = settings.model_copy(update={"model": "no-such-model"})
    with pytest.raises(gate.GateError, match=r"worker stopped \(exit 1\).*unknown model 'no-such-model'"):
        gate.run_gate(gate.GateBaseline(baseline_commit=sha, pinned="t", settings=bad))


def test_a_worker_killed_before_a_request_is_named_with_its_signal(tmp_path):
    """Writing to a worker that is gone raised "Broken pipe", which said nothing; the kernel's out-of-memory killer
    sends SIGKILL."""
    w = gate._Worker("current", gate.package_root(), gate.GateSettings(), slow=False, logdir=tmp_path)
    w.proc.kill()
    w.proc.wait()
    with pytest.raises(gate.GateError, match=r"current worker stopped \(killed by SIGKILL, as the kernel does when "
                                             r"memory runs out\)"):
        for _ in range(3):  # the first writes can land in the pipe's buffer
            w.ask("step 1")
    w.close()


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_the_slowdown_seam_wraps_every_cpu_lane_update_and_changes_no_result(overlap):
    """The gate's slowed update, given to the optimizer as its CPU-lane seam, runs for every CPU-lane update in both
    forms of the CPU lane; the slowed lane computes exactly what DeepSpeed does."""
    from dostune.optim.cpu_lane import CpuLaneSeams
    from dostune.optim.schedule import ScheduleConfig
    from parity_helpers import base_settings, reference, rel_diff, run

    calls = []

    def wrap(update):
        slower = gate.slowed(update, 0.5)
        return lambda *args: calls.append(args) or slower(*args)

    train = base_settings(precision="bf16")
    ours = run(train, ScheduleConfig(gpu_fraction=0.4, overlap_backward=overlap), steps=3,
               seams=CpuLaneSeams(wrap_update=wrap))
    ref = reference(train, steps=3)
    assert ours["type"] == "InterleavedZeroOptimizer" and rel_diff(ours["weights"], ref["weights"]) == 0
    # 3 of the 5 subgroups on the CPU lane, 3 steps; during backward, each recompute of a clipped step is one more
    st = ours["overlap"]
    assert len(calls) == (st["committed"] + st["redone"] if overlap else 3 * 3)
    if overlap:
        assert st["committed"] == 3 * 3
