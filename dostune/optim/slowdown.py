"""A test-only switch that makes the CPU lane slower, to prove that the CPU regression gate catches such a
slowdown (docs/ci-gate.md): ``DOSTUNE_TEST_SLOW_CPU_LANE=0.2`` makes every CPU-lane update of a subgroup take 20%
longer, as a slower kernel would (the thread keeps its CPU busy afterwards for that fraction of the update's own
time, so the extra time is CPU time too). Read once, when an optimizer adopts a schedule; unset, nothing is
wrapped."""
from __future__ import annotations

import functools
import os
import time
from typing import Callable

from ..errors import ConfigError

SLOW_CPU_LANE_ENV = "DOSTUNE_TEST_SLOW_CPU_LANE"


def cpu_lane_slowdown() -> float:
    """The fraction by which the environment asks the CPU lane to be slower; 0 when unset."""
    text = os.environ.get(SLOW_CPU_LANE_ENV, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 10:
        raise ConfigError(f"{SLOW_CPU_LANE_ENV} must be a fraction between 0 and 10 (0.2: 20% slower), got {text!r}",
                          hint=f"unset {SLOW_CPU_LANE_ENV}: it is a test-only switch")
    return value


def slowed(update: Callable, fraction: float) -> Callable:
    """``update``, each call followed by busy work for ``fraction`` of that call's own duration; ``update`` itself
    when ``fraction`` is 0."""
    if not fraction:
        return update

    @functools.wraps(update)
    def slower(*args, **kwargs):
        t0 = time.perf_counter()
        out = update(*args, **kwargs)
        t1 = time.perf_counter()
        end = t1 + fraction * (t1 - t0)
        while time.perf_counter() < end:
            pass
        return out

    return slower
