"""The faults of shared clusters (docs/faults.md), on the CPU: stop signals, full disks, a kill during a save,
a dead or hung rank of two."""
import errno
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.train import checkpoint, loop
from dostune.train.checkpoint import CheckpointError, read_latest
from dostune.train.loop import train
from test_train import STEPS, _tree_hash, opts, uninterrupted, write_config  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]


def _child_env(**kw) -> dict:
    """This process's environment for a child, without the world-of-one settings the in-process runs left."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), **kw}


def test_sigterm_at_a_random_step_then_resume_is_bitwise(tmp_path, uninterrupted):
    cfg = write_config(tmp_path)
    at = random.randint(1, STEPS - 1)
    handler = signal.getsignal(signal.SIGTERM)

    def term(rec):
        if rec.step == at:
            os.kill(os.getpid(), signal.SIGTERM)

    got = train(opts(cfg, tmp_path / "ckpt"), on_step=term)
    assert (got.stop_signal, got.last_step, read_latest(tmp_path / "ckpt")) == (signal.SIGTERM, at, f"step{at}")
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    rest = train(opts(cfg, tmp_path / "ckpt", resume=True))
    assert got.losses + rest.losses == uninterrupted.losses, f"stopped at step {at}"


def test_cli_sigusr1_exit_code_and_the_printed_resume_command(tmp_path, uninterrupted, monkeypatch):
    cfg = write_config(tmp_path)
    one_step = loop._one_step

    def signal_in_step_3(engine, data, step, *a):
        if step + 1 == 3:  # as the step begins: it must still run whole
            os.kill(os.getpid(), signal.SIGUSR1)
        return one_step(engine, data, step, *a)

    monkeypatch.setattr(loop, "_one_step", signal_in_step_3)
    args = ["--config", str(cfg), "--model", "gpt2-tiny", "--steps", str(STEPS), "--seq", "16",
            "--save-dir", str(tmp_path / "ckpt")]
    r = CliRunner().invoke(app, ["train", *args])
    assert r.exit_code == 128 + signal.SIGUSR1, r.output
    assert "stopped by SIGUSR1 after step 3" in r.output
    (line,) = [x for x in r.output.splitlines() if x.startswith("resume with: ")]
    command = line.removeprefix("resume with: ")
    assert command == "dostune train " + shlex.join(args + ["--resume"])
    monkeypatch.undo()
    r = CliRunner().invoke(app, shlex.split(command)[1:])
    assert r.exit_code == 0, r.output
    metrics = [json.loads(x) for x in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in metrics] == uninterrupted.losses


def _fail_in_save(kind, monkeypatch):
    """Make the save of step 2 fail the way a full or broken disk does."""
    real = torch.save

    def save(obj, f, *a, **kw):
        if kind != "latest" and "step2" in str(f) and "optim_states" in str(f):
            Path(f).write_bytes(b"\0" * 4096)  # the part that fitted
            if kind == "enospc":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 0")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    if kind == "latest":
        replace = os.replace

        def failing_replace(src, dst):
            if Path(dst).name == "latest" and Path(src).read_text() == "step2":
                raise OSError(errno.EIO, "I/O error")
            return replace(src, dst)

        monkeypatch.setattr(os, "replace", failing_replace)


@pytest.mark.parametrize("kind", ["enospc", "torch_stream", "latest"])
def test_a_failed_save_leaves_nothing_half_written(tmp_path, uninterrupted, monkeypatch, kind):
    cfg, ckpt = write_config(tmp_path), tmp_path / "ckpt"
    _fail_in_save(kind, monkeypatch)
    before = {}
    with pytest.raises(CheckpointError) as e:
        train(opts(cfg, ckpt, save_every=1), on_step=lambda rec: before.setdefault(rec.step, _tree_hash(ckpt)))
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg
    assert f"could not write checkpoint {ckpt / 'step2'}" in msg and "needs about" in msg and "free" in msg, msg
    assert {"enospc": "No space left on device", "torch_stream": "unexpected pos", "latest": "I/O error"}[kind] in msg
    assert msg.endswith("removed the partial folder, latest still names step1")
    assert not (ckpt / "step2").exists() and read_latest(ckpt) == "step1"
    assert _tree_hash(ckpt) == before[2]  # step1 and everything else exactly as before the failed save
    assert not list(ckpt.glob(".latest.tmp*"))
    if kind == "enospc":
        monkeypatch.undo()
        rest = train(opts(cfg, ckpt, resume=True))
        assert rest.first_step == 1 and rest.losses == uninterrupted.losses[1:]


def test_space_is_checked_before_a_save(tmp_path, monkeypatch):
    cfg, ckpt = write_config(tmp_path), tmp_path / "ckpt"
    estimates = []
    state_bytes = checkpoint.state_bytes
    monkeypatch.setattr(checkpoint, "state_bytes",
                        lambda engine: estimates.append(state_bytes(engine)) or estimates[-1])
    real_free = checkpoint.free_bytes

    def free(path):  # half of what the previous checkpoint took, once there is one
        prev = read_latest(ckpt)
        return checkpoint._tree_bytes(ckpt / prev) // 2 if prev else real_free(path)

    monkeypatch.setattr(checkpoint, "free_bytes", free)
    before = {}
    with pytest.raises(CheckpointError, match=r"not enough space for checkpoint .*step4: it needs about [\d.]+ MiB, "
                                              r"[\d.]+ MiB free; nothing was written, latest still names step2$"):
        train(opts(cfg, ckpt, save_every=2), on_step=lambda rec: before.setdefault(rec.step, _tree_hash(ckpt)))
    assert not (ckpt / "step4").exists() and _tree_hash(ckpt) == before[4]
    # the first save's estimate (no previous checkpoint): the states' bytes, a little over what was written
    written = checkpoint._tree_bytes(ckpt / "step2")
    assert written <= estimates[0] <= 1.1 * written + 2**20, (estimates[0], written)


def _cli(cfg, *extra):
    return ["train", "--config", str(cfg), "--model", "gpt2-tiny", "--seq", "16", *extra]


@pytest.mark.slow
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    cfg, ckpt = write_config(tmp_path), tmp_path / "ckpt"
    argv = ["dostune", *_cli(cfg, "--steps", str(STEPS), "--save-every", "2", "--save-dir", str(ckpt))]
    # The child dies half-way through writing step 4's optimizer states.
    child = (
        "import os, signal, sys, torch\n"
        "real = torch.save\n"
        "def save(obj, f, *a, **kw):\n"
        "    real(obj, f, *a, **kw)\n"
        "    if 'step4' in str(f) and 'optim_states' in str(f):\n"
        "        data = open(f, 'rb').read(); open(f, 'wb').write(data[:len(data) // 2])\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "torch.save = save\n"
        "from dostune.cli.app import main\n"
        f"sys.argv = {argv!r}\n"
        "main()\n")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                       env=_child_env())
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert read_latest(ckpt) == "step2" and (ckpt / "step4").is_dir()
    rest = train(opts(cfg, ckpt, resume=True))
    assert rest.first_step == 2 and rest.losses == uninterrupted.losses[2:]
    assert read_latest(ckpt) == f"step{STEPS}"


def test_the_step_watchdog_ends_a_rank_whose_steps_stop():
    # In-process it would end pytest: a child beats for a while, pauses for a long save, then stops beating.
    child = ("import time\n"
             "from dostune.train.faults import StepWatchdog\n"
             "with StepWatchdog(0.5, lambda what: f'lost: {what}') as w:\n"
             "    for _ in range(6):\n"
             "        time.sleep(0.2)\n"
             "        w.beat()\n"
             "    with w.pause():\n"
             "        time.sleep(1.0)\n"
             "    print('alive', flush=True)\n"
             "    time.sleep(10)\n"
             "print('not stopped', flush=True)\n")
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, env=_child_env())
    assert (r.returncode, r.stdout) == (3, "alive\n"), r.stderr[-2000:]
    assert r.stderr.strip().endswith("error: lost: no training step finished for 0.5 s (the rank timeout)")
    assert time.monotonic() - t < 10


def _two_ranks(tmp_path, cfg, *extra, timeout=15):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = _child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dostune.train", *_cli(cfg, "--rank-timeout", str(timeout),
                                                          "--metrics", str(tmp_path / "m.jsonl"), *extra)[1:]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait_for_steps(path: Path, n: int, procs, limit=240):
    t = time.monotonic()
    while time.monotonic() - t < limit:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    raise AssertionError(f"no step {n} in {limit} s")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_rank_stops_the_other_within_the_timeout(tmp_path, fault):
    timeout = 15
    procs = _two_ranks(tmp_path, write_config(tmp_path), "--steps", "100000", timeout=timeout)
    try:
        _wait_for_steps(tmp_path / "m.rank1.jsonl", 2, procs)
        os.kill(procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout + 60)
        took = time.monotonic() - t
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 3, err[-3000:]
    err = " ".join(err.split())  # the console wraps long lines at 80 columns in a pipe
    assert "rank 0: " in err and "another rank has died or hangs" in err and "without a checkpoint" in err, err[-3000:]
    print(f"{fault}: the survivor stopped {took:.1f} s after; {err[err.index('rank 0: '):]}")
    # gloo reports a dead peer's closed connection at once; a silent one after the timeout (and not before)
    assert took < timeout + 10 if fault == "kill" else timeout - 3 < took < timeout + 10, took


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    procs = _two_ranks(tmp_path, write_config(tmp_path), "--steps", "100000", "--save-dir", str(ckpt))
    try:
        _wait_for_steps(tmp_path / "m.rank1.jsonl", 2, procs)
        os.kill(procs[0].pid, signal.SIGTERM)  # rank 1 hears of it only through the agreement
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [143, 143], [o[1][-2000:] for o in outs]
    last = [json.loads((tmp_path / n).read_text().splitlines()[-1])["step"] for n in ("m.jsonl", "m.rank1.jsonl")]
    assert last[0] == last[1] and read_latest(ckpt) == f"step{last[0]}"
    assert sorted(p.name for p in (ckpt / f"step{last[0]}").glob("*optim_states.pt")) == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert "resume with: deepspeed <the same launcher options> --module dostune.train" in outs[0][1]
    assert "resume with:" not in outs[1][1]  # rank 0 speaks for all
