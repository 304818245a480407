"""The performance model's inputs, fitted from a node profile (and a model profile when there is one).

Nothing here is typed in: every rate and overhead comes from a ``LinearCost`` fitted by ``dostune profile``
(time = overhead + size / rate), or is derived from one in a way ``docs/performance-model.md`` states.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict

from ..errors import ProfileError
from ..profile.model_record import ModelProfile
from ..profile.record import LinearCost, NodeProfile


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


class NodeInputs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    h2d: Cost  # bytes, pinned, alone
    d2h: Cost
    h2d_duplex: Cost  # bytes, while the other direction is busy
    d2h_duplex: Cost
    h2d_pageable: Cost
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

    @classmethod
    def from_profile(cls, p: NodeProfile) -> "NodeInputs":
        missing = [f for f in ("copies", "gpu_adam", "contention") if getattr(p, f) is None]
        if p.convert.gpu is None:
            missing.append("convert.gpu")
        if missing:
            raise ProfileError(f"node profile '{p.name}' has no GPU measurements ({', '.join(missing)} missing); "
                               "the performance model needs a profile measured on the GPU node",
                               hint="run `dostune profile` on the GPU machine, or leave out --profile to tune from the "
                                    "shipped H100 profile")
        c = p.copies
        by_threads = {t: Cost.of(s.fit) for t, s in p.cpu_adam.by_threads.items()}
        # Measured when the profile has it; older profiles: derived from the CPU conversion (both are
        # memory-bound loops; fp32 -> half moves 6 bytes per element, the in-place unscale 8).
        unscale = Cost.of(p.unscale.fit) if p.unscale is not None else Cost.of(p.convert.cpu.fit, scale=6 / 8)
        return cls(node=p.name, h2d=Cost.of(c.h2d.fit), d2h=Cost.of(c.d2h.fit), h2d_duplex=Cost.of(c.duplex_h2d.fit),
                   d2h_duplex=Cost.of(c.duplex_d2h.fit), h2d_pageable=Cost.of(c.h2d_pageable.fit),
                   cpu_adam=by_threads, best_threads=p.cpu_adam.best_threads,
                   default_threads=min(by_threads, key=lambda t: abs(t - (p.host.physical_cores or p.host.logical_cores))),
                   gpu_adam=Cost.of(p.gpu_adam.fit), convert_cpu=Cost.of(p.convert.cpu.fit),
                   convert_gpu=Cost.of(p.convert.gpu.fit), unscale_cpu=unscale,
                   ds_upload=Cost.of(p.ds_upload.fit) if p.ds_upload is not None else None,
                   contention=max(1.0, p.contention.slowdown), contention_gbps=2 * p.contention.dma_gbps_during)


class ModelInputs(BaseModel):
    """What the model profile contributes (None fields when only the node profile is known)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    params: int
    fwd_s: Optional[float] = None
    bwd_s: Optional[float] = None
    ds_step_s: Optional[float] = None  # DeepSpeed ZeRO-Offload's measured step at ds_sub_group_size
    ds_sub_group_size: Optional[int] = None
    step_overhead_s: Optional[float] = None  # measured step prologue/epilogue, when the profile has it
    peak_fwd_gib: Optional[float] = None
    peak_bwd_gib: Optional[float] = None
    peak_step_gib: Optional[float] = None
    free_step_gib: Optional[float] = None
    gpu_total_gib: Optional[float] = None

    @classmethod
    def from_profile(cls, m: ModelProfile) -> "ModelInputs":
        ph = m.phases
        return cls(model=m.model, params=m.params, fwd_s=ph["fwd"].time_s.median, bwd_s=ph["bwd"].time_s.median,
                   ds_step_s=ph["step"].time_s.median, ds_sub_group_size=m.sub_group_size,
                   step_overhead_s=m.step_overhead_s,
                   peak_fwd_gib=ph["fwd"].peak_allocated_gib, peak_bwd_gib=ph["bwd"].peak_allocated_gib,
                   peak_step_gib=ph["step"].peak_allocated_gib, free_step_gib=ph["step"].free_gib,
                   gpu_total_gib=m.gpu_total_gib)

    @property
    def offload_peak_gib(self) -> Optional[float]:
        peaks = [x for x in (self.peak_fwd_gib, self.peak_bwd_gib, self.peak_step_gib) if x is not None]
        return max(peaks) if peaks else None
