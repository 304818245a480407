"""The lanes' streams, on the device the optimizer runs on (device.py; on a CPU device, work runs inline).

On a GPU the lanes use four streams so that independent work overlaps:
  ``h2d``     GPU-lane subgroups' fp32 state in (params, exp_avg, exp_avg_sq, grads)
  ``compute`` GPU-lane Adam and the fp32->half conversion into the ZeRO-3 partition
  ``d2h``     GPU-lane state back out to pinned host memory
  ``up``      CPU-lane results up to the GPU (fp32 then convert, or half precision)
Dependencies between them are CUDA events, so the whole GPU lane can be queued at once and the host
is free to run CPU Adam (which holds the GIL) while the copy engines and SMs work.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .device import Device

STREAMS = ("h2d", "compute", "d2h", "up")


class Queues:
    def __init__(self, device: "Device", timing: bool = False):
        self.device = device
        self.timing = timing
        self.streams = {name: device.new_stream() for name in STREAMS}

    def on(self, name: str):
        return self.device.on(self.streams[name])

    def record(self, name: str, timing: Optional[bool] = None):
        """A mark of everything queued on ``name`` so far (a host timestamp on a CPU device)."""
        return self.device.record(self.streams[name], self.timing if timing is None else timing)

    def record_current(self):
        """A mark of what the current stream has queued so far (a host timestamp on a CPU device)."""
        return self.device.record_current(self.timing)

    def sync(self, name: str) -> None:
        """Wait on the host until ``name`` is idle."""
        self.device.synchronize(self.streams[name])

    def drain(self) -> None:
        """Wait on the host until every lane stream is idle."""
        for name in STREAMS:
            self.sync(name)

    def wait(self, name: str, mark) -> None:
        """``name`` runs what is queued on it next after ``mark`` (None: at once)."""
        self.device.wait(self.streams[name], mark)

    def after_current(self) -> None:
        """Side streams start after what the default stream has queued (backward, grad reduction)."""
        self.device.streams_follow_current(self.streams.values())

    def join(self) -> None:
        """The default stream continues after the lanes' GPU work, and the host after their copies back."""
        self.device.current_follows([self.streams["compute"], self.streams["up"]])
        self.sync("d2h")
        self.sync("up")
