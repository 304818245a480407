"""The share of CPU time the hypervisor took (host_steal.py), read from a /proc/stat the test writes."""
import pytest

from dostune.host_steal import NOTE_ABOVE, StealMeter, cpu_times, steal_note


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
    assert note.startswith("the hypervisor took 4.3% of this machine's CPU time while ZeRO-Offload's iterations were "
                           "timed") and "profile again when the host is quiet" in note
