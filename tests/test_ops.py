"""The compiled ops (dostune/ops.py): one folder per Python environment, a build lock that cannot outlive its holder,
and a lock file a killed build left behind noticed and cleared, so that no run waits forever."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dostune import ops
from dostune.errors import DostuneError

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    # a fresh process's environment: not the rendezvous of a world an earlier test made in this one
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return dict(clean, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", **extra)


def _start(code: str, **env) -> subprocess.Popen:
    """A Python child that prints 'ready' once it holds what ``code`` takes, then sleeps."""
    p = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\nimport time; time.sleep(120)"],
                         stdout=subprocess.PIPE, text=True, env=_env(**env))
    assert p.stdout.readline().strip() == "ready"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)


def test_each_environment_has_its_own_folder_and_the_variable_wins(tmp_path, monkeypatch):
    monkeypatch.delenv(ops.OPS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env-a"))
    a = ops.ops_dir()
    assert a == tmp_path / "env-a" / "var" / "cache" / "dostune"
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env-b"))
    assert ops.ops_dir() != a
    if os.geteuid() != 0:  # root writes through any mode
        ro = tmp_path / "read-only-env"
        ro.mkdir()
        ro.chmod(0o555)
        monkeypatch.setattr(sys, "prefix", str(ro))
        own = ops.ops_dir()
        assert own.is_relative_to(tmp_path / "cache" / "dostune" / "envs") and own.name.startswith("read-only-env-")
        assert ops.ops_dirs() == [ro / "var" / "cache" / "dostune", own]  # a prebuilt folder there is still found
    monkeypatch.setenv(ops.OPS_DIR_ENV, str(tmp_path / "mine"))
    assert ops.ops_dirs() == [tmp_path / "mine"] and ops.ops_dir() == tmp_path / "mine"


def test_the_wait_limit_is_a_positive_number_of_seconds(monkeypatch):
    monkeypatch.setenv(ops.WAIT_ENV, "soon")
    with pytest.raises(DostuneError, match="DOSTUNE_BUILD_WAIT must be a number of seconds") as e:
        ops.wait_limit()
    assert e.value.hint
    monkeypatch.setenv(ops.WAIT_ENV, "2.5")
    assert ops.wait_limit() == 2.5


def test_a_wait_on_a_live_builder_gives_up_naming_it_and_a_killed_one_releases_the_lock(tmp_path, monkeypatch,
                                                                                       capsys):
    lock = tmp_path / "op.lock"
    holder = _start(f"from dostune.ops import BuildLock; held = BuildLock({str(lock)!r}, 'the op').__enter__()")
    try:
        monkeypatch.setenv(ops.WAIT_ENV, "1")
        start = time.monotonic()
        with pytest.raises(DostuneError, match=f"gave up waiting for process {holder.pid} to finish building "
                                               "the op") as e:
            with ops.BuildLock(lock, "the op"):
                pass
        assert time.monotonic() - start < 10
        assert f"kill {holder.pid}" in e.value.hint
        assert f"waiting for process {holder.pid}, which is building the op" in capsys.readouterr().err
    finally:
        _kill(holder)
    start = time.monotonic()
    with ops.BuildLock(lock, "the op"):  # the kernel dropped the dead holder's lock
        assert lock.read_text().strip() == str(os.getpid())
    assert time.monotonic() - start < 2


def test_torch_lock_of_a_dead_builder_is_removed_and_a_live_ones_waited_for(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    lock = folder / "lock"
    # torch's FileBaton as a build takes it: the file created and held open, then the builder killed
    builder = _start(f"from torch.utils.file_baton import FileBaton; assert FileBaton({str(lock)!r}).try_acquire()")
    monkeypatch.setenv(ops.WAIT_ENV, "1")
    try:
        assert ops.builders_in(folder) == [builder.pid]
        with pytest.raises(DostuneError, match=f"gave up waiting for process {builder.pid} "):
            ops.clear_stale_torch_lock(folder, "DeepSpeed's CPU Adam")
        assert lock.exists()
    finally:
        _kill(builder)
    ops.clear_stale_torch_lock(folder, "DeepSpeed's CPU Adam")
    assert not lock.exists()
    err = capsys.readouterr().err
    assert f"warning: removed {lock}, left by a build of DeepSpeed's CPU Adam that was stopped" in err
    # the compilers of a killed build live on, working in the folder: they are waited for too
    lock.touch()
    compiler = subprocess.Popen(["sleep", "120"], cwd=folder)
    try:
        time.sleep(0.2)
        with pytest.raises(DostuneError, match=f"process {compiler.pid} \\(sleep\\)"):
            ops.clear_stale_torch_lock(folder, "DeepSpeed's CPU Adam")
        assert lock.exists()
    finally:
        compiler.kill()
        compiler.wait()


def _seed(folder: Path, built: Path) -> None:
    """A copy of an op's finished build folder, as a build killed after compiling leaves it: no stamp."""
    shutil.copytree(built, folder, symlinks=True)
    (folder / ops.STAMP).unlink()


