"""Streams and events for the lanes, with the same interface on a CPU device (where work runs inline).

On a GPU the lanes use four streams so that independent work overlaps:
  ``h2d``     GPU-lane subgroups' fp32 state in (params, exp_avg, exp_avg_sq, grads)
  ``compute`` GPU-lane Adam and the fp32->half conversion into the ZeRO-3 partition
  ``d2h``     GPU-lane state back out to pinned host memory
  ``up``      CPU-lane results up to the GPU (fp32 then convert, or half precision)
Dependencies between them are CUDA events, so the whole GPU lane can be queued at once and the host
is free to run CPU Adam (which holds the GIL) while the copy engines and SMs work.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

STREAMS = ("h2d", "compute", "d2h", "up")


class Queues:
    def __init__(self, device: torch.device, timing: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self.timing = timing
        self.streams = {name: torch.cuda.Stream(device=device) for name in STREAMS} if self.cuda else {}

    def on(self, name: str):
        return torch.cuda.stream(self.streams[name]) if self.cuda else contextlib.nullcontext()

    def record(self, name: str, timing: Optional[bool] = None):
        """An event marking everything queued on ``name`` so far (a host timestamp on a CPU device)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=self.timing if timing is None else timing)
        ev.record(self.streams[name])
        return ev

    def record_current(self):
        """An event marking what the current stream has queued so far (a host timestamp on a CPU device)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record()
        return ev

    def drain(self) -> None:
        """Wait on the host until every lane stream is idle."""
        for s in self.streams.values():
            s.synchronize()

    def wait(self, name: str, event) -> None:
        if self.cuda and event is not None:
            self.streams[name].wait_event(event)

    def after_current(self) -> None:
        """Side streams start after what the default stream has queued (backward, grad reduction)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for s in self.streams.values():
                s.wait_stream(cur)

    def join(self) -> None:
        """The default stream continues after the lanes' GPU work, and the host after their copies back."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for name in ("compute", "up"):
                cur.wait_stream(self.streams[name])
            self.streams["d2h"].synchronize()
            self.streams["up"].synchronize()

    @staticmethod
    def elapsed(start, end) -> float:
        """Seconds between two records."""
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3
