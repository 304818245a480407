"""One bench method in a process of its own.

A method can end its process in ways no ``except`` sees: the kernel's out-of-memory killer (SIGKILL, exit 137
in a shell) while an engine pins host memory, a CUDA error that leaves the context unusable, a crash in native
code. Run in the bench's own process, that loses every method measured so far. Here the method runs in a
fresh ``spawn`` child (a fork would inherit a started CUDA context), reports its progress and its result over a
pipe, and when it dies instead the parent turns how it died and in which phase into the method's result.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import warnings
from typing import Optional

from ..deepspeed_support import stdout_to_stderr
from ..dsconfig import OffloadSettings
from ..profile.timing import ProgressSink
from .record import MethodResult

# how often the parent looks whether a silent child is still alive
_POLL_S = 0.5


class _PipeProgress:
    """The child's ProgressSink: forwards each call to the parent's display."""

    def __init__(self, conn):
        self.conn = conn

    def start(self, description: str, total: int) -> None:
        self.conn.send(("start", description, total))

    def advance(self, n: int = 1) -> None:
        self.conn.send(("advance", n))


def _child(conn, name: str, opts, offload: OffloadSettings, warning_filters: list) -> None:
    """Entry point of the child process."""
    from ..models.registry import resolve_model
    from .run import run_method_here

    # the parent's warning policy (the CLI silences torch.distributed's per-step deprecation notices); a spawned
    # process starts with Python's defaults
    warnings.filters[:] = warning_filters
    warnings._filters_mutated()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # A world of one that the parent made for itself (ensure_distributed) left its rendezvous port in the
        # environment, and the parent may still hold it: the child makes its own world on a free port.
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)

    try:
        # stdout belongs to the parent's --json output; DeepSpeed prints to it when it builds an op
        with stdout_to_stderr():
            res = run_method_here(name, resolve_model(opts.model), opts, offload, _PipeProgress(conn))
    except BaseException as e:  # resolve_model or the pipe itself; run_method_here reports the method's own
        res = MethodResult(method=name, description=opts.describe(name), ran=False,
                           error=f"{type(e).__name__}: {e}"[:2000])
    conn.send(("result", res.model_dump_json()))
    conn.close()


def death(exitcode: Optional[int], phase: Optional[str]) -> str:
    """What a child's exit code says happened, for the method's row."""
    where = f" during {phase}" if phase else ""
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        if -exitcode == signal.SIGKILL:
            return f"killed by SIGKILL{where}, most likely out of host memory (the kernel's OOM killer)"
        return f"crashed: {sig}{where}"
    if exitcode == 137:  # a wrapper's way of saying SIGKILL
        return f"killed (exit 137, SIGKILL){where}, most likely out of host memory (the kernel's OOM killer)"
    return f"exited with code {exitcode} without a result{where}"


def run_isolated(name: str, opts, offload: OffloadSettings, progress: ProgressSink) -> MethodResult:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, name, opts, offload, list(warnings.filters)),
                       name=f"dostune-bench-{name}")
    proc.start()
    send.close()  # the child holds the only writer: EOF on the pipe means it is gone
    phase, result = None, None
    try:
        while result is None:
            if not recv.poll(_POLL_S):
                if not proc.is_alive() and not recv.poll(0):
                    break
                continue
            try:
                msg = recv.recv()
            except EOFError:
                break
            if msg[0] == "start":
                phase = msg[1].split(": ", 1)[-1]
                progress.start(msg[1], msg[2])
            elif msg[0] == "advance":
                progress.advance(msg[1])
            elif msg[0] == "result":
                result = MethodResult.model_validate_json(msg[1])
    except KeyboardInterrupt:
        # Stopped (Ctrl-C, or a SIGTERM the caller turned into one): the measurement is given up. Ctrl-C in a
        # terminal reaches the child too, a signal sent to this process alone does not: it must not run on.
        proc.terminate()
        raise
    finally:
        proc.join(timeout=None if result is None else 60)
        if proc.is_alive():  # a result came but the child hangs on its way out (a stuck CUDA teardown)
            proc.kill()
            proc.join()
        recv.close()
    if result is not None:
        return result
    from ..dsconfig import deepspeed_config

    return MethodResult(method=name, description=opts.describe(name), ran=False,
                        error=death(proc.exitcode, phase), ds_config=deepspeed_config(opts.train, offload))
