"""The CPU regression gate (dostune/bench/gate.py, gate_statistic.py, gate_worker.py): its statistic, its verdict, its baseline (a pinned commit), the
test-only slowdown switch, and one real run of both workers on a tiny model."""
import json
import math
import shutil
import subprocess
import time
from xml.etree import ElementTree as ET

import pytest
from typer.testing import CliRunner

from dostune.bench import gate, gate_statistic, gate_worker
from dostune.bench.check import compare_gate, junit_xml
from dostune.cli.app import app
from dostune.errors import ConfigError


def test_the_ratio_is_the_median_of_steps_paired_in_turn_with_a_sign_test_interval():
    # the pairs' ratios 1.0, 1.1, 0.9, 1.2, 1.05: median 1.05; a burst that slows both steps of a turn alike
    # (the third turn: both 2x) changes no ratio
    cur, ref = [1.0, 1.1, 1.8, 1.2, 1.05], [1.0, 1.0, 2.0, 1.0, 1.0]
    ratio, low, high = gate_statistic.paired_ratio(cur, ref, 0.9)
    assert ratio == pytest.approx(1.05)
    assert (low, high) == (pytest.approx(0.9), pytest.approx(1.2))  # 5 samples: only the extremes are 90% sure
    with pytest.raises(ValueError):
        gate_statistic.paired_ratio([1.0], [1.0, 2.0], 0.9)  # every step has its partner
    # the sign test's ranks: P(at most k of n below the median) <= (1 - confidence) / 2
    assert gate_statistic.median_interval_rank(10, 0.95) == 1  # P(<=1 of 10) = 11/1024 = 0.011; P(<=2) = 0.055
    assert gate_statistic.median_interval_rank(40, 0.99) == 11  # P(<=11 of 40) = 0.0032; P(<=12) = 0.0083
    assert gate_statistic.median_interval_rank(4, 0.99) == 0
    for n in (8, 40, 160):
        k = gate_statistic.median_interval_rank(n, 0.99)
        assert sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n <= 0.005
        assert sum(math.comb(n, i) for i in range(k + 2)) / 2 ** n > 0.005 or k == 0
    # ratios spread evenly over 0.95-1.05: more of them, a narrower interval around the same median
    spread = lambda n: [0.95 + 0.1 * i / (n - 1) for i in range(n)]  # noqa: E731
    wide, narrow = gate_statistic.paired_ratio(spread(40), [1.0] * 40, 0.99), gate_statistic.paired_ratio(spread(160), [1.0] * 160, 0.99)
    assert wide[0] == pytest.approx(1.0) and narrow[0] == pytest.approx(1.0)
    assert wide[2] - wide[1] == pytest.approx(0.1 * 17 / 39) and narrow[2] - narrow[1] == pytest.approx(0.1 * 33 / 159)


def test_settled_means_the_interval_lies_wholly_on_one_side_of_the_tolerance():
    assert gate_statistic.settled(0.95, 1.069, 0.07) and gate_statistic.settled(1.071, 1.2, 0.07)
    assert not gate_statistic.settled(1.0, 1.08, 0.07) and not gate_statistic.settled(1.06, 1.09, 0.07)


def _run(ratio, wall=1.0, n=40, low=None, high=None, rounds=1):
    return gate.GateRun(ratio=ratio, low=low or ratio - 0.02, high=high or ratio + 0.02, wall_ratio=wall,
                        engine_ratios=[ratio] * 4, current_cpu_s=[0.03] * n, baseline_cpu_s=[0.03] * n,
                        current_wall_s=[0.03] * n, baseline_wall_s=[0.03] * n, rounds=rounds, lanes=["cpu", "gpu"],
                        speculative=0, slow_cpu_lane=0.0, seconds=30.0)


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
    # the noise shown: half the width of the ratio's interval, relative (not part of the verdict)
    assert compare_gate(BASE, _run(1.0, low=0.96, high=1.04), 0.05).findings[0].noise == pytest.approx(0.04)
    # a run that reached max_pairs without settling is judged on its median, and says so
    unsettled = compare_gate(BASE, _run(1.06, n=160, low=1.02, high=1.09, rounds=4), 0.07)
    assert unsettled.exit_code == 0 and "not clear of the tolerance after 160 turns" in unsettled.findings[0].note


def _write_base(tmp_path, **over):
    p = tmp_path / "gate.json"
    p.write_text(BASE.model_copy(update=over).model_dump_json())
    return p


