"""Where each subgroup's gradients go at the end of backward, and where DeepSpeed's gradient accessors then find
them.

DeepSpeed copies every offloaded subgroup's gradient partition into its fp32 host buffer. Two kinds of subgroup
keep them elsewhere instead, decided per subgroup whenever the lanes are planned (not per call):

* GPU-lane subgroups with ``grads_on_gpu``: the partition is widened into a buffer on the device ("device"), so the
  GPU lane does not stream it back in (not those adaptive_swing lent from the CPU lane: DeepSpeed's offload takes
  theirs, and the GPU lane streams them in with the states);
* resident subgroups: DeepSpeed's fp32 buffer itself is on the device (its Twin-Flow placement), so the partition
  is widened into it there, without DeepSpeed's temporary, and its accessors find it where they look;
* CPU-lane subgroups updated during backward: the CPU lane reads the half-precision copy DeepSpeed's
  ``partition_grads`` already put in its pinned gradient-partition buffer ("half"), so DeepSpeed's fp32 conversion
  and second copy to host memory (4 bytes per element over PCIe during backward) are skipped. Their fp32 buffers
  are freed at start-up (``release``): lent to the GPU lane by a swing, they stream in from the half-precision
  copy too, and an update on the host outside the lane widens it first (``to_host``).

Either way the gradient norm is recorded as DeepSpeed records it (see norms.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..errors import ConfigError
from .norms import GradNorms
from .schedule import Plan, kept_gradients

if TYPE_CHECKING:
    from .device import Device


def _gradient_slices(opt) -> dict[int, tuple[int, int]]:
    """Subgroup -> (start, length) in ``grad_partitions_flat_buffer``, which DeepSpeed fills with every parameter's
    gradient partition in parameter order; {} unless each subgroup's part of it has exactly the layout of its fp32
    partition (then the gradients can be read there without an fp32 copy)."""
    buf = getattr(opt, "grad_partitions_flat_buffer", None)
    if buf is None or buf.device.type != "cpu":
        return {}
    out, pos = {}, 0
    for i, group in enumerate(opt.fp16_groups):
        start = pos
        for p in group:
            n = p.partition_numel()
            pid = opt.get_param_id(p)
            if n and pid in opt.grad_position and (opt.grad_position[pid][0] != i
                                                   or opt.grad_position[pid][1] != pos - start):
                return {}
            pos += n
        if pos - start != int(opt.fp16_partitioned_groups_flat_numel[i]):
            return {}
        out[i] = (start, pos - start)
    return out if pos == buf.numel() else {}


class GradRouting:
    def __init__(self, opt, norms: GradNorms, device: "Device", grads_on_gpu: bool):
        self._opt, self._norms, self._dev = opt, norms, device
        self._grads_on_gpu = grads_on_gpu
        # Where each subgroup's gradients lie in DeepSpeed's pinned gradient-partition buffer (start, length), when
        # the layout there is the subgroup's own (checked at start-up): the CPU lane during backward reads them there.
        self.slices = _gradient_slices(opt)
        self.device: dict[int, torch.Tensor] = {}  # the GPU-lane subgroups' kept gradients, fp32 on the device
        # Subgroups whose gradients this backward did not write to DeepSpeed's fp32 gradient buffer, and where they
        # are instead: "device" or "half". DeepSpeed's gradient accessors read them there until the step.
        self.home: dict[int, str] = {}
        n = len(opt.fp16_groups)
        # None: DeepSpeed's own offload; else a method that keeps the gradient elsewhere (False: it could not)
        self._keep: list[Optional[Callable]] = [None] * n
        self._final: list[Optional[Callable]] = [None] * n  # told each parameter whose gradient is final
        self._skip_host_copy: frozenset = frozenset()
        # Subgroups whose device buffer could not be allocated in this backward (GPU memory pressure): DeepSpeed's
        # own offload took their gradients instead, and the step updates them on the host (step.py).
        self.lost: set = set()
        # Subgroups with no fp32 host gradient buffer (release): their gradients are in the half-precision buffer only.
        self.released: frozenset = frozenset()
        self._placeholder: dict[int, torch.Tensor] = {}  # each released subgroup's .grad
        self._widened: set = set()  # released subgroups given a transient fp32 buffer for this step (to_host)

    def release(self, subgroups: frozenset) -> frozenset:
        """Free DeepSpeed's fp32 host gradient buffer of each of ``subgroups`` (schedule.host_half_gradients) whose
        half-precision copy can be read in place, before any of it is pinned; returns those released. Each keeps, as
        its ``.grad``, a zero-stride view of one zero: DeepSpeed's accessors read zeros from it (the value its fresh
        buffer holds before a backward) and any write to it fails loudly rather than going nowhere."""
        opt = self._opt
        released = frozenset(i for i in subgroups if i in self.slices)
        for i in released:
            fp32 = opt.fp32_partitioned_groups_flat[i]
            zero = torch.zeros(1, dtype=fp32.dtype, device=fp32.device)
            self._placeholder[i] = fp32.grad = zero.expand(fp32.numel())
        self.released = released
        return released

    def param_ids(self, i: int) -> frozenset:
        """Subgroup i's parameters that hold data on this rank: the same test DeepSpeed's partition_grads applies
        (a parameter whose partition on this rank is empty never reaches the boundary hook)."""
        opt = self._opt
        return frozenset(opt.get_param_id(p) for p in opt.fp16_groups[i]
                         if p.partition_numel() * opt._get_param_partition_rank(p) < p.ds_numel)

    def streamed_grad(self, i: int) -> torch.Tensor:
        """Where the GPU lane streams subgroup i's gradients in from: DeepSpeed's fp32 host buffer, or for a released
        subgroup its half-precision copy (widened on the way, to the same values)."""
        return self.host_grad(i) if i in self.released else self._opt.fp32_partitioned_groups_flat[i].grad

    def host_grad(self, i: int) -> torch.Tensor:
        """Subgroup i's gradients on the host as the CPU lane reads them during backward: DeepSpeed's pinned
        half-precision copy when its layout allows, else DeepSpeed's fp32 buffer."""
        sl = self.slices.get(i)
        if sl is None:
            return self._opt.fp32_partitioned_groups_flat[i].grad
        return self._opt.grad_partitions_flat_buffer.narrow(0, *sl)

    def set_plan(self, plan: Plan, in_backward: frozenset, on_final: Callable[[int, int], None]) -> None:
        """Route each subgroup for the lanes of ``plan``; ``in_backward``: the subgroups the CPU lane updates during
        backward, whose ``on_final(subgroup, parameter id)`` is called as each of their gradients is final."""
        kept = kept_gradients(plan, self._grads_on_gpu)  # a lent subgroup's are offloaded as the CPU lane's are
        resident = frozenset(plan.resident)
        for i in range(len(self._keep)):
            self._keep[i] = self._keep_device if i in kept else None
            if i in resident:
                self._keep[i] = self._keep_in_place
            self._final[i] = None
            if i in in_backward:
                self._keep[i] = self._keep_half if i in self.slices else None
                self._final[i] = on_final
            elif i in self.released:  # lent to the GPU lane, which streams them in from the half-precision copy
                self._keep[i] = self._keep_half
        # Only fp16's overflow check reads the host copy of a GPU-lane subgroup's gradients (the GPU lane keeps its
        # own on the device): otherwise it is not made, which takes those copies (the last of backward, as the
        # GPU lane holds the first layers) off the stream backward's end waits for.
        kept = kept | resident
        self._skip_host_copy = kept if self._opt.dtype != torch.float16 else frozenset()

    def clear(self) -> None:
        """After the step (or a skipped one): the kept gradients are spent, and the next backward tries the device
        again for the subgroups that lost theirs."""
        self.device.clear()
        self.home.clear()
        for i in self._widened:
            self._opt.fp32_partitioned_groups_flat[i].grad = self._placeholder[i]
        self._widened.clear()
        for i in self.lost:
            self._keep[i] = self._keep_device
        self.lost.clear()

    def reserve(self, subgroups) -> None:
        """Before the step queues any GPU-lane work: a device buffer for each of ``subgroups`` whose gradients are
        kept on the device but which no gradient reached in this backward (e.g. unused parameters), holding zeros,
        DeepSpeed's gradient then; so the GPU lane allocates none while it queues. One the device cannot give is
        lost, its zeros written to DeepSpeed's buffer instead."""
        for i in subgroups:
            if self._keep[i] == self._keep_device and i not in self.device:
                try:
                    self.device[i] = self._device_buffer(i)
                except torch.OutOfMemoryError:
                    self._lose(i)
                    self._opt.fp32_partitioned_groups_flat[i].grad.zero_()

    def _lose(self, i: int) -> None:
        self._keep[i] = None  # DeepSpeed's own offload for the rest of this backward
        self.lost.add(i)

    def to_host(self, i: int) -> None:
        """Put GPU-lane subgroup i's gradients where an update on the host reads them, DeepSpeed's fp32 buffer, with
        the values its own offload writes there: the kept buffer holds the partition widened to fp32 (exact), so
        it is copied as it is. A released subgroup (one lent to the GPU lane) gets a transient fp32 buffer holding
        its half-precision gradients widened, until ``clear``. A no-op when DeepSpeed's offload filled that buffer
        already."""
        if i in self.released:
            self._dev.synchronize(self._opt.reduce_and_partition_stream)
            self._opt.fp32_partitioned_groups_flat[i].grad = self.host_grad(i).float()
            self._widened.add(i)
            return
        if self._keep[i] != self._keep_device:
            return
        buf = self.device.pop(i)
        self.home.pop(i, None)
        self._dev.synchronize(self._opt.reduce_and_partition_stream)
        self._opt.fp32_partitioned_groups_flat[i].grad.copy_(buf)

    # ------------------------------------------------------------- in backward
    def at_boundary(self, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets) -> None:
        """DeepSpeed's _offload_grad_partition_at_boundary, for one parameter whose gradient partition is final."""
        opt = self._opt
        pid = opt.get_param_id(param)
        i, dest_offset, _ = opt.grad_position[pid]
        keep = self._keep[i]
        if keep is None or not keep(i, pid, dest_offset, grad_buffer):
            DeepSpeedZeroOptimizer_Stage3._offload_grad_partition_at_boundary(
                opt, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets)
        final = self._final[i]
        if final is not None:
            final(i, pid)

    def _keep_half(self, i: int, pid: int, dest_offset: int, grad: torch.Tensor) -> bool:
        self._norms.record(pid, grad)
        self.home[i] = "half"
        return True

    def _device_buffer(self, i: int) -> torch.Tensor:
        return torch.zeros(self._opt.fp16_partitioned_groups_flat_numel[i], dtype=torch.float32,
                           device=self._dev.torch_device)

    def _keep_device(self, i: int, pid: int, dest_offset: int, grad: torch.Tensor) -> bool:
        """Keep the gradient in subgroup i's device buffer; False when that buffer cannot be allocated (its first
        parameter's, so none of the subgroup's gradients is there yet)."""
        buf = self.device.get(i)
        if buf is None:
            try:
                buf = self.device[i] = self._device_buffer(i)
            except torch.OutOfMemoryError:
                self._lose(i)
                return False
        self._norms.record(pid, grad)
        self.home[i] = "device"
        # One widening kernel straight into the buffer, without .to(fp32)'s temporary; bf16/fp16 -> fp32 is exact.
        buf.narrow(0, dest_offset, grad.numel()).copy_(grad, non_blocking=True)
        return True

    def _keep_in_place(self, i: int, pid: int, dest_offset: int, grad: torch.Tensor) -> bool:
        """Write the gradient into DeepSpeed's own fp32 buffer of a resident subgroup, which lies on the device:
        what DeepSpeed's offload writes there, with one widening kernel and dostune's norm record."""
        self._norms.record(pid, grad)
        fp32_grad = self._opt.fp32_partitioned_groups_flat[i].grad
        fp32_grad.narrow(0, dest_offset, grad.numel()).copy_(grad, non_blocking=True)
        return True

    def partition(self, params_to_release, grad_partitions) -> Optional[list]:
        """DeepSpeed's partition_grads in the common case (a boundary micro-step that does not accumulate; None
        otherwise). DeepSpeed copies each gradient partition into its pinned host buffer, then copies that back to
        the GPU "to speed up the next operations" and hands the copy on. The copy back is bitwise the partition it
        came from, so here the partition itself is handed on: 2 bytes per element less over PCIe during backward.
        The host copy stays (DeepSpeed's overflow check and the CPU lane read it)."""
        opt = self._opt
        if not self.slices or opt.micro_step_id != 0 or not opt.is_gradient_accumulation_boundary():
            return None
        buffers = []
        for param, grad_partition in zip(params_to_release, grad_partitions):
            if not param.partition_numel() * opt._get_param_partition_rank(param) < param.ds_numel:
                param.grad = None  # this rank's partition is empty
                continue
            opt._offload_boundary_param_ids.add(param.ds_id)
            i, dest_offset, _ = opt.grad_position[opt.get_param_id(param)]
            grad_buffer = opt.grad_partitions_flat_buffer.narrow(0, self.slices[i][0] + dest_offset,
                                                                 grad_partition.numel())
            buffers.append(grad_buffer)
            if i not in self._skip_host_copy:
                grad_buffer.copy_(grad_partition, non_blocking=True)
            self.at_boundary(param, grad_partition, {}, {})
            if not get_accelerator().is_synchronized_device() and param.grad is not None:
                param.grad.record_stream(get_accelerator().current_stream())
            param.grad = None
        return buffers

    # ------------------------------------------------- DeepSpeed's accessors
    def fp32_partition(self, param) -> Optional[tuple]:
        """(fp32 gradient partition, subgroup) of a parameter whose gradients are kept elsewhere (None: DeepSpeed's
        buffer holds them). A device gradient is a view (a setter writes what the GPU lane will use); a
        half-precision one is widened to fp32, the values DeepSpeed's buffer would hold."""
        opt = self._opt
        i, dest_offset, n = opt.grad_position[opt.get_param_id(param)]
        home = self.home.get(i)
        if home is None:
            return None
        self._dev.synchronize(opt.reduce_and_partition_stream)
        if home == "device":
            return self.device[i].narrow(0, dest_offset, n), i
        return opt.grad_partitions_flat_buffer.narrow(0, self.slices[i][0] + dest_offset, n).float(), i

    def _subgroup(self, param) -> int:
        return self._opt.grad_position[self._opt.get_param_id(param)][0]

    def check_writable(self, param) -> None:
        """Refuse to change a gradient that an update started during backward has already read."""
        if not param.requires_grad:
            return
        i = self._subgroup(param)
        if self.home.get(i) == "half" or i in self.released:
            raise ConfigError(
                f"dostune: the gradient of subgroup {i} cannot be changed between backward and step: with "
                f"overlap_backward its update already started during backward. Set \"overlap_backward\": false "
                f"in the dostune section to modify gradients before the step.")

    def fill_partitions(self, grads: list) -> list:
        """DeepSpeed's get_fp32_grad_partitions result with the subgroups kept elsewhere read where they are."""
        if self.home:
            for i, group in enumerate(self._opt.fp16_groups):
                if i in self.home:
                    for j, p in enumerate(group):
                        grads[i][j] = self.fp32_partition(p)[0]
        return grads

    def refuse_vectorized_update(self, param_list) -> None:
        """DeepSpeed's update_fp32_grad_for_param_vectorized rewrites the fp32 gradient buffers directly, which the
        lanes do not read for the subgroups kept elsewhere: refused for those rather than silently ignored."""
        if any(p.requires_grad and self._subgroup(p) in self.home for p in param_list):
            raise ConfigError("dostune: update_fp32_grad_for_param_vectorized is not supported for subgroups on the "
                              "GPU lane or updated during backward; use safe_set_full_grad / safe_set_local_grad")
