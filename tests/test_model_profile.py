import json
import os

import pytest
import torch
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.profile.memory_figure import plot_memory_timeline
from dostune.profile.model import ModelProfileOptions, measure_model
from dostune.profile.model_record import load_model_profile
from dostune.records import save_record

from stolen_host import FirstRunStolen


@pytest.fixture(scope="module")
def prof():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("dostune.profile.model.QuietRuns", FirstRunStolen)
        mp.setattr("dostune.profile.backward_probes.QuietRuns", FirstRunStolen)
        return measure_model(ModelProfileOptions(model="gpt2-tiny", micro_batch=2, seq=32, sub_group_size=20_000,
                                                 reduce_bucket_size=3_000, iters=2, warmup=1, probe_seconds=2.0,
                                                 second_window=True),
                             command="pytest")


def test_timeline_has_the_three_phases_in_order(prof):
    phases = [s.phase for s in prof.memory_timeline]
    order = {"fwd": 0, "bwd": 1, "step": 2}
    assert phases[0] == "fwd" and phases[-1] == "step"
    assert all(order[a] <= order[b] for a, b in zip(phases, phases[1:]))
    assert set(phases) == {"fwd", "bwd", "step"}
    times = [s.t for s in prof.memory_timeline]
    assert times == sorted(times)
    # module boundaries were sampled, not just phase edges
    assert any(s.where.endswith(":enter") for s in prof.memory_timeline)
    assert any(s.where.endswith(":grad") for s in prof.memory_timeline)


def test_grad_ready_times_follow_backward_block_by_block(prof):
    ready = [s.grad_ready_s for s in prof.subgroups]
    assert len(ready) == 5 and all(r is not None for r in ready)
    # Backward runs from the last block to the first, and each block (a ZeRO-3 leaf module, leaf_blocks.py) hands its
    # gradients over together when its backward ends, in forward order. gpt2-tiny's subgroups: 0 the embeddings (tied
    # to the head), 1 the first block's head, 2 its tail and the second block's head, 3 more of the second block, 4
    # its tail and the final norm: every subgroup with a parameter of the first block is final after the last two.
    assert max(ready[3:]) < min(ready[:3])
    assert ready[0] > ready[-1]
    assert all(0 <= r <= prof.backward_s * 1.5 for r in ready)


def test_counts_and_phases(prof):
    assert prof.params == 141056 and sum(s.numel for s in prof.subgroups) == prof.params
    assert prof.optimizer_state_bytes == 16 * prof.params
    assert set(prof.phases) == {"fwd", "bwd", "step"}
    assert all(p.time_s.median > 0 for p in prof.phases.values())
    assert prof.device == "cpu" or prof.phases["bwd"].free_gib is not None


def test_the_gradient_norm_of_each_timed_iteration_against_the_clipping_it_ran_with(prof):
    # DeepSpeed's global norm after each kept timed iteration (a freshly initialised model's), and the clipping of the
    # profile's engine (TrainSettings' default)
    assert len(prof.grad_norms) == prof.iterations and all(x is not None and x > 0 for x in prof.grad_norms)
    assert prof.clip_threshold == 1.0
    lowest, highest = min(prof.grad_norms), max(prof.grad_norms)
    assert prof.clipped(lowest / 2) == (prof.iterations, prof.iterations)
    assert prof.clipped(highest * 2) == (0, prof.iterations)
    assert prof.clipped(0.0) == (0, prof.iterations)  # off: nothing clips


def test_a_profile_from_before_the_norms_reads_with_none(tmp_path):
    import json

    from dostune.profile.paths import profiles_dir

    # the shipped profile as schema 12 wrote it: without the norms and their threshold
    data = json.loads((profiles_dir() / "h200-pcie5-gpt2-1.3b-b8-s1024.json").read_text())
    data.update(schema_version=12)
    for key in ("grad_norms", "clip_threshold"):
        data.pop(key)
    (tmp_path / "v12.json").write_text(json.dumps(data))
    old = load_model_profile(tmp_path / "v12.json")
    assert old.schema_version == 12 and old.grad_norms == [] and old.clip_threshold is None
    assert old.clipped(1.0) is None


def test_round_trip_and_plot(prof, tmp_path):
    path = save_record(prof, tmp_path / "m.json")
    assert load_model_profile(path) == prof
    png = plot_memory_timeline(prof, tmp_path / "m.png")
    assert png.stat().st_size > 1000


