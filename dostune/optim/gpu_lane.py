"""The GPU lane: each GPU-lane subgroup's fp32 params and Adam states meet its gradients on the GPU, a fused Adam
bit-identical to DeepSpeedCPUAdam (kernels.py) updates them and writes the half-precision partition in the same
pass. Two kinds of subgroup, each its own lane object:

* streamed (``StreamedGpuLane``): the states stream into a staging slot, and back to host memory after the
  update; slots are reused round robin, each refill waiting (a CUDA event) for the slot's previous write-back.
  The CPU-lane subgroups adaptive_swing lends to the GPU lane (``Plan.lent``) are streamed the same way, their
  gradients streamed in from DeepSpeed's fp32 host buffer with the states (where backward offloaded them);
* resident (``ResidentGpuLane``, ``resident_subgroups``): DeepSpeed built the subgroup's fp32 params, gradient
  buffer and (through host_state.py) Adam states on the GPU and keeps no host copy; the update runs on them in place
  and streams nothing over PCIe.

Everything is queued on the lane streams (queues.py) up front; nothing here blocks the host.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .footprint import staging_slots
from .grads import GradRouting
from .host_state import Buffers, HostStates, empty_buffers
from .kernels import LaneAdam
from .queues import Queues
from .schedule import Plan, streamed_gradients


class _Slot:
    """A staging slot: room for the widest streamed subgroup's states (and gradients when any streams them in),
    and the event after which it may be refilled."""

    def __init__(self, queues: Queues, width: int, with_grads: bool, device: torch.device):
        with queues.on("compute"):
            # Allocated on the stream that uses them; freed at the end of the step after the lanes drain.
            self.states = empty_buffers(width, device)
            self.grad = torch.empty(width, device=device) if with_grads else None
        self.ready = queues.record("compute", timing=False)


class StreamedGpuLane:
    def __init__(self, host: HostStates, grads: GradRouting, queues: Queues, lane_adam: LaneAdam,
                 staging_buffers: int, grads_on_gpu: bool, device: torch.device):
        self._host, self._grads, self._q, self._adam, self._device = host, grads, queues, lane_adam, device
        self._nbuf = staging_buffers
        self._grads_on_gpu = grads_on_gpu
        self._sizes = [host.numel(i) for i in range(host.count)]
        self._plan: Optional[Plan] = None
        # Per streamed subgroup of the plan: how its inputs come in and where its gradients are read, by where they
        # are (kept on the GPU, or streamed in from DeepSpeed's fp32 host buffer: without grads_on_gpu, or lent).
        self._io: dict[int, tuple[Callable, Callable]] = {}
        # This iteration's slots (slot index -> slot), used round robin; _fills counts the fills so far.
        # _prefetched: subgroup -> (start, done) of the states streamed in at the step's start.
        self._slots: dict[int, _Slot] = {}
        self._fills = 0
        self._prefetched: dict[int, tuple] = {}

    def set_plan(self, plan: Plan) -> None:
        self._plan = plan
        self._nslots, self._width, self._with_grads = staging_slots(self._sizes, plan, self._nbuf, self._grads_on_gpu)
        streams = streamed_gradients(plan, self._grads_on_gpu)
        self._io = {s.subgroup: (self._states_and_grads_in, self._streamed_grad) if s.subgroup in streams
                    else (self._states_in, self._kept_grad) for s in plan.gpu_slots}

    def _new_slot(self) -> _Slot:
        return _Slot(self._q, self._width, self._with_grads, self._device)

    @property
    def staged_bytes(self) -> int:
        """GPU memory this step's staging slots hold (0 between steps): what footprint.staging_slots counts."""
        return sum(4 * (sum(t.numel() for t in slot.states) + (slot.grad.numel() if slot.grad is not None else 0))
                   for slot in self._slots.values())

    def reserve(self) -> bool:
        """Allocate this step's staging slots, before anything is queued into them. False, holding none, when the
        device cannot give them all (another process took the memory): the step then plans without this lane's
        streamed subgroups, none of which has been half queued."""
        try:
            while len(self._slots) < self._nslots:
                self._slots[len(self._slots)] = self._new_slot()
        except torch.OutOfMemoryError:
            self._slots.clear()
            return False
        return True

    def _stage(self, i: int, slot: _Slot) -> tuple:
        """Queue subgroup i's states into ``slot`` once the slot is free; (start, done)."""
        q = self._q
        with torch.no_grad(), q.on("h2d"):
            q.wait("h2d", slot.ready)
            t_in = q.record("h2d")
            slot.states.head(self._host.numel(i)).copy_from(self._host.live(i))
            return t_in, q.record("h2d")

    def prefetch(self) -> None:
        """At the step's start, stream the first subgroups' states into every slot: they do not depend on this
        step's gradients or clipping factor, so the copies run while the host works through DeepSpeed's prologue
        (releasing the parameters, the gradient norm: about 40 ms for gpt2-1.3b on the H100), which used to leave
        the copy engines idle. Backward's activations are freed by now, so the slots do not raise peak memory. A
        skipped step drains and drops them. The slots are ``reserve``'s."""
        for gs in self._plan.first_fills:
            self._host.ensure_pinned(gs.subgroup)  # a checkpoint load may have replaced the states
            self._prefetched[gs.subgroup] = self._stage(gs.subgroup, self._slots[gs.slot])

    def _states_in(self, i: int, slot: _Slot, states: Buffers, early: Optional[tuple], trace: list) -> tuple:
        """(event after which subgroup i's inputs are in the slot, its h2d span to trace after the update or None)
        when its gradients are kept on the GPU: only the states come in, unless the step's prefetch brought them.
        Then the update waits for this subgroup's own copies: an event recorded now would follow every copy queued
        on the h2d stream so far, i.e. all the prefetched slots (the first streamed subgroup's Adam would wait for
        the others' copies: ~16 ms of a gpt2-1.3b step on the H100)."""
        if early is not None:
            trace.append(("h2d", i, *early))
            return early[1], None
        q = self._q
        with q.on("h2d"):
            q.wait("h2d", slot.ready)
            t_in = q.record("h2d")
            states.copy_from(self._host.live(i))
            done = q.record("h2d")
        return done, ("h2d", i, t_in, done)

    def _states_and_grads_in(self, i: int, slot: _Slot, states: Buffers, early: Optional[tuple], trace: list) -> tuple:
        """Likewise when the gradients come from the host (GradRouting.streamed_grad): they stream in after the
        states."""
        q, n = self._q, states.p.numel()
        with q.on("h2d"):
            q.wait("h2d", slot.ready)
            if early is not None:
                trace.append(("h2d", i, *early))
                t_in = q.record("h2d")
            else:
                t_in = q.record("h2d")
                states.copy_from(self._host.live(i))
            src, dst = self._grads.streamed_grad(i), slot.grad[:n]
            if src.dtype == dst.dtype:
                dst.copy_(src, non_blocking=True)
            else:  # half precision on the host: over PCIe as it is, widened on the device (exact)
                dst.copy_(src.to(dst.device, non_blocking=True))
            done = q.record("h2d")
        return done, ("h2d", i, t_in, done)

    def _kept_grad(self, i: int, slot: _Slot, n: int) -> torch.Tensor:
        return self._grads.device[i]

    def _streamed_grad(self, i: int, slot: _Slot, n: int) -> torch.Tensor:
        return slot.grad[:n]

    def queue(self, inv: float, scalars: dict, trace: list) -> None:
        """Queue every streamed subgroup: H2D into a slot (the states unless they came in at the step's start), fused
        Adam, convert, D2H."""
        host, q, adam = self._host, self._q, self._adam
        for gs in self._plan.gpu_slots:
            i = gs.subgroup
            n = host.numel(i)
            idx = self._fills % self._nslots
            self._fills += 1
            slot = self._slots[idx]
            states = slot.states.head(n)
            bring_in, grad_of = self._io[i]
            # the step's prefetch filled slot k with the k-th
            h2d_done, h2d_span = bring_in(i, slot, states, self._prefetched.get(i), trace)
            g = grad_of(i, slot, n)
            step = host.advance(i)
            with q.on("compute"):
                q.wait("compute", h2d_done)
                t_c = q.record("compute")
                adam.update(states.p, g, states.m, states.v, host.half(i), inv, step, host.group(i), scalars.get(i))
                compute_done = q.record("compute")
            with q.on("d2h"):
                q.wait("d2h", compute_done)
                t_out = q.record("d2h")
                host.live(i).copy_from(states)
                slot.ready = q.record("d2h")
            if h2d_span is not None:
                trace.append(h2d_span)
            trace += [("gpu", i, t_c, compute_done), ("d2h", i, t_out, slot.ready)]

    def reset(self) -> None:
        """After the step, once the lanes' streams are drained and the default stream waits on them."""
        self._slots.clear()
        self._fills = 0
        self._prefetched.clear()


class ResidentGpuLane:
    """Updates the resident subgroups in place, on DeepSpeed's own tensors: the fp32 params and Adam states its
    checkpoints and accessors read, and the fp32 gradient buffer the kept gradients were written to in backward
    (grads.py), all on the device (on a CPU device, in the one memory there is)."""

    def __init__(self, host: HostStates, queues: Queues, lane_adam: LaneAdam):
        self._host, self._q, self._adam = host, queues, lane_adam
        self._subgroups: tuple = ()

    def set_plan(self, plan: Plan) -> None:
        self._subgroups = plan.resident

    def queue(self, inv: float, scalars: dict, trace: list) -> None:
        """Queue every resident subgroup's update; nothing is copied in or out."""
        host, q = self._host, self._q
        for i in self._subgroups:
            live = host.live(i)
            with q.on("compute"):
                step = host.advance(i)
                t_c = q.record("compute")
                self._adam.update(live.p, host.grad(i), live.m, live.v, host.half(i), inv, step, host.group(i),
                                  scalars.get(i))
                trace.append(("gpu", i, t_c, q.record("compute")))
