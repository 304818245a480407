"""CPU time the hypervisor took from this machine while dostune measured (the ``steal`` column of /proc/stat).

On a virtual machine the host runs other guests on the same cores, and the time it takes from this one is counted
as steal. While it does, parallel CPU work runs slower than the share taken: CPU Adam over 16 threads waits at every
barrier for the thread that lost its core. On an H100 cloud machine, a memory-bound 16-thread loop ran about 25% longer
in seconds with 4-6% steal than in seconds with 1% (docs/findings.md, finding 21). The profiles and bench
record the share over their timed work, so that a prediction that misses can be read against the host it ran on,
and set aside a timed iteration the hypervisor took from (QuietRuns): another runs in its place, so that a profile and
the runs checked against it both measure the machine, not its neighbours.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .records import SetAside

# a share of steal above which a profile's figures may not hold on a quieter (or busier) host
NOTE_ABOVE = 0.01
# a timed iteration the hypervisor took more than this share from is set aside (QuietRuns)
QUIET_BELOW = NOTE_ABOVE
# one look at the host while waiting for it to be quiet, in seconds of busy CPU
LOOK_S = 1.0
_STAT = "/proc/stat"


def cpu_times(path: str = _STAT) -> Optional[tuple[int, int]]:
    """(steal, total) ticks of every CPU since boot; None where the file is missing or has no steal column."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    try:
        # user nice system idle iowait irq softirq steal (guest time is already inside user and nice)
        ticks = [int(x) for x in fields[1:9]]
    except ValueError:
        return None
    return ticks[7], sum(ticks)


class StealMeter:
    """The share of CPU time stolen over one or more windows: each ``start()``/``stop()`` pair adds a window, and
    ``share`` is their steal over their total. None where /proc/stat is not readable or no time passed."""

    def __init__(self, path: str = _STAT):
        self.path = path
        self.steal = self.total = 0
        self._at: Optional[tuple[int, int]] = None

    def start(self) -> None:
        self._at = cpu_times(self.path)

    def stop(self) -> None:
        now = cpu_times(self.path)
        if now is not None and self._at is not None:
            self.steal += now[0] - self._at[0]
            self.total += now[1] - self._at[1]
        self._at = None

    @property
    def share(self) -> Optional[float]:
        return round(self.steal / self.total, 4) if self.total > 0 else None


def steal_note(share: Optional[float], while_: str) -> Optional[str]:
    """The profile's note when the hypervisor took more than NOTE_ABOVE of the CPU while it measured."""
    if share is None or share <= NOTE_ABOVE:
        return None
    return (f"the hypervisor took {share:.1%} of the machine's CPU time while {while_} (steal in /proc/stat): "
            "CPU-bound figures run slower then, so predictions from this profile may miss on a quieter host; "
            "profile again when the host is quiet")


def set_aside_text(aside: Optional[SetAside], what: tuple[str, str] = ("timed iteration", "timed iterations")
                   ) -> Optional[str]:
    """One phrase for a log or a note: how many of ``what`` (singular, plural) were set aside, at what steal, how long
    they took and how long the host was watched; None when none were."""
    if aside is None or not aside.runs:
        return None
    lo, hi = min(aside.steal), max(aside.steal)
    share = f"{lo:.1%}" if lo == hi else f"{lo:.1%}-{hi:.1%}"
    text = (f"{aside.runs} {what[aside.runs != 1]} set aside, each run again: the hypervisor took {share} of the CPU while they ran "
            f"(steal in /proc/stat); they took {statistics.median(aside.seconds):.3f} s (median)")
    return text + (f"; {aside.waited_s:.0f} s spent watching for a quiet host" if aside.waited_s >= 1 else "")


def busy_cpu(seconds: float) -> None:
    """Keep every core busy for ``seconds`` (memory-bound adds on torch's threads): steal is only counted while a
    virtual CPU wants to run, so an idle machine reads quiet whatever its host is doing."""
    import torch

    a, b = torch.ones(1 << 23), torch.ones(1 << 23)  # 32 MiB each: beyond the caches
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a.add_(b)


