"""The state of each subgroup: DeepSpeed's fp32 params and DeepSpeedCPUAdam's exp_avg / exp_avg_sq, which every lane
reads and writes, and the buffers of the same shape (staging slots, shadows) that they are copied to and from.
Written once here; the lanes only say where from and where to.

DeepSpeed holds the state where its offload placement put it: in host memory for the subgroups it offloads, on the
GPU for the first ones with ``offload_optimizer.ratio`` below 1 (its Twin-Flow placement), which are dostune's
resident subgroups. Both are the tensors DeepSpeed's checkpoints and fp32 accessors read (the Adam states in
``optimizer.state[fp32 params]``), so there is one copy of each subgroup's state, wherever it lies."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch

if TYPE_CHECKING:
    from .device import Device


class Buffers(NamedTuple):
    """fp32 params, exp_avg and exp_avg_sq of one subgroup (or buffers for them)."""

    p: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor

    def head(self, n: int) -> "Buffers":
        """The first n elements of each (a subgroup in a wider staging slot)."""
        return Buffers(self.p[:n], self.m[:n], self.v[:n])

    def copy_from(self, src: "Buffers") -> None:
        """Queue the three copies on the current stream (asynchronous between pinned host and device memory)."""
        for dst, s in zip(self, src):
            dst.copy_(s, non_blocking=True)


def empty_buffers(n: int, device: Optional[torch.device] = None) -> Buffers:
    return Buffers(*(torch.empty(n, dtype=torch.float32, device=device) for _ in range(3)))


def pinned_buffers(i: int, n: int, pin: Callable, prefix: str) -> Buffers:
    """Host buffers of n elements for subgroup i, page-locked through ``pin`` under the keys (i, prefix + "_param"),
    ... so the lanes can copy into them asynchronously."""
    b = empty_buffers(n)
    for kind, t in zip(("param", "exp_avg", "exp_avg_sq"), b):
        pin((i, f"{prefix}_{kind}"), t)
    return b


class HostStates:
    """DeepSpeed's copies of every subgroup's state, those in host memory page-locked so that the lanes can copy
    them asynchronously, and the one place that swaps in new ones."""

    def __init__(self, opt, device: "Device", pins, released_grads: frozenset = frozenset()):
        self._opt, self._device, self._pins = opt, device, pins
        self.count = len(opt.fp16_groups)
        # subgroups whose fp32 gradient buffer was released (grads.GradRouting.release): no gradients of theirs to pin
        self._released_grads = released_grads

    def _fp32(self, i: int) -> torch.Tensor:
        return self._opt.fp32_partitioned_groups_flat[i]

    def _adam(self, i: int) -> dict:
        return self._opt.optimizer.state[self._fp32(i)]

    def numel(self, i: int) -> int:
        return int(self._opt.fp16_partitioned_groups_flat_numel[i])

    def live(self, i: int) -> Buffers:
        """The tensors DeepSpeed reads (checkpoints, its fp32 accessors) and DeepSpeedCPUAdam updates."""
        state = self._adam(i)
        return Buffers(self._fp32(i).data, state["exp_avg"], state["exp_avg_sq"])

    def grad(self, i: int) -> Optional[torch.Tensor]:
        """DeepSpeed's fp32 gradient buffer of the subgroup."""
        return self._fp32(i).grad

    def half(self, i: int) -> torch.Tensor:
        """The subgroup's half-precision ZeRO-3 partition on the device, which the forward pass reads."""
        return self._opt.fp16_partitioned_groups_flat[i]

    def group(self, i: int) -> dict:
        """The subgroup's optimizer param group (lr, betas, eps, weight_decay, bias_correction)."""
        return self._opt.optimizer.param_groups[self._opt.sub_group_to_group_id[i]]

    def step_count(self, i: int) -> int:
        """Adam steps the subgroup has taken (DeepSpeedCPUAdam's state["step"])."""
        return self._adam(i)["step"]

    def advance(self, i: int) -> int:
        """Count one more Adam step of subgroup i, as DeepSpeedCPUAdam.step does before its kernel call."""
        state = self._adam(i)
        state["step"] += 1
        return state["step"]

    def adopt(self, i: int) -> None:
        """Create Adam state up front, beside the fp32 params (DeepSpeedCPUAdam creates it lazily, pageable; a
        resident subgroup's is created on the GPU, where DeepSpeed built its params), and page-lock the subgroup's
        fp32 params, gradients and states where they are in host memory."""
        fp32 = self._fp32(i)
        state = self._adam(i)
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(fp32.data)
            state["exp_avg_sq"] = torch.zeros_like(fp32.data)
        grad = None if i in self._released_grads else fp32.grad
        for kind, t in (("param", fp32.data), ("grad", grad), ("exp_avg", state["exp_avg"]),
                        ("exp_avg_sq", state["exp_avg_sq"])):
            if t is not None:
                self._pins.pin((i, kind), t)

    def ensure_pinned(self, i: int) -> None:
        """Adopt subgroup i again if a checkpoint load replaced its states (unpinned host memory, or not created
        yet)."""
        state = self._adam(i)
        if not state or any(self._device.needs_pinning(t) for t in self.live(i)):
            self.adopt(i)

    def commit(self, i: int, new: Buffers) -> Buffers:
        """Make ``new`` subgroup i's state after one Adam step computed out of place (a buffer swap, no copy);
        returns the buffers it replaced, free for the next out-of-place update."""
        old = self.live(i)
        state = self._adam(i)
        self._fp32(i).data, state["exp_avg"], state["exp_avg_sq"] = new
        state["step"] += 1  # what DeepSpeedCPUAdam.step does before its kernel call
        return old
