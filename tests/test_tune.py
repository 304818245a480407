import copy
import json
import math

import pytest
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.errors import DostuneError, ProfileError
from dostune.optim.schedule import ScheduleConfig
from dostune.perfmodel.model import best_gpu_fraction, gpu_count_for_share
from dostune.perfmodel.step import simulate_step
from dostune.profile.paths import shipped_profile
from dostune.tune.search import TuneOptions, build_space, ranked, resolve_profiles, run_tune
from dostune.tune.study import run_study
from dostune.tune.space import GPU_SHARE, PLACEMENTS, Candidate, brute_force
from dostune.profile.timing import NullProgress


# The equal-memory search (--max-peak-increase 10%: the peak within ZeRO-Offload's measured peak plus 10%), which the
# tests of the space below were written against; the default fills the GPU (test_tune_defaults.py)
EQUAL_MEMORY = 0.10


@pytest.fixture(scope="module")
def space():
    """The search space of gpt2-1.3b on the shipped profiles, scored without clipping (the shipped model profile
    recorded no gradient norm, which would score both regimes; tests/test_tune_regime.py tests the regimes)."""
    return build_space(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), regime="no-clip",
                                   max_peak_increase=EQUAL_MEMORY))[0]


def _small(profile):
    """The search space at its three largest sub_group_sizes: small enough to search exhaustively in seconds."""
    s = build_space(TuneOptions(model="gpt2-1.3b", profile=profile, regime="no-clip",
                                   max_peak_increase=EQUAL_MEMORY))[0]
    s.sub_group_sizes = [100_000_000, 200_000_000, 400_000_000]
    return s


@pytest.fixture(scope="module")
def small():
    return _small(shipped_profile())


@pytest.fixture(scope="module")
def plain():
    """The small space from the H100 profiles, whose model profile has no lane probe: every thread count for every
    schedule."""
    return _small(shipped_profile("h100-pcie5.json"))


def default_model_profile():
    """The model profile of gpt2-1.3b that `dostune tune` finds beside the default shipped node profile."""
    return resolve_profiles(TuneOptions(model="gpt2-1.3b", profile=shipped_profile()))[3]


def test_closed_form_matches_a_scan_over_the_gpu_share():
    # The closed form takes the CPU lane's cost per element over all elements at once, leaving out a fixed cost per
    # subgroup: the H200 profile's fits of the unscale and the conversion have one (~5 ms each), which slows the CPU
    # lane of small subgroups past the closed form's balance; on the H100 profile, whose fits have none, the scan
    # checks the balance alone
    space = build_space(TuneOptions(model="gpt2-1.3b", profile=shipped_profile("h100-pcie5.json")))[0]
    t = max(space.threads, key=lambda x: space.node.cpu_adam[x].rate)
    f = best_gpu_fraction(sum(space.numels), space.node, t)
    for sgs in space.sub_group_sizes:
        sizes = space.sizes(sgs)
        n = len(sizes)
        # the closed form is the steady state without the one-off head start that the prefetch during DeepSpeed's
        # step prologue gives (no overhead, no prologue)
        step = lambda k: simulate_step(sizes, ScheduleConfig(gpu_fraction=k / n, cpu_threads=t),  # noqa: E731
                                       space.node, 0.0).step_s
        best_k = min(range(n + 1), key=step)
        k = gpu_count_for_share(sizes, f)
        assert abs(k - best_k) <= max(1, round(0.1 * n)), (sgs, f, k, best_k, n)
        # The closed form is a steady-state balance; with many small subgroups and two staging buffers the
        # GPU lane's latency (in, kernel, out per slot) also matters, which it leaves out (see the docs).
        assert step(k) <= (1.05 if sgs >= 25_000_000 else 1.08) * step(best_k), (sgs, step(k), step(best_k))


