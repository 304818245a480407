"""A dostune process ends quietly: the world of one it made for itself is closed before it exits (left open, NCCL
prints a warning per process, eight in a `tune --validate`), a launcher's world is closed by a command that succeeded
and its rank then ends without the interpreter's teardown (where a gloo rank could abort), and the CLI silences the
warnings that say nothing to its user."""
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

from dostune.cli.app import quiet_known_warnings

ROOT = Path(__file__).resolve().parents[1]
WORLD = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# registered before ensure_distributed, so it runs after whatever that registers (atexit runs last in, first out)
_CHILD = ("import atexit, torch.distributed as d\n"
          "atexit.register(lambda: print('at exit:', d.is_initialized(), flush=True))\n"
          "from dostune.train.engine import ensure_distributed\n"
          "ensure_distributed()\n"
          "print('running:', d.is_initialized(), flush=True)\n")


def _child_env(**world: str) -> dict:
    """This process's environment without its own world's variables, with ``world``'s and the repository on the path."""
    env = {k: v for k, v in os.environ.items() if k not in WORLD}
    return {**env, "PYTHONPATH": str(ROOT), **world}


def _run_child(*cli_args: str, **world) -> str:
    """The child joins or makes a world; with ``cli_args`` it then runs that dostune command, whose exit code is
    returned in the output."""
    code = _CHILD
    if cli_args:
        code += ("from dostune.cli.app import app\n"
                 f"try:\n    app(args={list(cli_args)!r}, prog_name='dostune')\n"
                 "except SystemExit as e:\n    print('exit code:', e.code, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=_child_env(**world))
    assert r.returncode == 0, r.stderr[-3000:]
    # DeepSpeed's CPU accelerator prints its op builds to stdout
    return "".join(line for line in r.stdout.splitlines(keepends=True)
                   if line.startswith(("running:", "exit code:", "at exit:")))


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_a_world_of_one_made_here_is_closed_at_exit():
    assert _run_child() == "running: True\nat exit: False\n"


def test_a_launchers_world_is_left_to_the_script():
    out = _run_child(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    assert out == "running: True\nat exit: True\n"


def test_a_launchers_world_is_closed_by_a_command_that_succeeded_and_only_then():
    launcher = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    out = _run_child("--version", **launcher, MASTER_PORT=_free_port())
    assert out == "running: True\nexit code: 0\nat exit: False\n"
    out = _run_child("tune", "--trials", "0", **launcher, MASTER_PORT=_free_port())  # refused: exit 2
    assert out == "running: True\nexit code: 2\nat exit: True\n"


# a launched rank running the `dostune` entry point, with a thread that is not a daemon still running; `teardown` is
# printed only if the interpreter tears down __main__
_ENTRY = ("import atexit, sys\n"
          "class Teardown:\n    def __del__(self):\n        print('teardown', flush=True)\n"
          "watch = Teardown()\n"
          "atexit.register(lambda: print('at exit', flush=True))\n"
          "from dostune.train.engine import ensure_distributed\n"
          "ensure_distributed()\n"
          "from dostune.cli.app import main\n"
          "sys.argv = ['dostune', *sys.argv[1:]]\n"
          "import threading, time\n"
          "threading.Thread(target=lambda: (time.sleep(1), print('thread done', flush=True))).start()\n"
          "main()\n")
WATCHED = ("thread done", "at exit", "teardown")  # in the order an exit should print them


def test_a_launched_rank_that_succeeded_ends_after_its_threads_and_atexit_handlers_without_the_teardown():
    launcher = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    outs = {}
    for args in (["--version"], ["tune", "--trials", "0"]):  # the second is refused: exit 2
        r = subprocess.run([sys.executable, "-c", _ENTRY, *args], capture_output=True, text=True, timeout=300,
                           env=_child_env(**launcher, MASTER_PORT=_free_port()))
        outs[args[0]] = r.returncode, [line for line in r.stdout.splitlines() if line in WATCHED]
    assert outs == {"--version": (0, ["thread done", "at exit"]), "tune": (2, ["thread done", "at exit", "teardown"])}


def test_the_cli_silences_torchs_barrier_device_warning_and_nothing_else():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_warnings()
        warnings.warn("barrier(): using the device under current context. You can specify `device_id` in "
                      "`init_process_group` to mute this warning.", UserWarning)
        warnings.warn("barrier(): something else", UserWarning)
        warnings.warn("an unrelated warning", UserWarning)
    assert [str(w.message) for w in seen] == ["barrier(): something else", "an unrelated warning"]