def test_the_standard_mode_measures_less_and_thorough_as_every_profile_did_before_the_modes():
    from dostune.errors import DostuneError
    from dostune.profile.model import MODEL_EFFORT, ModelEffort

    # --thorough: the counts of every model profile measured before the modes, which the validations used
    assert MODEL_EFFORT["thorough"] == ModelEffort(iters=5, probe_seconds=60.0, step_lane_rounds=20, second_window=True)
    standard = ModelProfileOptions()
    assert (standard.mode, standard.iters, standard.step_lane_rounds, standard.second_window) == ("standard", 3, 10,
                                                                                                  False)
    assert standard.resolved_probe_seconds(cuda=True) == 10.0
    thorough = ModelProfileOptions.of_mode("thorough", model="gpt2-tiny", iters=None, probe_seconds=None)
    assert (thorough.mode, thorough.model, thorough.iters, thorough.step_lane_rounds, thorough.second_window) == (
        "thorough", "gpt2-tiny", 5, 20, True)
    assert thorough.resolved_probe_seconds(cuda=True) == 60.0
    # without a GPU the probes' rounds run in a row in either mode (such a profile tunes nothing real); counts given
    # win over the mode's
    assert thorough.resolved_probe_seconds(cuda=False) == standard.resolved_probe_seconds(cuda=False) == 0.0
    given = ModelProfileOptions.of_mode("thorough", iters=2, probe_seconds=7.0)
    assert (given.mode, given.iters, given.resolved_probe_seconds(cuda=True)) == ("thorough", 2, 7.0)
    with pytest.raises(DostuneError, match="standard or thorough"):
        ModelProfileOptions.of_mode("sloppy")


def test_cli_model_profile_goes_beside_the_node_profile_by_default(tmp_path, monkeypatch):
    """profiles/NODE-MODEL-bB-sS.json in the current folder, NODE the node profile's own default name: the file
    `dostune tune` looks for beside profiles/NODE.json. The path is checked before anything is measured, so an
    existing one is refused at once."""
    monkeypatch.chdir(tmp_path)
    default = tmp_path / "profiles" / f"cpu-{os.cpu_count()}c-gpt2-tiny-b2-s32.json"
    default.parent.mkdir()
    default.write_text("precious")
    r = CliRunner().invoke(app, ["profile", "--model", "gpt2-tiny", "--micro-batch", "2", "--seq", "32"])
    assert r.exit_code == 2 and "already exists" in r.output and default.read_text() == "precious", r.output
    for bad, says in ((["--quick"], "--quick profiles the node"), (["--thorough", "--quick"], "contradict")):
        r = CliRunner().invoke(app, ["profile", "--model", "gpt2-tiny", *bad])
        assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_cli_model_profile_bad_model():
    r = CliRunner().invoke(app, ["profile", "--model", "gpt9-huge"])
    assert r.exit_code == 2 and "unknown model" in r.output


