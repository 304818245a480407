"""The performance model's inputs, fitted from a node profile (and a model profile when there is one).

Nothing here is typed in: every rate and overhead comes from a ``LinearCost`` fitted by ``dostune profile``
(time = overhead + size / rate), or is derived from one in a way ``docs/performance-model.md`` states. What an older
profile lacks is taken from what it has, and ``notes`` say so; coefficients.py combines the two profiles.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict

from ..errors import ProfileError
from ..profile.model_record import ModelProfile
from ..profile.record import LinearCost, NodeProfile, Sample, Series, fit_series
from ..profile.step_parts import prologue_shares
from ..stats import Stat


class Cost(BaseModel):
    """time(size) = overhead_s + size / rate."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    overhead_s: float
    rate: float

    @classmethod
    def of(cls, c: LinearCost, scale: float = 1.0) -> "Cost":
        return cls(overhead_s=max(c.overhead_s, 0.0), rate=c.rate_per_s * scale)

    def t(self, size: float) -> float:
        return self.overhead_s + size / self.rate

    def at_rate(self, factor: float) -> "Cost":
        """The same cost with the rate ``factor`` times as high."""
        return self if factor == 1.0 else Cost(overhead_s=self.overhead_s, rate=self.rate * factor)


# a subgroup's size at which a per-element CPU-lane time is read (NodeInputs.cpu_lane_per_element)
LANE_RATE_ELEMENTS = 10**8


class NodeInputs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    h2d: Cost  # bytes, pinned, alone
    d2h: Cost
    h2d_duplex: Cost  # bytes, while the other direction is busy
    d2h_duplex: Cost
    h2d_pageable: Cost
    d2h_pageable: Cost  # bytes into pageable memory, the host waiting (ZeRO-Offload's gradients without pin_memory)
    cpu_adam: dict[int, Cost]  # elements, by OpenMP thread count
    best_threads: int
    default_threads: int  # what DeepSpeed's own path runs with: torch's default, one per physical core
    gpu_adam: Cost  # elements: the lane kernel incl. unscale and half-precision write
    convert_cpu: Cost  # elements fp32 -> half on the CPU
    convert_gpu: Cost
    unscale_cpu: Cost  # elements: grad *= 1/scale in place on the CPU (derived, see docs)
    ds_upload: Optional[Cost] = None  # DeepSpeed's own blocking fp32 -> half upload, when measured
    contention: float  # CPU Adam slowdown while PCIe DMA runs (>= 1) ...
    contention_gbps: float  # ... at this much combined H2D + D2H traffic
    h2d_under_cpu: float = 1.0  # host-to-device copies' rate while CPU Adam computes, over their rate when it does not
    notes: tuple[str, ...] = ()  # what an older profile lacked and what stands in for it

    def threads_near(self, threads: int) -> int:
        """The profiled CPU Adam thread count nearest ``threads``."""
        return threads if threads in self.cpu_adam else min(self.cpu_adam, key=lambda t: abs(t - threads))

    def cpu_lane_per_element(self, threads: int) -> float:
        """``cpu_lane_seconds`` (producing half precision on the CPU) per element at a subgroup's size, where the fitted
        fixed costs hardly count: what the lane probes' per-element readings are set against, and the ratio of two
        thread counts."""
        return self.cpu_lane_seconds(LANE_RATE_ELEMENTS, threads, "cpu_convert") / LANE_RATE_ELEMENTS

    def cpu_lane_seconds(self, size: int, threads: int, upload: str) -> float:
        """Host time of one CPU-lane subgroup, uncontended: unscale, DeepSpeedCPUAdam (and the CPU conversion
        when half precision is produced on the CPU)."""
        t = self.unscale_cpu.t(size) + self.cpu_adam[self.threads_near(threads)].t(size)
        if upload == "cpu_convert":
            t += self.convert_cpu.t(size)
        return t

    @classmethod
    def from_profile(cls, p: NodeProfile) -> "NodeInputs":
        missing = [f for f in ("copies", "gpu_adam", "contention") if getattr(p, f) is None]
        if p.convert.gpu is None:
            missing.append("convert.gpu")
        if missing:
            raise ProfileError(f"node profile '{p.name}' has no GPU measurements ({', '.join(missing)} missing); "
                               "the performance model needs a profile measured on the GPU node",
                               hint="run `dostune profile` on the GPU machine, or leave out --profile to tune from the "
                                    "shipped H200 profile")
        c = p.copies
        by_threads = {t: Cost.of(s.fit) for t, s in p.cpu_adam.by_threads.items()}
        # Measured when the profile has it; older profiles: derived from the CPU conversion (both are
        # memory-bound loops; fp32 -> half moves 6 bytes per element, the in-place unscale 8).
        unscale = Cost.of(p.unscale.fit) if p.unscale is not None else Cost.of(p.convert.cpu.fit, scale=6 / 8)
        notes = []
        h2d_under_cpu = p.contention.h2d_under_cpu
        if h2d_under_cpu is None:
            notes.append(f"node profile '{p.name}' (schema {p.schema_version}) did not measure host-to-device copies "
                         "while CPU Adam computes: the model takes them at their rate beside an idle CPU (re-profile "
                         "the node with this dostune to measure them)")
        if c.d2h_pageable is None:
            notes.append(f"node profile '{p.name}' (schema {p.schema_version}) did not measure pageable device-to-host "
                         "copies: ZeRO-Offload's gradient copies without pin_memory are taken at its pageable "
                         "host-to-device rate (re-profile the node with this dostune to measure them)")
        return cls(node=p.name, h2d=Cost.of(c.h2d.fit), d2h=Cost.of(c.d2h.fit), h2d_duplex=Cost.of(c.duplex_h2d.fit),
                   d2h_duplex=Cost.of(c.duplex_d2h.fit), h2d_pageable=Cost.of(c.h2d_pageable.fit),
                   d2h_pageable=Cost.of((c.d2h_pageable or c.h2d_pageable).fit), notes=tuple(notes),
                   cpu_adam=by_threads, best_threads=p.cpu_adam.best_threads,
                   default_threads=min(by_threads, key=lambda t: abs(t - (p.host.physical_cores or p.host.logical_cores))),
                   gpu_adam=Cost.of(p.gpu_adam.fit), convert_cpu=Cost.of(p.convert.cpu.fit),
                   convert_gpu=Cost.of(p.convert.gpu.fit), unscale_cpu=unscale,
                   ds_upload=Cost.of(p.ds_upload.fit) if p.ds_upload is not None else None,
                   contention=max(1.0, p.contention.slowdown), contention_gbps=2 * p.contention.dma_gbps_during,
                   h2d_under_cpu=min(1.0, h2d_under_cpu) if h2d_under_cpu is not None else 1.0)