@pytest.mark.slow
def test_the_default_trials_get_within_two_percent_of_brute_force(small, tmp_path):
    best_c, best_p = brute_force(small)
    opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), output_dir=tmp_path)
    assert opts.trials == 100  # 50 were enough before gpu_placement tripled the space (see TuneOptions.trials)
    study = run_study(small, opts, f"sqlite:///{(tmp_path / 'study.db').as_posix()}", "brute", "key", NullProgress())
    top = ranked(small, study)
    assert sum(1 for t in study.trials if t.state.name == "COMPLETE") == 100
    assert top[0].predicted.iter_s <= 1.02 * best_p.objective_s
    assert top[0].feasible


def test_the_space_is_declared_once(plain, tmp_path):
    """Optuna's trials, the exhaustive reference and the enqueued seeds all take the parameters Space.choices
    declares, gpu_placement among them (the paper's every k-th subgroup is "spread")."""
    choices = plain.choices()
    assert choices["gpu_placement"] == list(PLACEMENTS) and "spread" in PLACEMENTS
    assert plain.overlap_possible and set(choices) == set(Candidate.__dataclass_fields__) - {"gpu_count"}
    every = list(plain.all_candidates())
    for name, values in choices.items():
        assert {getattr(c, name) for c in every} == set(values), name
    assert len(every) == sum(len(plain.sizes(s)) + 1 for s in choices["sub_group_size"]) * math.prod(
        len(v) for k, v in choices.items() if k != "sub_group_size")
    opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=16, output_dir=tmp_path)
    study = run_study(plain, opts, f"sqlite:///{(tmp_path / 'study.db').as_posix()}", "decl", "key", NullProgress())
    seeds = list(plain.closed_form_candidates())
    for t in study.trials:
        assert set(t.params) == set(choices) | {GPU_SHARE}
        assert all(t.params[k] in v for k, v in choices.items())
    # the enqueued seeds come back as themselves
    assert [plain.candidate(t.params) for t in study.trials[:len(seeds)]] == seeds
    assert all(plain.candidate(plain.params(c)) == c for c in every[::97])
    assert len({t.params["gpu_placement"] for t in study.trials}) > 1  # searched, not fixed


def test_overlap_schedules_run_at_the_thread_count_the_lane_probe_measured(plain, tmp_path):
    """The model knows overlap_backward's lane only at the threads its probe ran with (one fewer than the step's):
    those schedules are searched at that count alone, the others at every count."""
    assert plain.lane_threads is None  # no lane probe: every count for every schedule
    lane = copy.copy(plain)
    lane.model = plain.model.model_copy(update={"lane_threads": 7})
    assert lane.lane_threads == 8 and lane.threads == [8, 12, 16]
    every = list(lane.all_candidates())
    assert {c.cpu_threads for c in every if c.overlap_backward} == {8}
    assert {c.cpu_threads for c in every if not c.overlap_backward} == {8, 12, 16}
    assert all(lane.candidate(lane.params(c)) == c for c in every[::97])
    seeds = list(lane.closed_form_candidates())
    assert {c.cpu_threads for c in seeds if c.overlap_backward} == {8}
    opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=24, output_dir=tmp_path)
    study = run_study(lane, opts, f"sqlite:///{(tmp_path / 'study.db').as_posix()}", "lane", "key", NullProgress())
    assert [lane.candidate(t.params) for t in study.trials[:len(seeds)]] == seeds
    overlapped = [t for t in study.trials if t.params["overlap_backward"]]
    assert overlapped and all("cpu_threads" not in t.params for t in overlapped)
    assert {lane.candidate(t.params).cpu_threads for t in overlapped} == {8}
    assert all("cpu_threads" in t.params for t in study.trials if not t.params["overlap_backward"])


def test_gpu_placement_changes_the_prediction_and_the_config(space):
    c = Candidate(25_000_000, 12, 3, 16, "gpu_convert", True, True)
    first, spread = (space.evaluate(Candidate(**{**c.__dict__, "gpu_placement": p})) for p in ("first", "spread"))
    assert spread.schedule.gpu_placement == "spread" and first.schedule.gpu_placement == "first"
    assert first.plan.gpu_subgroups != spread.plan.gpu_subgroups
    # with the GPU lane spread, the CPU lane holds first-layer subgroups whose gradients are final last in
    # backward: more of its work is left to the step
    assert spread.step.cpu_busy_s > first.step.cpu_busy_s