def test_cli_runs_the_gate_for_a_gate_baseline(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "run_gate", lambda base, tolerance, progress=None: _run(1.2, wall=1.3))
    base = _write_base(tmp_path)
    junit = tmp_path / "check.xml"
    r = CliRunner().invoke(app, ["check", "--baseline", str(base), "--max-regression", "8%", "--junit", str(junit),
                                 "--json"])
    assert r.exit_code == 1, r.output
    assert "REGRESSION" in r.output and "wall clock: 1.300" in r.output
    out = json.loads(r.stdout)
    assert out["findings"][0]["current"] == 1.2
    assert out["gate"]["baseline_commit"] == "a" * 40 and out["gate"]["wall_ratio"] == 1.3
    assert out["gate"]["pairs"] == 40 and out["gate"]["rounds"] == 1 and out["gate"]["noise"] > 0
    assert "current_cpu_s" not in out["gate"]  # the summary, not every sample
    assert ET.parse(junit).getroot().get("failures") == "1"
    monkeypatch.setattr(gate, "run_gate", lambda base, tolerance, progress=None: _run(1.02))
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
    monkeypatch.delenv(gate_worker.SLOW_CPU_LANE_ENV, raising=False)
    assert gate_worker.cpu_lane_slowdown() == 0.0
    assert gate_worker.cpu_lane_seams().wrap_update is None  # unset: the engines are built as users build them
    monkeypatch.setenv(gate_worker.SLOW_CPU_LANE_ENV, "0.2")
    assert gate_worker.cpu_lane_slowdown() == 0.2
    for bad in ("fast", "-0.1", "nan"):
        monkeypatch.setenv(gate_worker.SLOW_CPU_LANE_ENV, bad)
        with pytest.raises(ConfigError, match=gate_worker.SLOW_CPU_LANE_ENV):
            gate_worker.cpu_lane_slowdown()

    def work(x):
        t = time.perf_counter() + 0.02
        while time.perf_counter() < t:
            pass
        return x + 1

    assert gate_worker.slowed(work, 0.0) is work
    slower = gate_worker.slowed(work, 1.0)
    t0 = time.perf_counter()
    assert slower(1) == 2
    assert time.perf_counter() - t0 >= 0.04  # the call's 0.02 s, then as long again
    monkeypatch.setenv(gate_worker.SLOW_CPU_LANE_ENV, "1.0")
    slower = gate_worker.cpu_lane_seams().wrap_update(work)  # the seam this tree's worker builds its engines with
    t0 = time.perf_counter()
    assert slower.__wrapped__ is work and slower(1) == 2 and time.perf_counter() - t0 >= 0.04


class _Recorder:
    def __init__(self):
        self.lines = []

    def start(self, description, total):
        self.lines.append(description)

    def advance(self, n=1):
        pass


def _turns(settings, tolerance, ratio_of_turn):
    """take_turns against scripted workers: the baseline's step takes 30 ms, this tree's ratio_of_turn(k) times
    that in timed turn k; each turn's two steps are also slowed alike by a burst every 7 turns."""
    asked = []

    def ask(name, timed):
        asked.append((name, timed))
        k = sum(1 for n, t in asked if t and n == name) - 1  # this side's timed step, counted from 0
        burst = 3.0 if k % 7 == 0 else 1.0
        cpu = 0.03 * burst * (ratio_of_turn(k) if name == "current" and timed else 1.0)
        return {"cpu": cpu, "wall": cpu}

    progress = _Recorder()
    times, rounds = gate.take_turns(settings, tolerance, ask, progress)
    return times, rounds, asked, progress.lines


def test_turns_alternate_and_a_quiet_run_stops_after_one_round():
    s = gate.GateSettings(pairs=8, max_pairs=32, warmup=2)
    times, rounds, asked, lines = _turns(s, 0.07, lambda k: 1.0 + 0.01 * (k % 3 - 1))
    assert rounds == 1 and len(times["current"]) == len(times["baseline"]) == 8 and len(lines) == 1
    # A B, B A, ...: the warm-up untimed, then 8 timed turns; neither side always runs first
    assert asked[:4] == [("current", False), ("baseline", False), ("baseline", False), ("current", False)]
    assert [n for n, _ in asked[4:8]] == ["current", "baseline", "baseline", "current"] and len(asked) == 20
    # the bursts slowed both steps of a turn alike: the paired ratio does not see them
    ratio = gate_statistic.paired_ratio(*[[x["cpu"] for x in times[k]] for k in ("current", "baseline")], 0.99)[0]
    assert ratio == pytest.approx(1.0)
    _, rounds, _, _ = _turns(s, 0.07, lambda k: 1.2)  # a clear slowdown settles at once too
    assert rounds == 1


