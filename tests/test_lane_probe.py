"""The CPU-lane probe's reading alone (profile/backward_probes.py): one slow stretch of the host cannot set it."""
import time

import pytest
import torch

from dostune.profile.backward_probes import LaneLoad


@pytest.fixture
def lane():
    return LaneLoad(elements=4096, threads=1, half=torch.bfloat16)


def test_one_slow_burst_cannot_set_the_reading_alone(lane, monkeypatch):
    """On the H100 hosts a whole burst of updates sometimes ran 3-4x slow (docs/experiments.md, section 42): a burst
    of slow updates among fast ones leaves the median at the fast ones."""
    calls = []

    def update():
        calls.append(time.perf_counter())
        time.sleep(0.02 if len(calls) <= 6 else 0.002)  # the first burst (an untimed update and five timed) is slow

    monkeypatch.setattr(lane, "update", update)
    stat = lane.alone(5, bursts=3, pause_s=0.01)
    assert len(calls) == 3 * 6 and stat.n == 15
    assert stat.median < 0.01 < stat.hi


def test_the_bursts_are_apart(lane, monkeypatch):
    """A pause before each burst after the first: each burst starts as a single burst did, after an idle spell."""
    calls = []
    monkeypatch.setattr(lane, "update", lambda: calls.append(time.perf_counter()))
    lane.alone(2, bursts=3, pause_s=0.05)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 9 and sum(g >= 0.05 for g in gaps) == 2
