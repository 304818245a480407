import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
from dostune.errors import ConfigError, DostuneError
from dostune.optim.schedule import ScheduleConfig
from dostune.train.loop import TrainOptions, train

STEPS = 8


def write_config(tmp_path, schedule=ScheduleConfig(gpu_fraction=0.5), name="ds_config.json", **train_kw):
    cfg = deepspeed_config(TrainSettings(micro_batch=2, lr=1e-3, warmup_steps=3, **train_kw),
                           OffloadSettings(sub_group_size=20_000, pin_memory=False, schedule=schedule))
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def opts(cfg, save_dir=None, steps=STEPS, **kw):
    return TrainOptions(config=cfg, model="gpt2-tiny", steps=steps, seq=16, save_dir=save_dir, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return train(opts(write_config(tmp), tmp / "ckpt"))


def test_runs_with_the_interleaved_optimizer(uninterrupted):
    assert uninterrupted.optimizer == "InterleavedZeroOptimizer"
    assert uninterrupted.steps_run == STEPS and len(uninterrupted.losses) == STEPS


def _optimizer_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    tag = (ckpt_dir / "latest").read_text().strip()
    (path,) = (ckpt_dir / tag).glob("*optim_states.pt")
    sd = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    out = {f"fp32.{i}": t for i, t in enumerate(sd["fp32_flat_groups"])}
    for k, st in sd["optimizer_state_dict"]["state"].items():
        out.update({f"{name}.{k}": st[name] for name in ("exp_avg", "exp_avg_sq")})
    return out


@pytest.mark.parametrize("variant", [{}, {"overlap_backward": True}, {"resident_subgroups": 1, "expected_subgroups": 5},
                                     {"overlap_backward": True, "speculative_subgroups": 1}])
def test_resume_is_bit_exact(tmp_path, variant):
    # Resuming into step 6 with beta2=0.999 matters: pow(0.999, 6), which DeepSpeed's C++ Adam uses in a
    # fresh process, differs in the last bit from the running product of an uninterrupted run. bf16 params
    # would hide that from the loss for a while, so the fp32 master weights and Adam states are compared.
    # With overlap_backward the CPU lane's constants are fixed during backward, before the step replays them.
    # A resident subgroup's state lives on the GPU lane's device only: the checkpoints carry it from there and the
    # resumed run updates the loaded one. With one speculative subgroup the other CPU-lane one is updated in place.
    cfg = write_config(tmp_path, ScheduleConfig(gpu_fraction=0.5, **variant), betas=(0.9, 0.999))
    full = train(opts(cfg, tmp_path / "full"))
    first = train(opts(cfg, tmp_path / "ckpt", steps=5))
    rest = train(opts(cfg, tmp_path / "ckpt", resume=True))
    assert rest.first_step == 5
    assert first.losses + rest.losses == full.losses
    a, b = _optimizer_state(tmp_path / "full"), _optimizer_state(tmp_path / "ckpt")
    assert a.keys() == b.keys() and len(a) > 3
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_deterministic_is_strict_mode(tmp_path):
    # warn_only=True would keep flash attention's racy backward on a GPU (the drift measured on the H100);
    # strict mode must also not trip over any op of the training path.
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        res = train(opts(write_config(tmp_path), steps=2, deterministic=True))
        assert res.steps_run == 2
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


RESIDENT = ScheduleConfig(gpu_fraction=0.6, resident_subgroups=2, expected_subgroups=5)  # 0-1 resident, 2 streamed


@pytest.mark.parametrize("first_plain", [True, False])
@pytest.mark.parametrize("schedule", [ScheduleConfig(gpu_fraction=0.5), RESIDENT], ids=["streamed", "resident"])
def test_checkpoints_cross_load_between_deepspeed_and_dostune(tmp_path, uninterrupted, first_plain, schedule):
    cfg = write_config(tmp_path, schedule)
    first = train(opts(cfg, tmp_path / "ckpt", steps=4, plain_deepspeed=first_plain))
    rest = train(opts(cfg, tmp_path / "ckpt", resume=True, plain_deepspeed=not first_plain))
    assert {first.optimizer, rest.optimizer} == {"DeepSpeedZeroOptimizer_Stage3", "InterleavedZeroOptimizer"}
    # same math on both sides: the mixed run is the uninterrupted one. (Resuming into step 5, where the
    # pow() plain DeepSpeed uses after a load equals the running product; at other steps plain DeepSpeed's
    # own resume drifts in the last bit, see InterleavedZeroOptimizer._dostune_sync_beta_powers.)
    assert first.losses + rest.losses == uninterrupted.losses


def test_resident_checkpoint_round_trip_through_plain_deepspeed_is_bit_exact(tmp_path, uninterrupted):
    """The resident subgroups' state is DeepSpeed's own (its Twin-Flow placement), so their checkpoint is DeepSpeed's:
    dostune -> plain DeepSpeed ZeRO-Offload (ratio 1.0, everything on the host) -> dostune again trains the
    uninterrupted run, and ends in the same fp32 params and Adam states, bit for bit."""
    cfg = write_config(tmp_path, RESIDENT)
    assert json.loads(cfg.read_text())["zero_optimization"]["offload_optimizer"]["ratio"] < 1.0
    legs = [train(opts(cfg, tmp_path / "ckpt", steps=4)),
            train(opts(cfg, tmp_path / "ckpt", steps=6, resume=True, plain_deepspeed=True)),  # resumes into step 5
            train(opts(cfg, tmp_path / "ckpt", resume=True))]
    assert [leg.optimizer for leg in legs] == ["InterleavedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
                                                "InterleavedZeroOptimizer"]
    assert sum((leg.losses for leg in legs), []) == uninterrupted.losses
    ours, ref = _optimizer_state(tmp_path / "ckpt"), _optimizer_state(Path(uninterrupted.checkpoints[-1]).parent)
    assert ours.keys() == ref.keys() and len(ours) > 3
    assert all(torch.equal(ours[k], ref[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], ref[k])]


def test_ctrl_c_saves_and_resume_continues(tmp_path, uninterrupted):
    cfg = write_config(tmp_path)

    def interrupt(rec):
        if rec.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    got = train(opts(cfg, tmp_path / "ckpt"), on_step=interrupt)
    assert got.interrupted and got.last_step == 2
    assert (tmp_path / "ckpt" / "step2").is_dir()
    rest = train(opts(cfg, tmp_path / "ckpt", resume=True))
    assert got.losses + rest.losses == uninterrupted.losses


def test_text_corpus_and_metrics(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("offloaded optimizer states stream over pcie. " * 400)
    (corpus / "b.md").write_text("the cpu and the gpu update subgroups together. " * 400)
    metrics = tmp_path / "m.jsonl"
    r = CliRunner().invoke(app, ["train", "--config", str(write_config(tmp_path)), "--model", "gpt2-tiny", "--steps",
                                 "12", "--seq", "32", "--data", str(corpus), "--metrics", str(metrics),
                                 "--log-every", "4", "--json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 13))
    assert {"loss", "tokens_per_s", "fwd_s", "bwd_s", "step_s", "lr", "grad_norm", "swing"} <= set(lines[0])
    assert {x["swing"] for x in lines} == {None}  # the schedule has no adaptive_swing
    assert lines[-1]["loss"] < lines[0]["loss"]  # repetitive text: learnable within a few steps
    assert json.loads(r.stdout)["optimizer"] == "InterleavedZeroOptimizer"


def test_each_step_records_the_swing_it_ran(tmp_path):
    """With adaptive_swing each step's record carries the split it ran (the CPU device measures no lane, so the swing
    stays at the tuned split, 0); plain DeepSpeed records none."""
    sched = ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", adaptive_swing=2)
    records = []
    train(opts(write_config(tmp_path, sched), steps=3), on_step=records.append)
    assert [r.swing for r in records] == [0, 0, 0]
    records.clear()
    train(opts(write_config(tmp_path, sched), steps=2, plain_deepspeed=True), on_step=records.append)
    assert [r.swing for r in records] == [None, None]


def test_a_run_that_fails_in_its_first_step_writes_no_metrics(tmp_path):
    """The metrics file is opened at the first step's record: a run that never finished a step leaves none."""
    from dataclasses import replace

    from dostune.train.loop import check_options

    class Unreadable:
        def batch(self, *args):
            raise DostuneError("the corpus went away")

    o = opts(write_config(tmp_path), metrics=tmp_path / "runs" / "metrics.jsonl")
    with pytest.raises(DostuneError, match="the corpus went away"):
        train(o, prepared=replace(check_options(o), data=Unreadable()))
    assert not (tmp_path / "runs").exists()


def test_the_last_lines_say_what_was_saved_where_and_what_next(tmp_path):
    cfg, save = write_config(tmp_path), tmp_path / "ckpt"
    r = CliRunner().invoke(app, ["train", "--config", str(cfg), "--model", "gpt2-tiny", "--steps", "2", "--seq", "16",
                                 "--save-dir", str(save)])
    assert r.exit_code == 0, r.output
    tail = r.output.splitlines()[-4:]
    assert tail[0] == "trained steps 1-2 with dostune's interleaved CPU+GPU optimizer"
    assert tail[1] == f"metrics: {save / 'metrics.jsonl'} (one JSON line per step)"
    assert tail[2].startswith(f"checkpoint: {save / 'step2'} ")
    assert tail[3] == (f"to train further: dostune train --config {cfg} --model gpt2-tiny --steps 4 --seq 16 "
                       f"--save-dir {save} --resume")
    assert "InterleavedZeroOptimizer" not in r.output
    r = CliRunner().invoke(app, ["train", "--config", str(cfg), "--model", "gpt2-tiny", "--steps", "4", "--seq", "16",
                                 "--save-dir", str(save), "--resume"])
    assert r.exit_code == 0 and "trained steps 3-4" in r.output, r.output


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def test_corrupt_checkpoint_is_a_clear_error_and_left_alone(tmp_path):
    cfg = write_config(tmp_path)
    train(opts(cfg, tmp_path / "ckpt", steps=2))
    for f in (tmp_path / "ckpt" / "step2").glob("*optim_states.pt"):
        f.write_bytes(f.read_bytes()[:100])  # truncated
    before = _tree_hash(tmp_path / "ckpt")
    with pytest.raises(DostuneError, match="could not be loaded"):
        train(opts(cfg, tmp_path / "ckpt", resume=True))
    assert _tree_hash(tmp_path / "ckpt") == before


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
    cfg = write_config(tmp_path)
    train(opts(cfg, tmp_path / "ckpt", steps=2))
    before = _tree_hash(tmp_path / "ckpt")
    with pytest.raises(DostuneError, match=r"already holds checkpoints \(latest: step2\)") as e:
        train(opts(cfg, tmp_path / "ckpt", steps=3))
    assert "--resume" in e.value.hint
    assert _tree_hash(tmp_path / "ckpt") == before


def test_bad_inputs(tmp_path):
    with pytest.raises(DostuneError, match="does not exist"):
        train(opts(tmp_path / "missing.json"))
    with pytest.raises(DostuneError, match="unknown model"):
        train(TrainOptions(config=write_config(tmp_path), model="gpt5-giant", steps=2, seq=16))
    with pytest.raises(DostuneError, match="no checkpoint"):
        train(opts(write_config(tmp_path), tmp_path / "empty", resume=True))
    bad = json.loads(write_config(tmp_path).read_text())
    bad["zero_optimization"]["stage"] = 2
    (tmp_path / "stage2.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="stage 3"):
        train(opts(tmp_path / "stage2.json"))
    fixed = json.loads(write_config(tmp_path).read_text())
    fixed["train_batch_size"] = 99  # pinned for another GPU count
    (tmp_path / "batch.json").write_text(json.dumps(fixed))
    with pytest.raises(ConfigError, match=r"train_batch_size 99 != micro-batch 2 x gradient accumulation 1 x 1"):
        train(opts(tmp_path / "batch.json"))


def test_subgroup_count_mismatch(tmp_path):
    cfg = write_config(tmp_path, ScheduleConfig(gpu_fraction=0.5, expected_subgroups=9))
    # refused from the parameter shapes, before an engine is built
    with pytest.raises(ConfigError, match="tuned for 9 subgroups but gpt2-tiny has 5") as e:
        train(opts(cfg))
    assert "dostune refit" in e.value.hint


def test_staging_larger_than_the_gpu_is_refused():
    from types import SimpleNamespace

    from dostune.optim.footprint import check_staging_fits

    opt = SimpleNamespace(fp16_partitioned_groups_flat_numel=[10**9] * 4)
    sched = ScheduleConfig(gpu_fraction=1.0, staging_buffers=4)
    with pytest.raises(ConfigError, match="stages .* GiB on the GPU during the step, but only 10.0 GiB"):
        check_staging_fits(opt, sched, capacity_bytes=10 * 2**30)
    check_staging_fits(opt, ScheduleConfig(gpu_fraction=0.0, upload="cpu_convert"), capacity_bytes=10 * 2**30)
    # one resident subgroup of four on the GPU lane: its params and gradients are on the device already (8 GB of
    # its 16), its Adam states (8 GB) still to come, beside three streamed ones (12 GB of kept gradients) through a
    # 12 GB slot: 32 GB more
    one = ScheduleConfig(gpu_fraction=1.0, staging_buffers=1, resident_subgroups=1)
    check_staging_fits(opt, one, capacity_bytes=32 * 10**9)
    with pytest.raises(ConfigError, match="stages 29.8 GiB"):
        check_staging_fits(opt, one, capacity_bytes=32 * 10**9 - 1)


def test_host_memory_the_optimizer_would_still_allocate_is_refused_with_the_numbers():
    from types import SimpleNamespace

    from dostune.optim.footprint import check_host_fits

    states = [{}, {}, {"step": 1}, {"step": 1}]  # DeepSpeed created the Adam states of the last two only
    flat = [object() for _ in states]
    opt = SimpleNamespace(fp16_partitioned_groups_flat_numel=[10**9] * 4, fp32_partitioned_groups_flat=flat,
                          optimizer=SimpleNamespace(state=dict(zip(flat, states))))
    # 2 CPU-lane subgroups: 24 GB of shadow states + 4 GB of half buffers, and 16 GB of Adam states still to create
    sched = ScheduleConfig(gpu_fraction=0.5, overlap_backward=True)
    with pytest.raises(ConfigError, match=r"needs 41.0 GiB more host memory on this rank \(Adam states 14.9, the "
                                          r"lanes' buffers 26.1 \(shadow states .*only 16.0 GiB"):
        check_host_fits(opt, sched, available=16 * 2**30)
    check_host_fits(opt, sched, available=64 * 2**30)
    with pytest.raises(ConfigError, match=r"needs 14.9 GiB more host memory on this rank \(Adam states 14.9"):
        check_host_fits(opt, ScheduleConfig(gpu_fraction=0.5), available=10 * 2**30)  # no overlap: the states
    check_host_fits(opt, ScheduleConfig(gpu_fraction=0.5), available=16 * 2**30)
    # the resident subgroups (0 and 1) create their Adam states on the GPU: nothing left to allocate on the host
    check_host_fits(opt, ScheduleConfig(gpu_fraction=0.5, resident_subgroups=2), available=2**20)
    with pytest.raises(ConfigError, match=r"needs 7.5 GiB more host memory on this rank \(Adam states 7.5 GiB"):
        check_host_fits(opt, ScheduleConfig(gpu_fraction=0.5, resident_subgroups=1), available=2**20)
    # shadows for one speculative subgroup (12 GB) instead of both, beside the ring of two 2 GB buffers
    with pytest.raises(ConfigError, match=r"needs 29.8 GiB .*\(Adam states 14.9, the lanes' buffers 14.9 \(shadow"):
        check_host_fits(opt, sched.model_copy(update={"speculative_subgroups": 1}), available=16 * 2**30)


def test_deepspeed_offload_host_memory_rounds_pinned_buffers_up_to_powers_of_two():
    from dostune.optim.footprint import deepspeed_offload_host_bytes

    sizes = [100, 100, 28]  # gradients 400, 400, 112 bytes -> 512, 512, 128; the bf16 buffer 456 -> 512
    assert deepspeed_offload_host_bytes(sizes, pin_memory=False) == 18 * 228
    assert deepspeed_offload_host_bytes(sizes, pin_memory=True) == 4 * 228 + 512 + 512 + 128 + 512 + 8 * 228
    assert deepspeed_offload_host_bytes(sizes, pin_memory=False, grad_buffer=4) == 20 * 228


def test_cli_train_help_mentions_the_launcher():
    r = CliRunner().invoke(app, ["train", "--help"])
    assert r.exit_code == 0 and "deepspeed --num_gpus 2 --module dostune.train" in " ".join(r.stdout.split())


def _launch_two_ranks(tmp_path, cfg, runs: dict[str, tuple[str, ...]]) -> dict[str, list[list[dict]]]:
    """One launch of 2 ranks for each entry of ``runs`` (metrics name -> extra `dostune train` options), all at once:
    each rank's logged steps, by name."""
    import socket
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    procs = {}
    for name, extra in runs.items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
             "--module", "dostune.train", "--config", str(cfg), "--model", "gpt2-tiny", "--steps", "3", "--seq", "16",
             "--metrics", str(tmp_path / f"{name}.jsonl"), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, p in procs.items():
        out = p.communicate(timeout=400)[0]
        assert p.returncode == 0, f"{name}: {out[-5000:]}"
    return {name: [[json.loads(line) for line in f.read_text().splitlines()]
                   for f in (tmp_path / f"{name}.jsonl", tmp_path / f"{name}.rank1.jsonl")] for name in runs}


@pytest.mark.slow
def test_two_ranks_through_deepspeeds_launcher_match_plain_deepspeed(tmp_path):
    """Data-parallel ZeRO-3 with the interleaved optimizer on each rank, launched the documented way (gloo on a CPU
    machine), overlap_backward on: each rank speculates on its own partition and all commit on the same global
    norm. Each rank logs its own steps; the gradient norm is global, so the ranks agree on it while their losses
    (different micro-batches) differ, and each rank's losses equal plain DeepSpeed's."""
    from conftest import _ds_shm_buffers

    cfg = write_config(tmp_path, ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", overlap_backward=True))
    shm = _ds_shm_buffers()
    runs = _launch_two_ranks(tmp_path, cfg, {"ours": (), "ref": ("--plain-deepspeed",)})
    # DeepSpeed's CPU all-reduce buffers (one per rank) are gone with their ranks (train.engine)
    assert _ds_shm_buffers() - shm == set()
    ours, ref = runs["ours"], runs["ref"]
    assert [len(x) for x in ours] == [3, 3]
    assert [x["grad_norm"] for x in ours[0]] == [x["grad_norm"] for x in ours[1]]
    assert [x["loss"] for x in ours[0]] != [x["loss"] for x in ours[1]]
    for a, b in zip(ours, ref):
        assert [x["loss"] for x in a] == [x["loss"] for x in b]
        assert [x["grad_norm"] for x in a] == [x["grad_norm"] for x in b]
