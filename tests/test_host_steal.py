"""The share of CPU time the hypervisor took (host_steal.py), read from a /proc/stat the test writes."""
import pytest

from dostune.host_steal import LOOK_S, NOTE_ABOVE, QuietRuns, StealMeter, cpu_times, set_aside_text, steal_note
from dostune.records import SetAside


def _stat(tmp_path, user, idle, steal, name="stat"):
    p = tmp_path / name
    # cpu user nice system idle iowait irq softirq steal guest guest_nice, then one line per CPU
    p.write_text(f"cpu  {user} 0 10 {idle} 5 0 5 {steal} 0 0\ncpu0 1 0 1 1 0 0 0 0 0 0\nintr 1\n")
    return str(p)


def test_cpu_times_reads_steal_and_the_total(tmp_path):
    assert cpu_times(_stat(tmp_path, 100, 800, 80)) == (80, 100 + 10 + 800 + 5 + 5 + 80)
    for bad in ("cpu  1 2 3\n", "cpu  1 2 3 4 5 6 7 x 0 0\n", "intr 1 2 3 4 5 6 7 8 9\n", ""):
        (tmp_path / "bad").write_text(bad)
        assert cpu_times(str(tmp_path / "bad")) is None, bad
    assert cpu_times(str(tmp_path / "missing")) is None


def test_meter_adds_its_windows_and_skips_what_it_cannot_read(tmp_path):
    path = _stat(tmp_path, 0, 0, 0)
    m = StealMeter(path)
    assert m.share is None  # no window yet
    m.start()
    _stat(tmp_path, 90, 0, 10)  # 100 ticks, 10 stolen
    m.stop()
    _stat(tmp_path, 500, 0, 10)  # between the windows: not counted
    m.start()
    _stat(tmp_path, 800, 0, 110)  # 400 ticks, 100 stolen
    m.stop()
    assert (m.steal, m.total) == (110, 500) and m.share == pytest.approx(0.22)
    m.stop()  # a stop without a start adds nothing
    assert m.share == pytest.approx(0.22)
    gone = StealMeter(str(tmp_path / "missing"))
    gone.start()
    gone.stop()
    assert gone.share is None


def test_note_only_above_the_threshold():
    assert steal_note(None, "x") is None and steal_note(NOTE_ABOVE, "x") is None and steal_note(0.0, "x") is None
    note = steal_note(0.043, "ZeRO-Offload's iterations were timed")
    assert note.startswith("the hypervisor took 4.3% of the machine's CPU time while ZeRO-Offload's iterations were "
                           "timed") and "profile again when the host is quiet" in note


class _Host:
    """A /proc/stat the test advances: each ``tick(steal)`` adds 100 ticks, ``steal`` of them stolen."""

    def __init__(self, tmp_path):
        self.user = self.steal = 0
        self.path = _stat(tmp_path, 0, 0, 0, "host")
        self.tmp_path = tmp_path

    def tick(self, steal: int) -> None:
        self.user += 100 - steal
        self.steal += steal
        _stat(self.tmp_path, self.user, 0, self.steal, "host")


def _measure(runs: QuietRuns, host: _Host, steals: list[int]) -> list[int]:
    """Run until ``runs`` has what it wants, the i-th run taking steals[i] of 100 ticks; returns the run indices."""
    i = 0
    while runs.more():
        runs.start()
        host.tick(steals[i])
        runs.stop(i)
        i += 1
    return list(range(i))


def test_a_stolen_run_is_set_aside_and_another_runs_in_its_place(tmp_path):
    host, told = _Host(tmp_path), []
    runs = QuietRuns(3, path=host.path, busy=lambda s: host.tick(0), on_set_aside=lambda sh, left: told.append(left))
    assert _measure(runs, host, [0, 5, 1, 0]) == [0, 1, 2, 3]
    assert runs.kept() == [0, 2, 3] and runs.share == 0.0033  # rounded to 4 places
    aside = runs.set_aside()
    assert aside.runs == 1 and aside.steal == [0.05] and len(aside.seconds) == 1
    assert aside.waited_s == LOOK_S and told == [4]  # one quiet look before the run that replaced it


def test_without_quiet_runs_the_least_stolen_are_kept_in_order(tmp_path):
    host = _Host(tmp_path)
    looks = []
    runs = QuietRuns(2, wait_s=2.5, path=host.path, busy=lambda s: (looks.append(s), host.tick(3)))
    assert _measure(runs, host, [4, 2, 9, 3]) == [0, 1, 2, 3]  # two spare runs, none quiet
    assert runs.kept() == [1, 3] and runs.share == pytest.approx(0.025)
    assert runs.set_aside().steal == [0.04, 0.09]
    assert looks == [1.0, 1.0, 0.5] and runs.set_aside().waited_s == 2.5  # the wait is spent, then runs go on at once


def test_no_steal_column_means_exactly_the_wanted_runs(tmp_path):
    (tmp_path / "none").write_text("cpu  1 2 3 4\n")
    runs = QuietRuns(3, path=str(tmp_path / "none"), busy=lambda s: pytest.fail("nothing to wait for"))
    n = 0
    while runs.more():
        runs.start()
        runs.stop(n)
        n += 1
    assert n == 3 and runs.kept() == [0, 1, 2] and runs.share is None and runs.set_aside().runs == 0


def test_the_most_stolen_rank_decides_for_all(tmp_path):
    host = _Host(tmp_path)
    other = iter([None, 0.2, 0.0])  # the other rank's share of each run (None: it could not read its own)
    runs = QuietRuns(2, spare=1, path=host.path, busy=lambda s: host.tick(0),
                     gather=lambda share: [share, next(other)])
    assert _measure(runs, host, [0, 0, 0]) == [0, 1, 2]
    assert runs.kept() == [0, 2] and runs.set_aside().steal == [0.2]
    with pytest.raises(ValueError):
        QuietRuns(0)


def test_what_was_set_aside_reads_as_one_phrase():
    assert set_aside_text(None) is None and set_aside_text(SetAside()) is None
    one = set_aside_text(SetAside(runs=1, steal=[0.031], seconds=[2.5]))
    assert one == ("1 timed iteration set aside, each run again: the hypervisor took 3.1% of the CPU while they ran "
                   "(steal in /proc/stat); they took 2.500 s (median)")
    two = set_aside_text(SetAside(runs=2, steal=[0.05, 0.02], seconds=[1.0, 3.0], waited_s=12.0), ("round", "rounds"))
    assert two.startswith("2 rounds set aside") and "took 2.0%-5.0% of the CPU" in two and "2.000 s (median)" in two
    assert two.endswith("; 12 s spent watching for a quiet host")