def test_a_run_whose_interval_straddles_the_tolerance_times_more_rounds_up_to_max_pairs():
    """The false alarm on a busy machine: a first round whose pairs disagree widely. The run does not guess: it
    times more rounds with the engines it has, until its interval clears the tolerance or max_pairs."""
    s = gate.GateSettings(pairs=40, max_pairs=160, warmup=4)
    # unchanged, but the first 40 turns disturbed: ratios from 0.80 to 1.30
    first_disturbed = lambda k: (0.80 + 0.5 * ((k * 7) % 40) / 39) if k < 40 else 1.0 + 0.01 * (k % 3 - 1)  # noqa
    times, rounds, _, lines = _turns(s, 0.07, first_disturbed)
    cur, ref = ([x["cpu"] for x in times[k]] for k in ("current", "baseline"))
    assert not gate_statistic.settled(*gate_statistic.paired_ratio(cur[:40], ref[:40], 0.99)[1:], 0.07)
    assert rounds == 2 and len(cur) == 80 and gate_statistic.paired_ratio(cur, ref, 0.99)[2] <= 1.07
    assert len(lines) == 2 and "40 more timed steps of each" in lines[1] and "7% tolerance" in lines[1]
    # disturbed throughout: max_pairs, then judged on what it has
    times, rounds, _, lines = _turns(s, 0.07, lambda k: 0.80 + 0.5 * ((k * 7) % 40) / 39)
    assert rounds == 4 and len(times["current"]) == 160 and len(lines) == 4
    # a cap that is not a whole number of rounds: the last round is shorter
    times, rounds, _, _ = _turns(s.model_copy(update={"max_pairs": 100}), 0.07,
                                 lambda k: 0.80 + 0.5 * ((k * 7) % 40) / 39)
    assert rounds == 3 and len(times["current"]) == 100


def test_settings_refuse_a_cap_below_one_round_and_workers_get_only_what_they_build_from():
    with pytest.raises(ValueError, match="max_pairs"):
        gate.GateSettings(pairs=40, max_pairs=20)
    # the pinned commit's worker refuses keys it does not know: the parent's timing settings stay with the parent
    sent = json.loads(gate.GateSettings().model_dump_json(include=gate.WORKER_FIELDS))
    assert not {"pairs", "max_pairs", "warmup", "confidence"} & set(sent)
    assert gate.GateSettings.model_validate(sent).engines == 4


def test_check_gate_passes_the_tolerance_to_the_run(monkeypatch):
    from dostune.bench.check import check_gate

    seen = []
    monkeypatch.setattr(gate, "run_gate", lambda base, tolerance, progress=None: seen.append(tolerance) or
                        _run(1.08, low=1.075, high=1.09))
    rep, run = check_gate(BASE, 0.07)
    assert seen == [0.07] and rep.exit_code == 1 and run.ratio == 1.08


@pytest.mark.slow
def test_one_gate_run_of_both_workers(tmp_path, monkeypatch):
    """The real thing on a tiny model: both workers build, take turns, report; the CPU lane runs in the step (no
    update during backward: clipping is certain), and the slowdown switch reaches this tree's worker only."""
    repo, sha = _repo_with_this_dostune(tmp_path / "repo")
    monkeypatch.chdir(repo)  # the commit is found in the current folder's repository
    monkeypatch.setenv(gate_worker.SLOW_CPU_LANE_ENV, "0.5")
    settings = gate.GateSettings(model="gpt2-tiny", sub_group_size=20_000, pairs=4, max_pairs=8, warmup=1, engines=2,
                                 schedule={**gate.GATE_SCHEDULE, "gpu_fraction": 0.4})
    run = gate.run_gate(gate.GateBaseline(baseline_commit=sha, pinned="t", settings=settings), 0.07)
    assert run.lanes.count("gpu") == 2 and "cpu" in run.lanes
    assert run.speculative == 0 and run.slow_cpu_lane == 0.5
    assert len(run.current_cpu_s) == len(run.baseline_wall_s) == 4 * run.rounds and run.rounds in (1, 2)
    assert len(run.engine_ratios) == 2 and math.isfinite(run.ratio) and run.ratio > 0
    # the verdict's ratio: the median over the turns of this tree's step over the pinned one beside it
    assert (run.ratio, run.low, run.high) == gate_statistic.paired_ratio(run.current_cpu_s, run.baseline_cpu_s, 0.99)
    # a worker that stops says why in one line (here: both refuse an unknown model)
    bad = settings.model_copy(update={"model": "no-such-model"})
    with pytest.raises(gate.GateError, match=r"worker stopped \(exit 1\).*unknown model 'no-such-model'"):
        gate.run_gate(gate.GateBaseline(baseline_commit=sha, pinned="t", settings=bad), 0.07)


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
        slower = gate_worker.slowed(update, 0.5)
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
