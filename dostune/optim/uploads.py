"""How the CPU lane at the step sends each new fp32 result to the subgroup's half-precision partition on the device,
one subgroup after another (``begin`` with the widest, ``send`` each, ``end``). The device picks the form
(device.py ``cpu_lane_upload``); DeepSpeed's own copy (``deepspeed_upload``) is the fallback of every form."""
from __future__ import annotations

import time
from typing import Optional, Protocol

import torch

from .pressure import MemoryPressure
from .queues import Queues


class Upload(Protocol):
    def begin(self, width: int, dtype: torch.dtype) -> None: ...

    def send(self, k: int, i: int, src: torch.Tensor, dst: torch.Tensor, trace: list) -> None: ...

    def end(self) -> None: ...


def deepspeed_upload(i: int, src: torch.Tensor, dst: torch.Tensor, trace: list) -> None:
    """DeepSpeed's own copy of the new params into the half-precision partition: blocking, converted on the host
    (torch converts a blocking host-to-device copy there), so it needs no device memory."""
    t0 = time.perf_counter()
    dst.copy_(src)
    trace.append(("up", i, t0, time.perf_counter()))


class InlineUpload:
    """A CPU device: the half-precision partition is host memory, written directly."""

    def begin(self, width: int, dtype: torch.dtype) -> None:
        pass

    def send(self, k: int, i: int, src: torch.Tensor, dst: torch.Tensor, trace: list) -> None:
        dst.copy_(src)

    def end(self) -> None:
        pass


class Fp32Upload:
    """``gpu_convert``: the fp32 result goes up into a device buffer, converted there into the partition. A step
    whose buffer the device cannot give (GPU memory pressure) uploads with DeepSpeed's own copy instead."""

    def __init__(self, queues: Queues, device: torch.device, pressure: MemoryPressure):
        self._q, self._device, self._pressure = queues, device, pressure
        self._staging: Optional[torch.Tensor] = None

    def begin(self, width: int, dtype: torch.dtype) -> None:
        try:
            with self._q.on("up"):
                self._staging = torch.empty(width, device=self._device)
        except torch.OutOfMemoryError as e:
            self._staging = None
            self._pressure.upload_fell_back(width * 4, e)

    def send(self, k: int, i: int, src: torch.Tensor, dst: torch.Tensor, trace: list) -> None:
        if self._staging is None:
            deepspeed_upload(i, src, dst, trace)
            return
        q, n = self._q, src.numel()
        with q.on("up"):
            t_up = q.record("up")
            self._staging[:n].copy_(src, non_blocking=True)
            dst.copy_(self._staging[:n])
            trace.append(("up", i, t_up, q.record("up")))

    def end(self) -> None:
        self._q.sync("up")
        self._staging = None


class HalfUpload:
    """``cpu_convert``: converted on the CPU into one of two pinned buffers, which go up in half precision."""

    def __init__(self, queues: Queues):
        self._q = queues
        self._bufs: list[torch.Tensor] = []
        self._free: list = []

    def begin(self, width: int, dtype: torch.dtype) -> None:
        self._bufs = [self._q.device.host_empty(width, dtype) for _ in range(2)]
        self._free = [None, None]

    def send(self, k: int, i: int, src: torch.Tensor, dst: torch.Tensor, trace: list) -> None:
        q, n, b = self._q, src.numel(), k % 2
        q.device.wait_for(self._free[b])  # the previous upload from this pinned buffer is done
        self._bufs[b][:n].copy_(src)  # convert on the CPU
        with q.on("up"):
            t_up = q.record("up")
            dst.copy_(self._bufs[b][:n], non_blocking=True)
            self._free[b] = q.record("up")
            trace.append(("up", i, t_up, self._free[b]))

    def end(self) -> None:
        self._bufs, self._free = [], []