def timed_backward(m: ModelProfile) -> float:
    """ZeRO-Offload's median backward. Profiles before schema 3 timed the iteration that records the memory timeline
    and the gradients' readiness too, whose hooks slowed it (its backward, ``backward_s``, up to 1.6x the others');
    where such a record still holds every sample (2 or 3: lo, median, hi) that one is left out."""
    t = m.phases["bwd"].time_s
    if m.schema_version >= 3 or t.n not in (2, 3):
        return t.median
    samples = [t.lo, t.hi] if t.n == 2 else [t.lo, t.median, t.hi]
    recorded = min(range(len(samples)), key=lambda k: abs(samples[k] - m.backward_s))
    if abs(samples[recorded] - m.backward_s) > 1e-9 * max(1.0, m.backward_s):
        return t.median
    rest = samples[:recorded] + samples[recorded + 1:]
    return sum(rest) / len(rest)


def _mean(first: Optional[float], later: Optional[float]) -> Optional[float]:
    """The two windows' mean; ``first`` alone where either is unknown."""
    return first if first is None or later is None else (first + later) / 2


def _mean_series(first: Optional[Series], later: Optional[Series]) -> Optional[Series]:
    """``first`` with each point's median the mean of its two windows' (the same subgroups, in order), refitted."""
    if first is None or later is None or [p.size for p in first.points] != [p.size for p in later.points]:
        return first
    points = [Sample(size=a.size, threads=a.threads,
                     seconds=Stat(median=(a.seconds.median + b.seconds.median) / 2, lo=min(a.seconds.lo, b.seconds.lo),
                                  hi=max(a.seconds.hi, b.seconds.hi), n=a.seconds.n + b.seconds.n))
              for a, b in zip(first.points, later.points)]
    return fit_series(first.unit, points)


