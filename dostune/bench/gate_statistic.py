"""The CPU gate's statistic (bench/gate.py times the steps): each timed step of this tree against the pinned commit's
step right beside it (the same turn, the same engine index), the median of those pairs' log ratios, and a
distribution-free confidence interval for that median (``paired_ratio``).

A neighbour's load comes in bursts: beside a busy test suite the two steps of one turn (0.2 s apart) are slowed
alike (their CPU times correlate, typically 0.6), steps 4 s apart not at all, so the ratio of time-adjacent steps
cancels a burst that a quantile of each side's steps, taken apart, keeps. The median needs no assumption on how the
disturbed steps are spread. A run measures in rounds of ``pairs`` turns and stops as soon as the interval lies
wholly below or wholly above 1 + tolerance (``settled``); a disturbed run, whose interval is wide, measures more
rounds with the engines it has built, up to ``max_pairs``, and is then judged on the median of all it measured.
"""
from __future__ import annotations

import math
import statistics


def median_interval_rank(n: int, confidence: float) -> int:
    """The 0-based rank k such that the k-th smallest and the k-th largest of n samples bound their median with at
    least ``confidence``: the largest k with P(at most k of n samples below the median) <= (1 - confidence) / 2,
    each sample lying below it with probability one half (the sign test). 0, the extremes, when n is too small for
    that confidence."""
    tail = (1 - confidence) / 2
    k, below = 0, 1 / 2 ** n  # below: P(at most k samples below the median)
    while 2 * (k + 1) < n - 1:
        more = below + math.comb(n, k + 1) / 2 ** n
        if more > tail:
            break
        k, below = k + 1, more
    return k


def paired_ratio(current: list[float], baseline: list[float], confidence: float) -> tuple[float, float, float]:
    """(median, low, high): the median over the pairs of current[j] / baseline[j] and its ``confidence``
    interval."""
    logs = sorted(math.log(c / b) for c, b in zip(current, baseline, strict=True))
    k = median_interval_rank(len(logs), confidence)
    return math.exp(statistics.median(logs)), math.exp(logs[k]), math.exp(logs[-1 - k])


def settled(low: float, high: float, tolerance: float) -> bool:
    """Whether an interval lies wholly on one side of 1 + tolerance: the run can tell, and stops timing."""
    return high <= 1 + tolerance or low > 1 + tolerance