def test_overlap_is_searched_and_predicted_faster_with_a_model_profile(space):
    from dostune.tune.space import Candidate

    assert space.overlap_possible
    # a case measured on an H100: 7 subgroups of 2e8, 3 on the GPU lane
    off, on = (space.evaluate(Candidate(200_000_000, 3, 2, 16, "gpu_convert", True, o)) for o in (False, True))
    assert on.schedule.overlap_backward and not off.schedule.overlap_backward
    assert on.step_s < off.step_s
    assert on.memory.pinned_host_gib > off.memory.pinned_host_gib  # the shadow states


def test_emitted_config_is_valid_deepspeed(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    res, cfg, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=12, output_dir=tmp_path))
    ds = DeepSpeedConfig(json.loads(json.dumps(cfg)))
    assert ds.zero_optimization_stage == 3
    # dostune pins in place; DeepSpeed's own pinning would round every buffer up to a power of two
    assert ds.zero_config.offload_optimizer.device == "cpu" and not ds.zero_config.offload_optimizer.pin_memory
    assert ds.zero_config.sub_group_size == res.best.sub_group_size
    assert ds.bfloat16_config.enabled
    sched = ScheduleConfig.from_ds_config(cfg)
    assert sched.expected_subgroups == res.best.subgroups


def test_checkpointing_is_noted_only_against_a_model_profile_measured_without_it(tmp_path):
    # the shipped gpt2-1.3b profile ran without activation checkpointing: its times are not the checkpointed run's
    res, cfg, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=4, output_dir=tmp_path / "a",
                                       activation_checkpointing=True))
    assert "activation_checkpointing" in cfg
    assert any("checkpoints every block, but h200-pcie5-gpt2-1.3b-b8-s1024.json was measured without it" in n
               for n in res.notes)
    # no model profile (a budget instead): its own note says the times are unknown, and nothing about checkpointing
    res, _, _ = run_tune(TuneOptions(model="llama-1.1b", profile=shipped_profile(), trials=4, output_dir=tmp_path / "b",
                                     activation_checkpointing=True, gpu_memory_budget="20"))
    assert any(n.startswith("no model profile") for n in res.notes)
    assert not any("checkpoint" in n for n in res.notes)


def test_plain_deepspeed_accepts_the_dostune_section():
    """DeepSpeed ignores the top-level 'dostune' key: the emitted config runs under plain deepspeed.initialize."""
    from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
    from dostune.models.registry import resolve_model
    from dostune.train.engine import build_engine, train_steps

    cfg = deepspeed_config(TrainSettings(micro_batch=2), OffloadSettings(
        sub_group_size=20_000, pin_memory=False, schedule=ScheduleConfig(gpu_fraction=0.5, expected_subgroups=5)))
    spec = resolve_model("gpt2-tiny")
    engine = build_engine(spec, cfg, use_dostune=False)
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3"
    train_steps(engine, spec, 2, seq=16)
    engine.destroy()


def test_study_resumes_without_losing_trials(tmp_path):
    import optuna

    opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=15, output_dir=tmp_path,
                       study_name="resume-test")
    run_tune(opts)
    storage = f"sqlite:///{(tmp_path / 'study.db').as_posix()}"
    study = optuna.load_study(study_name="resume-test", storage=storage)
    study.ask()  # a trial left running by a killed process
    opts.trials = 25
    res, _, _ = run_tune(opts)
    trials = optuna.load_study(study_name="resume-test", storage=storage).trials
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") == 25
    assert states.count("FAIL") == 1  # the orphan was closed, not silently dropped or re-counted
    assert all(t.params for t in trials if t.state.name == "COMPLETE")