class ModelInputs(BaseModel):
    """What the model profile contributes (None fields when only the node profile is known, or when a profile older
    than schema 3 did not measure them: coefficients.py then says what stands in)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    params: int
    profile_schema: Optional[int] = None
    precision: str = "bf16"
    # forward over the backward probes' rounds, spread over a span of the host's time (schema 8), else over the timed
    # iterations
    fwd_s: Optional[float] = None
    bwd_s: Optional[float] = None  # ZeRO-Offload's backward, in the form it was profiled (offload_pinned)
    ds_step_s: Optional[float] = None  # DeepSpeed ZeRO-Offload's measured step at ds_sub_group_size
    ds_sub_group_size: Optional[int] = None
    step_overhead_s: Optional[float] = None  # measured step prologue/epilogue, when the profile has it
    peak_fwd_gib: Optional[float] = None
    peak_bwd_gib: Optional[float] = None
    peak_step_gib: Optional[float] = None
    free_step_gib: Optional[float] = None
    gpu_total_gib: Optional[float] = None
    offload_pinned: bool = True  # ZeRO-Offload's host buffers were page-locked (its gradient copies asynchronous)
    bwd_traffic_bytes: Optional[tuple[float, float]] = None  # (D2H, H2D) bytes NVML counted in its backward
    bwd_no_copy_s: Optional[float] = None  # backward without the gradient copies
    bwd_pinned_copy: Optional[tuple[float, int]] = None  # (seconds, bytes): backward copying to page-locked memory
    bwd_beside_lane_s: Optional[float] = None  # ... with dostune's CPU-lane kernel working beside it
    lane_threads: Optional[int] = None  # that kernel's threads
    lane_beside_s_per_elem: Optional[float] = None  # its update during that backward, seconds per element
    lane_alone_s_per_elem: Optional[float] = None  # ... and with nothing else running
    # the lane as the step runs it (schema 10): its threads, seconds per element alone, how many times slower beside
    # copies both ways, and those copies' combined rate in GB/s
    lane_step_threads: Optional[int] = None
    lane_step_s_per_elem: Optional[float] = None
    lane_step_copies_slowdown: Optional[float] = None
    lane_step_copies_gbps: Optional[float] = None
    step_shares: Optional[tuple[float, float]] = None  # (prologue, parameter release) shares of the step overhead
    ds_cpu_adam: Optional[Series] = None  # DeepSpeedCPUAdam per subgroup as ZeRO-Offload's step ran it
    ds_unscale: Optional[Series] = None  # its gradient unscale per subgroup

    @classmethod
    def from_profile(cls, m: ModelProfile) -> "ModelInputs":
        """The model profile's figures; ZeRO-Offload's step, its overhead and its CPU Adam and unscale rates are each
        the mean of the two windows' draws where the profile timed the step twice (schema 11, StepWindow)."""
        ph = m.phases
        later = m.later_window
        bwd = timed_backward(m)
        traffic = m.pcie.get("bwd") if m.pcie else None
        lane, step_lane = m.backward_lane, m.step_lane
        return cls(model=m.model, params=m.params, profile_schema=m.schema_version, precision=m.precision,
                   fwd_s=(m.probe_forward_s or ph["fwd"].time_s).median, bwd_s=bwd,
                   ds_step_s=_mean(ph["step"].time_s.median, None if later is None else later.step_s.median),
                   ds_sub_group_size=m.sub_group_size,
                   step_overhead_s=_mean(m.step_overhead_s, None if later is None else later.step_overhead_s),
                   peak_fwd_gib=ph["fwd"].peak_allocated_gib, peak_bwd_gib=ph["bwd"].peak_allocated_gib,
                   peak_step_gib=ph["step"].peak_allocated_gib, free_step_gib=ph["step"].free_gib,
                   gpu_total_gib=m.gpu_total_gib, offload_pinned=m.offload_pinned,
                   bwd_traffic_bytes=(traffic.tx_gbps * 1e9 * bwd, traffic.rx_gbps * 1e9 * bwd) if traffic else None,
                   bwd_no_copy_s=m.backward_no_copy_s.median if m.backward_no_copy_s is not None else None,
                   bwd_pinned_copy=(m.backward_pinned_copy.backward_s.median, m.backward_pinned_copy.bytes)
                   if m.backward_pinned_copy is not None else None,
                   bwd_beside_lane_s=lane.backward_s.median if lane is not None else None,
                   lane_threads=lane.threads if lane is not None else None,
                   lane_beside_s_per_elem=lane.lane_beside_s.median / lane.elements if lane is not None else None,
                   lane_alone_s_per_elem=lane.lane_alone_s.median / lane.elements if lane is not None else None,
                   lane_step_threads=step_lane.threads if step_lane is not None else None,
                   lane_step_s_per_elem=step_lane.alone_s.median / step_lane.elements if step_lane is not None else None,
                   lane_step_copies_slowdown=step_lane.copies_slowdown if step_lane is not None else None,
                   lane_step_copies_gbps=step_lane.h2d_gbps + step_lane.d2h_gbps if step_lane is not None else None,
                   step_shares=prologue_shares(m.step_parts_s),
                   ds_cpu_adam=_mean_series(m.ds_cpu_adam, None if later is None else later.ds_cpu_adam),
                   ds_unscale=_mean_series(m.ds_unscale, None if later is None else later.ds_unscale))

    @property
    def offload_peak_gib(self) -> Optional[float]:
        peaks = [x for x in (self.peak_fwd_gib, self.peak_bwd_gib, self.peak_step_gib) if x is not None]
        return max(peaks) if peaks else None
