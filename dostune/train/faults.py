"""Faults of shared clusters during `dostune train`: stop signals and lost ranks (docs/faults.md).

- SIGINT (Ctrl-C), SIGTERM (what SLURM and Kubernetes send before they kill a job) and SIGUSR1 (what some
  schedulers send ahead of a time limit) ask the loop to stop before its next step. The ranks agree on the stop
  with one small all-reduce per step, because a signal reaches them at different moments: all stop after the
  same step and save one consistent checkpoint together. The process then exits with 128 + the signal's number,
  as shells report a signal (130, 143, 138 on Linux).
- A rank that dies or hangs: the other ranks' collectives fail (gloo reports a closed connection at once) or time
  out after the rank timeout, and a watchdog ends a rank whose steps stop finishing for that long (NCCL's own
  timeout would abort the process without a word on what to do). Either way: one message, exit 3, no checkpoint.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from typing import Optional

import torch

from ..errors import DostuneError

# Signals that ask for a stop with a checkpoint; getattr: SIGUSR1 does not exist on every platform.
STOP_SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGUSR1")) if s is not None)
RANK_LOST_EXIT = 3


def stop_exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal; a run stopped by one did not finish either."""
    return 128 + signum


class RankLost(DostuneError):
    exit_code = RANK_LOST_EXIT


def default_rank_timeout() -> float:
    """DeepSpeed's collective timeout (10 minutes, or DEEPSPEED_TIMEOUT minutes), so that not passing
    --rank-timeout changes nothing against plain DeepSpeed."""
    from deepspeed.constants import default_pg_timeout

    return default_pg_timeout.total_seconds()


class StopSignals:
    """Turns the stop signals into a request (``signum``) that the loop reads between steps.

    A second Ctrl-C stops at once (a person pressing it twice means it). A repeated SIGTERM or SIGUSR1 is
    ignored: schedulers and wrapper scripts may deliver one more than once, and that must not cut the
    checkpoint short (the scheduler's SIGKILL after its grace period does that anyway)."""

    def __init__(self):
        self.signum = 0
        self._prev: dict[int, object] = {}

    def _handler(self, signum, frame):
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum = signum

    def __enter__(self):
        for s in STOP_SIGNALS:
            try:
                self._prev[s] = signal.signal(s, self._handler)
            except ValueError:  # not in the main thread: signals stay as they were
                break
        return self

    def __exit__(self, *exc):
        for s, prev in self._prev.items():
            signal.signal(s, prev)
        self._prev.clear()


def agree(value: int, device, op: str = "max") -> int:
    """``value`` reduced over all ranks (``op``: "max" or "sum"), one int all-reduce on the engine's device; no
    collective in a world of one. Every rank must call it at the same point."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return value
    import deepspeed.comm as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return int(t.item())


def agree_stop(stop: StopSignals, device) -> int:
    """The signal that stops every rank before this step (0: go on): the largest signal number any rank has
    received, so all ranks stop at the same step and exit with the same code."""
    return agree(stop.signum, device)


# torch.distributed reports a peer's death or silence as a RuntimeError from gloo/NCCL (DistBackendError
# and friends on newer paths); these are the phrases of the ones a lost rank produces.
_LOST_PHRASES = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out",
                 "pair closure", "Broken pipe", "NCCL", "gloo")


def is_lost_rank_error(e: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(p in str(e) for p in _LOST_PHRASES)


def describe(e: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an exception, without the C++ source locations torch and gloo put in brackets
    ("[/…/gloo/transport/tcp/pair.cc:553] Connection closed by peer", "[enforce fail at inline_container.cc:672] .
    unexpected pos"): they mean nothing to a user, and the CLI's console would read them as markup."""
    line = (str(e).splitlines() or [""])[0]
    line = re.sub(r"\[[^\]]*\.(?:cc|cpp|c|h|hpp):\d+\]\s*\.?\s*", "", line).replace("[", "(").replace("]", ")")
    line = line.strip().split(". ")[0]  # gloo goes on with advice for PyTorch's own launcher
    return f"{type(e).__name__}: {line[:limit]}"


def lost_rank_message(rank: int, what: str, latest: Optional[str], resume_command: Optional[str]) -> str:
    """One line for a rank that lost the others. No checkpoint: ZeRO-3 splits the optimizer states over the
    ranks, so the lost rank's share is gone, and the survivors may be halfway through a step."""
    where = (f"resume from the latest checkpoint ({latest})" + (f": {resume_command}" if resume_command else
                                                                 " with --resume")) if latest else \
        "there is no checkpoint to resume from"
    return (f"rank {rank}: {what}; another rank has died or hangs, so this one stops (exit {RANK_LOST_EXIT}) without "
            f"a checkpoint (ZeRO-3 splits the states over the ranks: the lost rank's share cannot be saved); {where}")


class StepWatchdog:
    """Ends this process (exit 3) when no step has finished for ``timeout`` seconds in a multi-rank run.

    The loop calls ``beat()`` right after its last collective of a step, so any collective that hangs started
    after the last beat: the watchdog fires no later than that collective's own timeout would, and says why.
    Paused while a checkpoint is written (its barrier waits for the slowest rank's disk, which may legitimately
    take longer than a step; the collective timeout still bounds it). The timeout must exceed the longest step."""

    def __init__(self, timeout: float, message, enabled: bool = True):
        self.timeout = timeout
        self.enabled = enabled  # a world of one has no one to wait for
        self._message = message  # callable(what) -> str, read when it fires (the latest checkpoint may change)
        self._last = time.monotonic()
        self._paused = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dostune-step-watchdog", daemon=True)

    def __enter__(self):
        self._last = time.monotonic()
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        if self.enabled:
            self._thread.join()

    def beat(self) -> None:
        self._last = time.monotonic()

    def pause(self):
        watchdog = self

        class _Paused:
            def __enter__(self):
                watchdog._paused += 1

            def __exit__(self, *exc):
                watchdog._paused -= 1
                watchdog.beat()

        return _Paused()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 20)
        while not self._done.wait(poll):
            if not self._paused and time.monotonic() - self._last > self.timeout:
                what = f"no training step finished for {self.timeout:g} s (the rank timeout)"
                try:
                    sys.stderr.write(f"error: {self._message(what)}\n")
                    sys.stderr.flush()
                finally:
                    os._exit(RANK_LOST_EXIT)  # the main thread is stuck in a collective: nothing else can end it
