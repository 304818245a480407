"""The CPU-lane probe's reading alone (profile/backward_probes.py): one slow stretch of the host cannot set it."""
import pytest
import torch

from dostune.profile import backward_probes
from dostune.profile.backward_probes import LaneLoad


@pytest.fixture
def lane():
    return LaneLoad(elements=4096, threads=1, half=torch.bfloat16)


def test_one_slow_burst_cannot_set_the_reading_alone(lane, monkeypatch):
    """On the H100 hosts a whole burst of updates sometimes ran 3-4x slow (docs/findings.md, finding 25): with the
    bursts pooled, one slow burst among fast ones leaves the median at the fast ones."""
    bursts = iter([[9e-3] * 5, [2e-3] * 5, [2e-3] * 5])
    timed = []

    def samples(fn, repeats):
        timed.append((fn, repeats))
        return next(bursts)

    monkeypatch.setattr(backward_probes, "cpu_samples", samples)
    monkeypatch.setattr(backward_probes.time, "sleep", lambda s: None)
    stat = lane.alone(5, bursts=3)
    assert timed == [(lane.update, 5)] * 3
    assert stat.n == 15 and stat.median == 2e-3 and stat.hi == 9e-3


def test_the_bursts_are_apart(lane, monkeypatch):
    """A pause between bursts: each starts as a single burst did, after an idle spell."""
    events = []
    monkeypatch.setattr(backward_probes, "cpu_samples", lambda fn, repeats: events.append("burst") or [1e-3] * repeats)
    monkeypatch.setattr(backward_probes.time, "sleep", lambda s: events.append(s))
    lane.alone(2, bursts=3, pause_s=0.25)
    assert events == ["burst", 0.25, "burst", 0.25, "burst"]


def test_a_burst_is_an_untimed_update_then_the_timed_ones(lane, monkeypatch):
    calls = []
    monkeypatch.setattr(lane, "update", lambda: calls.append(1))
    monkeypatch.setattr(backward_probes.time, "sleep", lambda s: None)
    assert lane.alone(4, bursts=2).n == 8 and len(calls) == 2 * 5
