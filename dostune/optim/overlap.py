"""The CPU lane during backward (``overlap_backward``): each CPU-lane subgroup is updated as soon as
backward has finalised all of its gradients, instead of after backward.

Exactness. The update needs the combined unscale/clip factor, and the step must be skipped on an
invalid gradient norm; both depend on the global gradient norm, known only when backward ends. So an
update started during backward is speculative: it assumes the factor is 1/loss_scale (no clipping) and
writes the new fp32 params and Adam states into *shadow* buffers with dostune's out-of-place CPU Adam
(bit-identical to DeepSpeedCPUAdam), leaving the live state untouched. At the step, the global norm
decides:

* clipping did not trigger and the norm is valid: the speculative results are exactly what the
  non-overlapped optimizer computes; committing swaps shadow and live buffers (no copy);
* clipping triggered: every speculative subgroup is recomputed from the untouched live state with the
  real factor (the cost: that subgroup's CPU Adam runs twice, once hidden under backward);
* the norm is invalid (inf/nan): nothing is committed and the half-precision params uploaded during
  backward are restored from the live fp32 params; the step is skipped as DeepSpeed skips it.

To waste little when clipping does trigger, each subgroup's squared gradient norm is added to a running
sum as it becomes ready; once that partial norm alone exceeds the clipping threshold (the final norm can
only be larger), speculation stops and the remaining subgroups wait for the real factor.

Host memory. Each speculative subgroup needs shadow buffers of its size (12 bytes per element). With
``speculative_subgroups`` only that many have them (``speculative``: the first whose gradients are final);
the others never speculate: the worker takes them once the real factor is known, at the step, and updates
them in place with the same kernel (the arithmetic of an in-place DeepSpeedCPUAdam call), while the host
goes on with the step and the GPU lane runs. Doing that in this worker rather than with DeepSpeed's own
update on the host thread keeps one owner of the CPU cores, starts the updates while the host is still
releasing the parameters, and reads the gradients backward left in the pinned half-precision buffer, so
backward copies no fp32 gradient for them.

The worker is a Python thread whose CPU Adam runs in C with the GIL released (ctypes), so backward's own
hooks keep running. The new half-precision params are produced by the same pass and uploaded on a
low-priority CUDA stream as each subgroup finishes.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Optional

import numpy as np
import torch

from . import cpu_kernel
from .host_state import Buffers, pinned_buffers
from .kernels import AdamScalars
from .norms import clipping_certain

if TYPE_CHECKING:
    from .device import Device


# While the CPU lane has work, a thread waiting for the GIL gets it after this long instead of Python's default
# 5 ms: the worker needs it briefly a few times per subgroup (between C calls that release it), and the host thread
# it waits on runs long stretches of Python (backward's hooks, DeepSpeed's step prologue).
LANE_SWITCH_INTERVAL_S = 0.0005


@dataclass
class SubgroupIO:
    """What the worker needs of one CPU-lane subgroup, read fresh each step (checkpoint loads replace it)."""

    param: torch.Tensor  # live fp32 params (flat)
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    half: torch.Tensor  # the ZeRO-3 half-precision partition on the device


@dataclass
class StepOutcome:
    committed: list[int] = field(default_factory=list)  # shadows now hold the new state: swap them in
    in_place: list[int] = field(default_factory=list)  # updated in place with the real factor: count their step
    speculative: int = 0  # subgroups updated before the real factor was known (during backward)
    redone: int = 0  # of those, recomputed with the real clipping factor
    spans: list = field(default_factory=list)  # ("cpu", subgroup, t0, t1) host times of each update


class BackwardOverlap:
    """``speculative``: the subgroups that may be updated during backward, into shadow buffers (the others are updated
    in place at the step). ``partial_norm_cutoff``: stop speculating once the partial norm makes clipping certain
    (False: every speculative subgroup speculates, and a step that clips recomputes them all). ``wrap_update``: wraps
    the per-subgroup update once (None: the update as it is). The last two are cpu_lane.CpuLaneSeams'."""

    def __init__(self, subgroups: list[int], io: Callable[[int], SubgroupIO],
                 scalars: Callable[[], dict[int, AdamScalars]], device: "Device", pin: Callable,
                 threads_backward: int, threads_step: int, ring: int, speculative: Collection[int],
                 partial_norm_cutoff: bool = True, wrap_update: Optional[Callable[[Callable], Callable]] = None):
        self.subgroups = list(subgroups)
        self._shadowed = frozenset(speculative)
        self._io, self._scalars_fn, self._pin = io, scalars, pin
        self._device = device
        self.threads_backward, self.threads_step = threads_backward, threads_step
        self._partial_norm_cutoff = partial_norm_cutoff
        self._run_update = self._update if wrap_update is None else wrap_update(self._update)
        self._shadows: dict[int, Buffers] = {}
        # Pinned half-precision results waiting for their upload, used round robin: ``ring`` buffers (see
        # footprint.half_ring_count), each allocated at its first use and grown to the widest subgroup it serves.
        self._halves: list[torch.Tensor] = [torch.empty(0) for _ in range(ring)]
        self._half_done: list = [None] * ring
        self._switch_interval: Optional[float] = None
        # Uploads of half-precision results; 0 is CUDA's lowest priority, so backward's kernels go first.
        self._stream = device.new_stream(priority=0)
        self._tasks: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._begin_step()

    # ------------------------------------------------------------------ per step
    def _begin_step(self) -> None:
        self.scalars: Optional[dict[int, AdamScalars]] = None
        self.spec_inv: Optional[float] = None
        self.clip_threshold: Optional[float] = None  # partial norm / loss scale above which clipping is certain
        self.loss_scale = 1.0
        self._queued: set[int] = set()
        self._speculative: set[int] = set()
        self._final: set[int] = set()
        self._in_place: list[int] = []
        self._stop_speculating = False
        self._error: Optional[BaseException] = None
        self._spans: list = []
        self._done = threading.Event()
        # (factor, commit) once the step has begun, set before anything is queued for it: the worker reads it to run
        # every update from then on with the step's thread count, also those of subgroups handed over during
        # backward that it had not reached yet.
        self._submitted: Optional[tuple] = None

    @property
    def active(self) -> bool:
        return bool(self._queued)


    def open(self, spec_inv: Optional[float], loss_scale: float, clip: float) -> None:
        """Called at the first ready subgroup of a backward: fixes this step's Adam constants and whether
        (and up to which partial norm) speculation is allowed. ``spec_inv`` None: never speculate."""
        self.prepare()
        self.spec_inv = spec_inv
        self.loss_scale = loss_scale
        self.clip_threshold = clip if clip > 0 else None
        self._ensure_thread()
        self._lane_busy(True)

    def prepare(self) -> None:
        """Fix this step's Adam constants if backward did not (call before anything advances step counts)."""
        if self.scalars is None:
            self.scalars = self._scalars_fn()

    def ready(self, i: int, event, partial_sq) -> None:
        """Subgroup i's gradients are final once ``event`` completes; ``partial_sq`` (a host tensor
        filled by then) is the sum of squared gradient norms of the subgroups ready so far."""
        self._queued.add(i)
        self._tasks.put(("ready", i, event, partial_sq))

    def submit(self, inv: Optional[float], commit: bool) -> None:
        """At the step, hand the worker the real factor (``inv`` None: the step is skipped, invalid norm) and
        return at once: what is left of the CPU lane runs while the host goes on with the step."""
        self._submitted = (inv, commit)
        self._ensure_thread()
        missing = [] if inv is None else [i for i in self.subgroups if i not in self._queued]
        if missing:
            self.prepare()
        for i in missing:  # no gradient reached them in backward (unused parameters) or no overlap this step
            self._queued.add(i)
            self._tasks.put(("ready", i, None, None))
        self._tasks.put(("final", inv, commit))
        self._lane_busy(True)

    def finish(self, inv: Optional[float], commit: bool) -> StepOutcome:
        """Wait for the CPU lane to finish this step (submitting the factor first if ``submit`` was not called)."""
        if self._submitted is None:
            self.submit(inv, commit)
        elif self._submitted != (inv, commit):
            raise RuntimeError(f"CPU lane: finish{(inv, commit)} after submit{self._submitted}")
        self._done.wait()
        self._lane_busy(False)
        if self._error is not None:
            err = self._error
            self._begin_step()
            raise err
        out = StepOutcome(speculative=len(self._speculative), spans=self._spans)
        if inv is not None:
            out.committed = sorted(self._final)
            out.in_place = sorted(self._in_place)
            out.redone = 0 if commit else len(self._speculative)
        self._begin_step()
        return out

    def _lane_busy(self, busy: bool) -> None:
        """Shorten Python's GIL switch interval while the worker has work (see LANE_SWITCH_INTERVAL_S)."""
        if busy and self._switch_interval is None:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, LANE_SWITCH_INTERVAL_S))
        elif not busy and self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def shadow(self, i: int) -> Buffers:
        return self._shadows[i]

    def set_shadow(self, i: int, b: Buffers) -> None:
        self._shadows[i] = b

    # ------------------------------------------------------------------ worker
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="dostune-cpu-lane", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._lane_busy(False)
        if self._thread is not None and self._thread.is_alive():
            self._tasks.put(("stop",))
            self._thread.join(timeout=60)

    def _run(self) -> None:
        self._device.enter_thread()
        deferred: list[int] = []
        while True:
            task = self._tasks.get()
            try:
                if task[0] == "stop":
                    return
                if task[0] == "ready":
                    _, i, event, partial_sq = task
                    self._device.wait_for(event)  # the subgroup's gradient copies (and its partial norm) are done
                    if self._may_speculate(i, partial_sq):
                        self._run_update(i, self.spec_inv,
                                         self.threads_backward if self._submitted is None else self.threads_step)
                        self._speculative.add(i)
                    else:
                        deferred.append(i)
                    continue
                _, inv, commit = task
                if inv is None:  # skipped step: put back what the speculative uploads overwrote
                    for i in sorted(self._speculative):
                        self._restore_half(i)
                else:
                    redo = [] if commit else sorted(self._speculative)
                    for i in redo + deferred:
                        self._run_update(i, inv, self.threads_step)
                    self._final = set(self._speculative) | {i for i in deferred if i in self._shadowed}
                    self._in_place = [i for i in deferred if i not in self._shadowed]
                self._sync_uploads()
            except BaseException as e:  # noqa: BLE001 - handed to the step, which raises it
                self._error = e
                if task[0] != "final":
                    continue
            if task[0] == "final":
                deferred = []
                self._done.set()

    def _may_speculate(self, i: int, partial_sq) -> bool:
        if i not in self._shadowed or self.spec_inv is None or self._stop_speculating:
            return False
        if partial_sq is not None and self._partial_norm_cutoff and \
                clipping_certain(partial_sq, self.loss_scale, self.clip_threshold):
            self._stop_speculating = True
            return False
        return True

    def reserve(self, subgroups: list[int]) -> None:
        """Allocate and page-lock the shadow buffers of ``subgroups`` now instead of at their first update: a
        subgroup adaptive_swing moves to this lane mid-run otherwise pays for 12 bytes per element of fresh pinned
        memory inside that step (on the H100 a 25M-element subgroup's update ended ~190 ms late)."""
        for i in subgroups:
            self._buffers(i, self._io(i))

    def _buffers(self, i: int, io: SubgroupIO) -> Buffers:
        """Where subgroup i's update writes: its shadow buffers, or its live state for one updated in place."""
        if i not in self._shadowed:
            return Buffers(io.param, io.exp_avg, io.exp_avg_sq)
        b = self._shadows.get(i)
        n = io.param.numel()
        if b is None or b.p.numel() != n:
            b = self._shadows[i] = pinned_buffers(i, n, self._pin, "shadow")
        return b

    def _half_buffer(self, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._halves[k]
        if buf.numel() < n or buf.dtype != dtype:
            buf = self._device.host_empty(n, dtype)
            self._halves[k] = buf
        return buf[:n]

    def _update(self, i: int, inv: float, threads: int) -> None:
        io = self._io(i)
        b = self._buffers(i, io)
        n = io.param.numel()
        k = len(self._spans) % len(self._halves)
        self._device.wait_for(self._half_done[k])  # the last upload from this pinned buffer has finished
        # fp32 training keeps fp32 "half" partitions: the new params themselves (the shadow, pinned) are uploaded
        rounded = io.half.dtype in (torch.bfloat16, torch.float16)
        half = self._half_buffer(k, n, io.half.dtype) if rounded else b.p
        t0 = time.perf_counter()
        cpu_kernel.adam_out_of_place(io.param, io.grad, io.exp_avg, io.exp_avg_sq, b.p, b.m, b.v,
                                     self.scalars[i], inv_scale=inv, half_out=half if rounded else None,
                                     threads=threads)
        t1 = time.perf_counter()
        self._spans.append(("cpu", i, t0, t1))
        dev = self._device
        with dev.on(self._stream):
            io.half.copy_(half, non_blocking=True)
            ev = dev.record(self._stream, timing=False)
        self._half_done[k] = ev

    def _restore_half(self, i: int) -> None:
        io = self._io(i)
        with self._device.on(self._stream):
            io.half.copy_(io.param.to(io.half.dtype), non_blocking=False)

    def _sync_uploads(self) -> None:
        self._device.synchronize(self._stream)
        self._half_done = [None] * len(self._halves)

    @staticmethod
    def spec_factor(loss_scale: float) -> float:
        """The unscale factor a step without clipping uses, as the fp32 value the kernels receive."""
        return float(np.float32(1.0 / loss_scale))