def test_resume_with_other_limits_is_refused(tmp_path):
    opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=3, output_dir=tmp_path, study_name="s")
    run_tune(opts)
    opts.gpu_memory_budget = "3"
    with pytest.raises(DostuneError, match="made for other profiles or limits"):
        run_tune(opts)


def test_bad_inputs(tmp_path):
    with pytest.raises(DostuneError, match="no schedule"):
        run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=5, output_dir=tmp_path,
                             gpu_memory_budget="0.001", max_peak_increase=0.0))
    with pytest.raises(DostuneError, match="'auto' or a number"):
        run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=5, output_dir=tmp_path,
                             gpu_memory_budget="lots"))
    with pytest.raises(DostuneError, match="differs from the model profile"):
        run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(),
                             model_profile=default_model_profile(), trials=5,
                             output_dir=tmp_path, micro_batch=4))


def test_cpu_only_profile_is_refused(tmp_path):
    from dostune.profile.node import NodeProfileOptions, measure_node
    from dostune.records import save_record

    p = save_record(measure_node(NodeProfileOptions.tiny(), command="t"), tmp_path / "cpu.json")
    with pytest.raises(ProfileError, match="no GPU measurements"):
        run_tune(TuneOptions(model="gpt2-1.3b", profile=p, trials=3, output_dir=tmp_path,
                             gpu_memory_budget="10"))


def test_missing_profile_field_is_named(tmp_path):
    data = json.loads(shipped_profile().read_text())
    del data["copies"]["duplex_h2d"]["fit"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="copies.duplex_h2d.fit"):
        run_tune(TuneOptions(model="gpt2-1.3b", profile=bad, trials=3, output_dir=tmp_path))


def test_cli_tune_writes_config_report_and_timeline(tmp_path):
    r = CliRunner().invoke(app, ["tune", "--trials", "10", "--output-dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["kind"] == "dostune.tune-result" and res["trials"] == 10
    assert (tmp_path / "ds_config.json").exists() and (tmp_path / "timeline.png").stat().st_size > 1000
    assert "shipped H200 profile" in r.output
    # the shipped default was measured by this dostune: a first run is not told to profile again
    assert "profile again with this dostune" not in r.output


def test_cli_validate_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    r = CliRunner().invoke(app, ["tune", "--trials", "3", "--output-dir", str(tmp_path), "--validate", "2"])
    assert r.exit_code == 2 and "needs a CUDA GPU" in r.output


def test_resident_subgroups_fill_the_peak_allowance(space):
    from dostune.tune.space import Candidate

    assert space.max_peak_gib is not None
    c = Candidate(25_000_000, 9, 3, 16, "gpu_convert", True, True)
    p = space.evaluate(c)
    r = p.schedule.resident_subgroups
    assert 0 < r < 9
    assert p.memory.peak_gpu_gib <= space.max_peak_gib
    over = space._predict(c, r + 1)  # one more would break the limit
    assert over.memory.peak_gpu_gib > space.max_peak_gib
    assert p.step_s < space._predict(c, 0).step_s


def test_overlap_schedules_let_every_streamed_gpu_subgroup_swing(space):
    """adaptive_swing is emitted with overlap_backward, the range the swing can use both ways: every streamed (not
    resident) GPU-lane subgroup to the CPU lane, every CPU-lane subgroup to the GPU lane; the prediction keeps the
    tuned split and counts the extra shadow states in pinned host memory."""
    from dostune.optim.schedule import make_plan, swing_candidates
    from dostune.tune.space import Candidate

    p = space.evaluate(Candidate(25_000_000, 9, 3, 16, "gpu_convert", True, True))
    r = p.schedule.resident_subgroups
    n = len(p.sizes)
    assert 0 < r < 9 and p.schedule.adaptive_swing == max(9 - r, n - 9)
    assert make_plan(n, p.schedule).swing_range == range(-(n - 9), 9 - r + 1)
    fixed = space.predict_schedule(25_000_000, p.schedule.model_copy(update={"adaptive_swing": 0}))
    assert fixed.step_s == p.step_s and fixed.iter_s == p.iter_s
    moved = swing_candidates(len(p.sizes), p.schedule)
    assert len(moved) == 9 - r
    assert p.memory.pinned_host_gib - fixed.memory.pinned_host_gib == pytest.approx(
        12 * sum(p.sizes[i] for i in moved) / 2**30)
    off = space.evaluate(Candidate(25_000_000, 9, 3, 16, "gpu_convert", True, False))
    assert off.schedule.adaptive_swing == 0



def test_a_model_whose_offloaded_state_no_schedule_fits_on_the_host_is_refused_first():
    # llama-13b's offloaded state (18 bytes a parameter, pinned; less what an 80 GB GPU keeps resident) is larger than
    # the shipped H100 node's host memory: refused before the missing model profile is asked for (profiling it would
    # be killed by the OOM killer). The H200 node's GPU keeps enough of it resident: tune asks for the model profile.
    with pytest.raises(DostuneError, match="pin at least 148.0 GiB of host memory for llama-13b"):
        build_space(TuneOptions(model="llama-13b", profile=shipped_profile("h100-pcie5.json")))
    with pytest.raises(DostuneError, match="no model profile for llama-13b on h200-pcie5"):
        build_space(TuneOptions(model="llama-13b", profile=shipped_profile()))


@pytest.fixture
def notes_from(tmp_path):
    """The notes `dostune tune` writes from the shipped gpt2-1.3b model profile changed by ``update`` (its fields):
    those that contain ``key``."""
    from dostune.profile.model_record import load_model_profile

    shipped = default_model_profile()

    def notes(key, **update):
        path = tmp_path / "gpt2-1.3b-profile.json"
        path.write_text(load_model_profile(shipped).model_copy(update=update).model_dump_json())
        opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), model_profile=path)
        build_space(opts)
        return [n for n in opts.notes + opts.details if key in n]

    return notes


