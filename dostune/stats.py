"""Robust summaries of repeated measurements: medians with their spread."""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

from pydantic import BaseModel, Field


class Stat(BaseModel):
    """Median of repeated samples, with the smallest and largest sample as the spread, and the quartiles
    (a spread that one outlier does not blow up)."""

    median: float
    lo: float
    hi: float
    n: int = Field(ge=1)
    q1: Optional[float] = None
    q3: Optional[float] = None

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Stat":
        if not samples:
            raise ValueError("Stat.of needs at least one sample")
        q1 = q3 = None
        if len(samples) >= 4:
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(median=statistics.median(samples), lo=min(samples), hi=max(samples), n=len(samples), q1=q1, q3=q3)

    @property
    def rel_iqr(self) -> float:
        """Half the interquartile range over the median (half the min-max range when quartiles are missing)."""
        if self.q1 is None or self.q3 is None or self.median == 0:
            return self.rel_spread
        return (self.q3 - self.q1) / (2 * abs(self.median))

    @property
    def rel_spread(self) -> float:
        """Half the min-max range over the median: a noise figure comparable across sizes."""
        return 0.0 if self.median == 0 else (self.hi - self.lo) / (2 * abs(self.median))


def upper_middle(samples: Sequence[float]) -> float:
    """The middle sample, the upper of the two middle ones for an even count: a sample that was measured, where a
    median of two would average them. The contention probes report their copies' rates with it."""
    if not samples:
        raise ValueError("upper_middle needs at least one sample")
    return sorted(samples)[len(samples) // 2]


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares y = a + b*x. Returns (a, b, r2). Used for time = overhead + bytes/bandwidth."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("linear_fit needs two or more (x, y) pairs")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("linear_fit needs at least two distinct x values")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 if ss_tot == 0 else 1.0 - ss_res / ss_tot
    return a, b, r2