@pytest.mark.slow
def test_a_run_after_a_build_killed_with_its_lock_held_finishes_with_a_warning(tmp_path):
    """The reported hang: a run killed while DeepSpeed builds CPU Adam leaves torch's lock file, and every later
    run sat at "building the engine" for good. Here a fresh ops folder holds what such a kill leaves (the build's
    files without dostune's stamp, and the lock file, made by a process that held it open and was killed with -9);
    `dostune train` then removes the lock with one warning and trains. The build's files are copies of this
    environment's (scripts/install.sh builds them; missing, the run builds them, a few minutes on 2 cores)."""
    from dostune.optim import cpu_kernel

    built = {op.name: op.path.parent for op in ops.load_deepspeed_ops()}
    mine = tmp_path / "ops"
    roots = mine / "torch_extensions"
    for name, folder in built.items():
        _seed(roots / name, folder)
    (mine / "native").mkdir(parents=True)
    shutil.copy2(cpu_kernel.build().path, mine / "native")
    lock = roots / "cpu_adam" / "lock"
    killed = _start(f"from torch.utils.file_baton import FileBaton; assert FileBaton({str(lock)!r}).try_acquire()")
    _kill(killed)
    assert lock.exists()

    cfg = tmp_path / "ds_config.json"
    from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
    cfg.write_text(json.dumps(deepspeed_config(TrainSettings(micro_batch=2),
                                               OffloadSettings(sub_group_size=20_000, pin_memory=False))))
    r = subprocess.run([sys.executable, "-m", "dostune", "train", "--config", str(cfg), "--model", "gpt2-tiny",
                        "--steps", "2", "--seq", "16", "--metrics", str(tmp_path / "m.jsonl")],
                       capture_output=True, text=True, timeout=420, cwd=tmp_path,
                       env=_env(**{ops.OPS_DIR_ENV: str(mine)}))
    assert r.returncode == 0, r.stderr[-3000:]
    err = " ".join(r.stderr.split())
    assert f"warning: removed {lock}, left by a build of DeepSpeed's CPU Adam (cpu_adam) that was stopped" in err
    assert err.count("warning: removed") == 1 and "trained steps 1-2" in err
    assert not lock.exists()
    stamp = json.loads((roots / "cpu_adam" / ops.STAMP).read_text())
    assert (roots / "cpu_adam" / stamp["file"]).is_file()
    # the next run loads the build: no note, nothing built
    r = subprocess.run([sys.executable, "-c", "from dostune.ops import load_deepspeed_ops; load_deepspeed_ops()"],
                       capture_output=True, text=True, timeout=300, env=_env(**{ops.OPS_DIR_ENV: str(mine)}))
    assert r.returncode == 0 and "building" not in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_kill_9_during_a_real_build_then_the_next_build_finishes(tmp_path):
    """The same for real: a process building DeepSpeed's shared-memory op (its smallest) is killed with -9 in the
    middle of compiling; the compilers it started live on. The next process waits for them, removes the lock the
    killed one left, and has the op: no step of it hangs."""
    mine = tmp_path / "ops"
    env = _env(**{ops.OPS_DIR_ENV: str(mine)})
    code = "from dostune.ops import load_deepspeed_op; print(load_deepspeed_op('ShareMemCommBuilder').path)"
    first = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    lock = mine / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    deadline = time.monotonic() + 120
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lock.exists() and first.poll() is None, "the build did not start"
    time.sleep(1)
    _kill(first)
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()).is_file() and not lock.exists()
    assert "warning: removed" in r.stderr, r.stderr
    assert time.monotonic() - start < 400


def test_ops_build_then_status_say_where_each_op_is(tmp_path):
    """`dostune ops build` on this environment's folder (scripts/install.sh has built there: nothing to do) and
    `dostune ops status` name every op and its file."""
    from typer.testing import CliRunner

    from dostune.cli.app import app

    r = CliRunner().invoke(app, ["ops", "build"])
    assert r.exit_code == 0, r.output
    for title in ("DeepSpeed's CPU Adam (cpu_adam)", "dostune's CPU Adam kernel (cpu_adam_oop)"):
        assert any(line.startswith(title + ": ") for line in r.output.splitlines()), r.output
    assert "nothing is compiled at run time" in r.output
    r = CliRunner().invoke(app, ["ops", "status"])
    assert r.exit_code == 0 and "not built" not in r.output and "cpu_adam_oop-" in r.output, r.output
