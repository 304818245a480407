"""Backward, per method: its compute (the model profile's backward without the offload's gradient copies), the
gradient copies the method makes at the rate of the memory it copies into (page-locked or pageable, from the node
profile), and for dostune what its CPU lane working beside backward costs it (docs/performance-model.md, "Backward").

Backward is bound by the host (ZeRO-3's per-module and per-gradient Python hooks set its pace, the GPU kernels idle
most of it), so the copies are added to the compute, as the hooks that issue them wait for them: blocking ones into
pageable memory in full, page-locked ones by the share the model profile saw backward not hide (``visible``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..optim.footprint import GRAD_BYTES
from ..optim.schedule import Plan, ScheduleConfig
from .inputs import NodeInputs
from .lanes import lent_subgroups


def zero_offload_grad_traffic(elements: int, grad_bytes: int) -> tuple[int, int]:
    """(device-to-host, host-to-device) bytes of DeepSpeed 0.19.8's gradient path in one backward of ZeRO-Offload:
    each gradient partition copied into the host gradient buffer (``grad_bytes`` per element, the precision's), copied
    back to the GPU (ditto), then converted to fp32 there and copied to the host's fp32 gradients (4)."""
    return elements * (grad_bytes + GRAD_BYTES), elements * grad_bytes


def dostune_grad_bytes(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig, grad_bytes: int,
                       fp16: bool) -> list[int]:
    """Device-to-host bytes of dostune's gradient path in one backward (optim/grads.py), per subgroup: nothing copied
    back (the GPU partition is handed on); a GPU-lane subgroup with grads_on_gpu keeps its gradients on the device (in
    fp16 the overflow check still reads a host copy); a CPU-lane subgroup under overlap_backward (its worker updates
    each, speculatively or in place) is read from the host's half-precision copy (``grad_bytes``); every other subgroup, a CPU-lane one the lane balance lent
    to the GPU lane included, takes DeepSpeed's host copy and fp32 copy."""
    kept = set(plan.gpu_subgroups) - lent_subgroups(plan, sched)
    worker = set(plan.cpu_order) if sched.overlap_backward else set()  # it reads every one of them from there
    out = []
    for i, s in enumerate(sizes):
        if i in kept and sched.grads_on_gpu:
            out.append(s * grad_bytes if fp16 else 0)
        elif i in worker:
            out.append(s * grad_bytes)
        else:
            out.append(s * (grad_bytes + GRAD_BYTES))
    return out


def dostune_grad_traffic(sizes: Sequence[int], plan: Plan, sched: ScheduleConfig, grad_bytes: int,
                         fp16: bool) -> int:
    """Device-to-host bytes of dostune's gradient path in one backward, all subgroups (``dostune_grad_bytes``)."""
    return sum(dostune_grad_bytes(sizes, plan, sched, grad_bytes, fp16))


def copy_seconds(node: NodeInputs, d2h_bytes: float, h2d_bytes: float, pinned: bool) -> float:
    """Time of backward's gradient copies: one stream serves them in order, so the two directions add up."""
    if pinned:
        return node.d2h.t(d2h_bytes) * (d2h_bytes > 0) + node.h2d.t(h2d_bytes) * (h2d_bytes > 0)
    return node.d2h_pageable.t(d2h_bytes) * (d2h_bytes > 0) + node.h2d_pageable.t(h2d_bytes) * (h2d_bytes > 0)


@dataclass(frozen=True)
class BackwardInputs:
    """What each method's backward is predicted from (coefficients.py fills it from the profiles)."""

    compute_s: float  # backward without the offload's gradient copies
    slowdown: float  # how many times slower it runs while the CPU lane works beside it
    visible: float  # the share of page-locked copy time that backward does not hide
    grad_bytes: int  # bytes of one gradient element on the device (the training precision's)
    fp16: bool
    zo_bwd_s: float  # ZeRO-Offload's measured backward, in the form it was profiled
    zo_pinned: bool  # that form: page-locked host buffers (else pageable)
    zo_traffic: tuple[float, float]  # ZeRO-Offload's gradient bytes (device-to-host, host-to-device)


@dataclass(frozen=True)
class BackwardPrediction:
    compute_s: float
    copies_s: float  # the gradient copies backward waits for
    interference_s: float  # what the CPU lane working beside it adds
    lane_busy_s: float  # how long the CPU lane worked during backward

    @property
    def bwd_s(self) -> float:
        return self.compute_s + self.copies_s + self.interference_s


def zero_offload_backward(b: BackwardInputs, node: NodeInputs, pinned: bool) -> BackwardPrediction:
    """ZeRO-Offload's backward with its host buffers page-locked or not: as measured, in the form it was profiled;
    else its compute and its gradient copies at the other form's rates."""
    if pinned == b.zo_pinned:
        return BackwardPrediction(b.compute_s, b.zo_bwd_s - b.compute_s, 0.0, 0.0)
    return BackwardPrediction(b.compute_s, copy_seconds(node, *b.zo_traffic, pinned), 0.0, 0.0)


def dostune_backward(b: BackwardInputs, node: NodeInputs, sizes: Sequence[int], plan: Plan, sched: ScheduleConfig,
                     lane_busy_s: float = 0.0) -> BackwardPrediction:
    """dostune's backward when its CPU lane works ``lane_busy_s`` of it: backward's host-bound work runs ``slowdown``
    times slower meanwhile, so the work done in that time is lane_busy_s / slowdown instead of lane_busy_s."""
    d2h = dostune_grad_traffic(sizes, plan, sched, b.grad_bytes, b.fp16)
    copies = b.visible * copy_seconds(node, d2h, 0, pinned=True)
    return BackwardPrediction(b.compute_s, copies, lane_busy_s * (1.0 - 1.0 / b.slowdown), lane_busy_s)
