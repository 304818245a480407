"""DeepSpeed's own ZeRO-Offload (ratio 1.0), the baseline dostune is compared with: predicted the way dostune is,
from the same profiles. The model profile measured it (forward, backward in the form this host's memory allowed, the
step at its sub_group_size); backward in the other form is its compute plus its gradient copies at that form's rates
(backward.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from .backward import BackwardPrediction, zero_offload_backward
from .inputs import ModelInputs, NodeInputs

if TYPE_CHECKING:
    from .coefficients import Coefficients


def ds_offload_step_lanes(sizes: Sequence[int], inp: NodeInputs, threads: Optional[int] = None) -> float:
    """DeepSpeed 0.19.8's own offloaded step, subgroup after subgroup: unscale, CPU Adam, then
    ``fp16_partition.copy_(fp32_partition)``, which converts on the CPU and copies half precision from
    pageable memory, blocking."""
    threads = threads or inp.default_threads

    def upload(s):  # measured as DeepSpeed does it when the profile has it, else composed from its parts
        return inp.ds_upload.t(s) if inp.ds_upload is not None else inp.convert_cpu.t(s) + inp.h2d_pageable.t(2 * s)

    return sum(inp.unscale_cpu.t(s) + inp.cpu_adam[inp.threads_near(threads)].t(s) + upload(s) for s in sizes)


@dataclass(frozen=True)
class ZeroOffloadPrediction:
    sub_group_size: int
    sizes: list[int]
    pinned: bool
    fwd_s: Optional[float]
    backward: Optional[BackwardPrediction]
    step_s: float
    lanes_s: float  # the step's per-subgroup work (modelled)
    overhead_s: float
    measured_step: bool  # the step is the model profile's measurement (else modelled from the node profile)

    @property
    def bwd_s(self) -> Optional[float]:
        return self.backward.bwd_s if self.backward is not None else None

    @property
    def iter_s(self) -> Optional[float]:
        if self.fwd_s is None or self.backward is None:
            return None
        return self.fwd_s + self.backward.bwd_s + self.step_s


def predict_zero_offload(coeffs: "Coefficients", m: ModelInputs, sizes: Sequence[int], sub_group_size: int,
                         pinned: Optional[bool] = None) -> ZeroOffloadPrediction:
    """ZeRO-Offload at ``sub_group_size`` (subgroups ``sizes``), its host buffers page-locked or not (None: as the
    model profile ran it, which is what this host's memory holds). Its step is the model profile's measurement at
    the profiled sub_group_size, else the node profile's per-subgroup work plus the step overhead."""
    pinned = m.offload_pinned if pinned is None else pinned
    lanes = ds_offload_step_lanes(sizes, coeffs.node)
    measured = m.ds_step_s is not None and sub_group_size == m.ds_sub_group_size
    step = m.ds_step_s if measured else lanes + coeffs.overhead_s
    bwd = zero_offload_backward(coeffs.backward, coeffs.node, pinned) if coeffs.backward is not None else None
    return ZeroOffloadPrediction(sub_group_size=sub_group_size, sizes=list(sizes), pinned=pinned, fwd_s=m.fwd_s,
                                 backward=bwd, step_s=step, lanes_s=lanes, overhead_s=coeffs.overhead_s,
                                 measured_step=measured)
