"""CPU time the hypervisor took from this machine while dostune measured (the ``steal`` column of /proc/stat).

On a virtual machine the host runs other guests on the same cores, and the time it takes from this one is counted
as steal. While it does, parallel CPU work runs slower than the share taken: CPU Adam over 16 threads waits at every
barrier for the thread that lost its core. On an H100 cloud machine, a memory-bound 16-thread loop ran about 25% longer
in seconds with 4-6% steal than in seconds with 1% (docs/experiments.md, section 16). The profiles and bench
record the share over their timed work, so that a prediction that misses can be read against the host it ran on.
"""
from __future__ import annotations

from typing import Optional

# a share of steal above which a profile's figures may not hold on a quieter (or busier) host
NOTE_ABOVE = 0.01
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
    return (f"the hypervisor took {share:.1%} of this machine's CPU time while {while_} (steal in /proc/stat): "
            "CPU-bound figures run slower then, so predictions from this profile may miss on a quieter host; "
            "profile again when the host is quiet")