@dataclass
class _Run:
    sample: Any
    seconds: float
    steal: int  # this machine's ticks
    total: int
    share: Optional[float]  # the share the ranks agreed on (the highest of theirs)

    @property
    def quiet(self) -> bool:
        return self.share is None or self.share <= QUIET_BELOW


class QuietRuns:
    """``wanted`` timed runs (iterations) the hypervisor left alone.

    Each run is bracketed by ``start()`` and ``stop(sample)``. A run with more than QUIET_BELOW steal is set aside:
    before the next, the host is watched under load (``busy``) until one look reads quiet or ``wait_s`` (over the whole
    measurement) is spent, and another run takes its place, at most ``spare`` of them. ``kept()`` gives ``wanted``
    samples in the order they ran: the quiet runs, topped up with the least stolen of the others when the spare runs
    ran out. Where /proc/stat has no steal every run is quiet, and exactly ``wanted`` run.

    Under a launcher every rank must run as many iterations (they meet in collectives): ``gather`` gives every rank's
    share of a run (e.g. perfmodel.world.gather_ranks) and the highest decides for all.
    """

    def __init__(self, wanted: int, spare: Optional[int] = None, wait_s: float = 30.0,
                 gather: Callable[[Optional[float]], list] = lambda share: [share],
                 on_set_aside: Callable[[float, int], None] = lambda share, left: None,
                 path: str = _STAT, busy: Callable[[float], None] = busy_cpu):
        if wanted < 1:
            raise ValueError(f"QuietRuns needs at least one wanted run, got {wanted}")
        self.wanted, self.spare = wanted, wanted if spare is None else spare
        self.wait_left, self.waited_s = wait_s, 0.0
        self.gather, self.on_set_aside, self.path, self.busy = gather, on_set_aside, path, busy
        self.runs: list[_Run] = []
        self._meter: Optional[StealMeter] = None
        self._t0 = 0.0

    def _quiet_runs(self) -> int:
        return sum(r.quiet for r in self.runs)

    def more(self) -> bool:
        """Whether another run is needed (after waiting for a quiet host when the last one was not)."""
        if self._quiet_runs() >= self.wanted or len(self.runs) >= self.wanted + self.spare:
            return False
        if self.runs and not self.runs[-1].quiet:
            self._await_quiet()
        return True

    def start(self) -> None:
        self._meter = StealMeter(self.path)
        self._meter.start()
        self._t0 = time.perf_counter()

    def stop(self, sample: Any) -> bool:
        """Close the run that ``start`` opened, with what it measured; returns whether it was quiet."""
        seconds = time.perf_counter() - self._t0
        m, self._meter = self._meter, None
        m.stop()
        shares = [s for s in self.gather(m.share) if s is not None]
        run = _Run(sample, seconds, m.steal, m.total, max(shares) if shares else None)
        self.runs.append(run)
        left = self.wanted + self.spare - len(self.runs)
        if not run.quiet and left > 0 and self._quiet_runs() < self.wanted:
            self.on_set_aside(run.share, left)
        return run.quiet

    def _kept_indices(self) -> list[int]:
        order = sorted(range(len(self.runs)),
                       key=lambda i: (0, 0.0, i) if self.runs[i].quiet else (1, self.runs[i].share, i))
        return sorted(order[:self.wanted])

    def kept(self) -> list:
        return [self.runs[i].sample for i in self._kept_indices()]

    @property
    def share(self) -> Optional[float]:
        """This machine's steal over the kept runs (None where /proc/stat has no steal)."""
        kept = [self.runs[i] for i in self._kept_indices()]
        total = sum(r.total for r in kept)
        return round(sum(r.steal for r in kept) / total, 4) if total > 0 else None

    def set_aside(self) -> SetAside:
        keep = set(self._kept_indices())
        gone = [r for i, r in enumerate(self.runs) if i not in keep]
        return SetAside(runs=len(gone), steal=[r.share for r in gone], seconds=[round(r.seconds, 6) for r in gone],
                        waited_s=round(self.waited_s, 3))

    def _await_quiet(self) -> None:
        while self.wait_left > 0:
            look = min(LOOK_S, self.wait_left)
            m = StealMeter(self.path)
            m.start()
            self.busy(look)
            m.stop()
            self.wait_left -= look
            self.waited_s += look
            if m.share is None or m.share <= QUIET_BELOW:
                return