def _probe_rounds(forward, no_copy, beside=None):
    from dostune.profile.model_record import ProbeRound

    return [ProbeRound(t_s=float(i), forward_s=f, no_copy_s=n, beside_lane_s=b)
            for i, (f, n, b) in enumerate(zip(forward, no_copy, beside or [None] * len(forward)))]


def test_tune_names_the_passes_whose_time_moved_over_the_model_profiles_probe_rounds(notes_from):
    # a detail (--verbose, tune.json): host-paced passes wander on an idle machine too
    # forward 1.0-1.4 s over eight rounds: quartiles 1.025 and 1.375 about a median of 1.2; backward beside the lane
    # 3.0 and 3.5 s; backward without copies steady
    forward = [1.0, 1.0, 1.1, 1.1, 1.3, 1.3, 1.4, 1.4]
    [note] = notes_from("host's speed moved", probe_rounds=_probe_rounds(forward, [2.0] * 8, [3.0, 3.5] * 4))
    assert note == ("the host's speed moved while the model profile timed its passes (forward by about 29%, backward "
                    "beside the CPU lane by about 15% from one probe round to another): the predictions take each "
                    "pass's typical time, so a measured iteration may be off by as much")
    # within 10%, or too few rounds to say: nothing to say
    assert notes_from("host's speed moved", probe_rounds=_probe_rounds([1.0, 1.05] * 4, [2.0] * 8)) == []
    assert notes_from("host's speed moved", probe_rounds=_probe_rounds(forward[:3], [2.0] * 3)) == []


def test_tune_repeats_the_steal_its_model_profile_was_measured_under(notes_from):
    # a profile timed while the hypervisor took CPU time is a slower host's: said again beside the predictions
    [note] = notes_from("hypervisor", steal=0.021)
    assert note.startswith("the hypervisor took 2.1% of the machine's CPU time while gpt2-1.3b-profile.json timed "
                           "ZeRO-Offload's iterations") and "profile again when the host is quiet" in note
    assert notes_from("hypervisor", steal=0.002) == []