def test_schema_3_measures_the_models_coefficients(prof):
    """What the performance model takes from a model profile besides the phases (docs/performance-model.md): all
    measured here on the CPU at a tiny size; tests/test_gpu.py measures them on a GPU."""
    from dostune.host_steal import cpu_times
    from dostune.perfmodel.coefficients import Coefficients
    from dostune.perfmodel.inputs import ModelInputs, NodeInputs
    from dostune.profile.paths import shipped_profile
    from dostune.profile.record import load_node_profile
    from dostune.profile.step_parts import PROLOGUE

    assert prof.schema_version == 13 and prof.offload_pin_memory is True and prof.offload_pinned
    # v12: the mode whose counts it took (the options' defaults: standard), and the node as the node profile names it
    assert prof.mode == "standard" and prof.node == f"cpu-{os.cpu_count()}c"
    assert prof.step_lane is None  # v10: measured beside copies, so only on a GPU (tests/test_profile_gpu.py)
    # v5: the hypervisor's share of the CPU while the iterations were timed, where /proc/stat has it (Linux)
    assert (prof.steal is None) == (cpu_times() is None) and (prof.steal is None or 0.0 <= prof.steal < 1.0)
    # v6: the first timed iteration and the first round of probes were stolen from (the fixture's host): each was set
    # aside and another ran; the iteration that records the timeline is not among the timed ones
    for aside in (prof.set_aside, prof.probes_set_aside):
        assert aside.runs == 1 and aside.steal == [0.5] and len(aside.seconds) == 1 and aside.waited_s == 0
    assert any(n.startswith("1 timed iteration set aside, each run again: the hypervisor took 50.0%") for n in prof.notes)
    assert any(n.startswith("1 round of the backward probes set aside") for n in prof.notes)
    assert all(p.time_s.n == 2 for p in prof.phases.values())
    # v8: the probes' rounds ran for 2 s (as many as fit, at least --iters of them: on a loaded 2-core machine a
    # round of this tiny model took 1 s), each round's readings kept in order
    rounds = prof.probe_rounds
    assert prof.probe_seconds == 2.0 and len(rounds) >= 2 and prof.backward_no_copy_s.n == len(rounds)
    assert rounds[0].t_s == 0 and [r.t_s for r in rounds] == sorted(r.t_s for r in rounds)
    assert rounds[-1].t_s > 0.5
    assert prof.probe_forward_s.n == len(rounds) and prof.backward_no_copy_s.median > 0
    assert all(r.pinned_copy_s is None and r.beside_lane_s > 0 for r in rounds)
    assert prof.backward_pinned_copy is None  # page-locked copies need a CUDA GPU (tests/test_profile_gpu.py)
    lane = prof.backward_lane
    assert lane.threads >= 1 and lane.elements == 65_536 and lane.lane_beside_s.n >= 1
    assert lane.lane_alone_s.median > 0 and lane.backward_s.n == len(rounds)
    # the lane alone in the main thread: every burst's updates after its untimed first (--iters of them per burst)
    from dostune.profile.backward_probes import LANE_ALONE_BURSTS, LANE_THREAD_UPDATES
    assert lane.lane_alone_s.n == LANE_ALONE_BURSTS * 2
    # v7: the lane alone timed in its own thread too, every update after the untimed first
    assert lane.lane_alone_thread_s.n == LANE_THREAD_UPDATES and lane.lane_alone_thread_s.median > 0
    assert set(PROLOGUE) | {"_post_step", "engine"} <= set(prof.step_parts_s)
    assert all(v >= 0 for v in prof.step_parts_s.values())
    sizes = [s.numel for s in prof.subgroups]
    assert [p.size for p in prof.ds_cpu_adam.points] == sizes and [p.size for p in prof.ds_unscale.points] == sizes
    assert all(p.seconds.n == 2 and p.threads >= 1 for p in prof.ds_cpu_adam.points)
    m = ModelInputs.from_profile(prof)
    assert m.bwd_no_copy_s and m.bwd_beside_lane_s and m.step_shares is not None
    assert m.fwd_s == prof.probe_forward_s.median  # forward over the probes' span, not the two timed iterations
    c = Coefficients.of(NodeInputs.from_profile(load_node_profile(shipped_profile())), m, sizes)
    assert not [n for n in c.notes if "re-profile the model" in n]
    assert c.backward.compute_s == prof.backward_no_copy_s.median


def test_schema_11_times_the_step_again_after_the_probes(prof):
    """A second window of timed iterations after the backward probes (StepWindow); the model takes the mean of the two
    windows' step, step overhead and CPU Adam and unscale rates, and a profile without it the first window's alone."""
    from dostune.perfmodel.inputs import ModelInputs

    later = prof.later_window
    # after the probes' 2 s, each window as many kept iterations as --iters; the fixture's host stole from the first
    # run of each window, which was set aside and run again
    assert later.after_s > prof.probe_seconds and later.step_s.n == 2 and later.step_s.median > 0
    assert later.set_aside.runs == 1 and later.set_aside.steal == [0.5]
    sizes = [s.numel for s in prof.subgroups]
    assert [p.size for p in later.ds_cpu_adam.points] == sizes and [p.size for p in later.ds_unscale.points] == sizes
    assert all(p.seconds.n == 2 for p in later.ds_cpu_adam.points) and later.step_overhead_s > 0
    both = ModelInputs.from_profile(prof)
    assert both.ds_step_s == pytest.approx((prof.phases["step"].time_s.median + later.step_s.median) / 2)
    assert both.step_overhead_s == pytest.approx((prof.step_overhead_s + later.step_overhead_s) / 2)
    for merged, a, b in zip(both.ds_cpu_adam.points, prof.ds_cpu_adam.points, later.ds_cpu_adam.points):
        assert merged.size == a.size and merged.seconds.median == pytest.approx((a.seconds.median + b.seconds.median) / 2)
        assert merged.seconds.n == 4
    first = ModelInputs.from_profile(prof.model_copy(update={"later_window": None}))
    assert first.ds_step_s == prof.phases["step"].time_s.median and first.step_overhead_s == prof.step_overhead_s
    assert first.ds_cpu_adam == prof.ds_cpu_adam and first.ds_unscale == prof.ds_unscale


