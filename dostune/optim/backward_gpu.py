"""The GPU lane during backward (``backward_gpu_subgroups``): bookkeeping of one iteration.

With ``overlap_backward`` the CPU lane already runs under backward; what is left for the step is the GPU
lane, whose PCIe transfers (12 bytes per element each way) are then the step's critical path. Its first
subgroups in backward order (the highest indices: backward runs from the last layer to the first) can
move under backward too:

* staging: a subgroup's fp32 params and Adam states do not depend on this step's gradients, so they stream
  into a staging slot as soon as one is free (a new slot is allocated only once backward has freed as much
  memory as it takes, so the iteration's peak does not rise);
* launch: once the boundary hook has seen the subgroup's last gradient, the fused Adam runs on the kept
  gradients with the factor of a step without clipping, writes the half-precision partition, and the
  new fp32 state streams back into *host shadow buffers* (the live state is untouched);
* at the step, exactly as for the CPU lane: no clipping and a valid norm -> the shadows are swapped in;
  clipping -> those subgroups are updated again by the step's GPU lane from the live state; skipped step
  -> the half-precision partitions are restored from the live fp32 params. Subgroups staged but not yet
  launched keep their slot and the step runs them without copying their states again.

Launching follows the order strictly (a subgroup whose gradients are late holds back the ones after it):
slots are filled in that order, and a slot is only refilled once its previous subgroup's write-back is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .overlap import Buffers


@dataclass
class Staged:
    slot: int
    h2d_start: object  # CUDA event (host time on a CPU device)
    h2d_done: object


@dataclass
class GpuBackward:
    order: list[int]  # the subgroups this lane may update during backward, in the order they become final
    pids: dict[int, frozenset]  # parameter ids of each (those with data on this rank)
    shadows: dict[int, Buffers]  # host buffers the speculative results stream into
    seen: dict[int, set] = field(default_factory=dict)
    ready: dict[int, object] = field(default_factory=dict)  # subgroup -> event after its last gradient copy
    staged: dict[int, Staged] = field(default_factory=dict)
    launched: list[int] = field(default_factory=list)
    spec_inv: Optional[float] = None  # the unscale factor the launched updates assumed
    scalars: Optional[dict] = None  # this step's Adam constants, fixed at the first launch
    stopped: bool = False  # clipping became certain: launch nothing more this backward
    trace: list = field(default_factory=list)
    stats: dict = field(default_factory=lambda: {"speculative": 0, "committed": 0, "redone": 0})

    def __post_init__(self) -> None:
        self.seen = {i: set() for i in self.order}

    def grad_final(self, i: int, pid: int) -> bool:
        """Record one finalised parameter of subgroup i; True when it was the subgroup's last."""
        seen = self.seen.get(i)
        if seen is None or i in self.ready:
            return False
        seen.add(pid)
        return len(seen) == len(self.pids[i])

    def next_to_stage(self) -> Optional[int]:
        return next((i for i in self.order if i not in self.staged), None)

    def next_to_launch(self) -> Optional[int]:
        """The next subgroup in order that is staged and not launched, if its gradients are final."""
        for i in self.order:
            if i in self.launched:
                continue
            return i if (i in self.staged and i in self.ready and not self.stopped) else None
        return None

    def waiting_in_slot(self, slot: int) -> bool:
        """A staged subgroup not launched yet holds this slot: it must not be refilled."""
        return any(s.slot == slot and i not in self.launched for i, s in self.staged.items())

    def unlaunched_staged(self) -> list[int]:
        return [i for i in self.order if i in self.staged and i not in self.launched]

    def reset(self) -> None:
        for seen in self.seen.values():
            seen.clear()
        self.ready.clear()
        self.staged.clear()
        self.launched.clear()
        self.spec_inv = None
        self.scalars = None
        self.stopped = False
        self.trace = []