def test_the_probes_rounds_fill_their_seconds_and_every_rank_runs_the_most_any_needs():
    from dostune.profile.backward_probes import MAX_ROUNDS, probe_rounds

    alone = lambda wanted: [wanted]  # noqa: E731 (one rank)
    assert probe_rounds(5, 0.0, 0.3, alone) == 5  # no span: --iters rounds in a row
    assert probe_rounds(5, 60.0, 0.5, alone) == 120
    assert probe_rounds(5, 60.0, 100.0, alone) == 5  # rounds longer than the span: still --iters of them
    assert probe_rounds(5, 60.0, 1e-4, alone) == MAX_ROUNDS
    # under the launcher each rank times its own first pass; they must run as many rounds (collectives in backward)
    assert probe_rounds(5, 60.0, 0.5, lambda wanted: [wanted, 200, 7]) == 200


def test_pass_spread_is_each_passs_interquartile_range_over_its_median(prof):
    from dostune.profile.model_record import ProbeRound

    def spread(rounds):
        return prof.model_copy(update={"probe_rounds": rounds}).pass_spread()

    # forward 1..8 s: quartiles 2.25 and 6.75 (statistics.quantiles' default), median 4.5; backward beside the lane
    # never ran
    rounds = [ProbeRound(t_s=i, forward_s=i + 1.0, no_copy_s=2.0) for i in range(8)]
    assert spread(rounds) == {"forward_s": pytest.approx(1.0), "no_copy_s": 0.0}
    assert spread(rounds[:3]) == {}  # too few rounds for quartiles
    assert spread([]) == {}  # profiles before schema 8


def test_the_step_lane_probe_keeps_the_updates_that_ran_beside_both_copy_directions():
    from dostune.profile.step_lane import beside_copies, scratch_subgroups

    # 64 MB chunks every 10 ms one way (6.4 GB/s), every 5 ms the other, from the moment they were queued; the down
    # direction ends first, at 40 ms: the update that ended after it is not beside both
    up = [0.01 * k for k in range(1, 7)]
    down = [0.005 * k for k in range(1, 9)]
    kept, h2d, d2h = beside_copies([(0.002, 0.012), (0.012, 0.022), (0.022, 0.038), (0.038, 0.045)], up, down,
                                   64 * 10**6)
    assert kept == pytest.approx([0.010, 0.010, 0.016])
    assert h2d == pytest.approx(6.4) and d2h == pytest.approx(12.8)
    assert beside_copies([(0.05, 0.06)], up, down, 64 * 10**6) == ([], 0.0, 0.0)
    # inputs of 14 bytes per element (bf16 gradients) at least twice the cache, and never one subgroup over and over
    assert scratch_subgroups(10_000_000, torch.bfloat16, 300 << 20) == 5
    assert scratch_subgroups(10**9, torch.bfloat16, 300 << 20) == 2


def test_the_step_lane_reads_in_one_line():
    from dostune.profile.model_record import StepLaneProfile
    from dostune.stats import Stat

    sl = StepLaneProfile(threads=16, elements=10_000_000, subgroups=5, alone_s=Stat.of([0.0030]),
                         beside_copies_s=Stat.of([0.0045]), h2d_gbps=30.2, d2h_gbps=47.5)
    assert sl.describe() == ("CPU lane as the step runs it (16 threads, 5 subgroups of 10M elements in turn): 0.300 ns "
                             "per element alone, 1.50x slower beside 78 GB/s of copies both ways")


def test_a_schema_9_profile_is_refused_and_older_ones_load_without_the_step_lane(tmp_path, prof):
    from dostune.errors import DostuneError

    data = json.loads(prof.model_dump_json())
    data.pop("step_lane")
    data["schema_version"] = 8
    (tmp_path / "v8.json").write_text(json.dumps(data))
    assert load_model_profile(tmp_path / "v8.json").step_lane is None
    data["schema_version"] = 9  # the schema of a lane probe since removed
    (tmp_path / "v9.json").write_text(json.dumps(data))
    with pytest.raises(DostuneError, match="9"):
        load_model_profile(tmp_path / "v9.json")
