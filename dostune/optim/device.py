"""The device the lanes run on, chosen once when the optimizer is built (``pick_device``): every object that queues
work, waits for it, page-locks host memory or allocates device memory asks this object instead of asking which
device it runs on.

* ``CudaDevice``: work is queued on CUDA streams and ordered by CUDA events, so the host is free while the copy
  engines and SMs work; host memory the copies read or write is page-locked (asynchronous copies need it); the GPU
  lane's Adam is the Triton kernel.
* ``CpuDevice``: a CPU device (the parity tests and the CPU gate run the GPU lane on it, through the same schedule,
  buffers and hand-offs). There are no streams: work runs inline, in queueing order, so every wait is already
  satisfied and every mark is the host time at which the work was queued; nothing is page-locked (no copy crosses a
  bus); the GPU lane's Adam is DeepSpeed's own C++ kernel.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterable, Optional, Protocol

import torch
from deepspeed.accelerator import get_accelerator

from .kernels import CpuOpAdam, LaneAdam, TritonAdam
from .pinned import NoPins, PinRegistry
from .uploads import Fp32Upload, HalfUpload, InlineUpload, Upload


class Device(Protocol):
    """What the lanes need of a device. A "stream" is what ``new_stream`` returns; a "mark" is what ``record`` returns
    (a CUDA event, or the host time on a CPU device); None where a mark is taken means "nothing to wait for"."""

    torch_device: torch.device

    def new_stream(self, priority: int = 0): ...

    def on(self, stream): ...  # a context: work queued inside runs on ``stream``

    def record(self, stream, timing: bool): ...

    def record_current(self, timing: bool): ...

    def wait(self, stream, mark) -> None: ...  # ``stream`` runs what is queued next after ``mark``

    def streams_follow_current(self, streams: Iterable) -> None: ...

    def current_follows(self, streams: Iterable) -> None: ...

    def synchronize(self, stream) -> None: ...  # the host waits until ``stream`` is idle

    def wait_for(self, mark) -> None: ...  # the host waits until ``mark`` is reached

    def start_clock(self) -> Optional[tuple]: ...

    def enter_thread(self) -> None: ...

    def host_empty(self, n: int, dtype: torch.dtype) -> torch.Tensor: ...

    def copy_to_host(self, t: torch.Tensor) -> tuple: ...

    def needs_pinning(self, t: torch.Tensor) -> bool: ...

    def pin_registry(self): ...

    def free_bytes(self) -> Optional[int]: ...

    def lane_adam(self, beta1: float, beta2: float, lr: float, eps: float, weight_decay: float,
                  adamw: bool) -> LaneAdam: ...

    def cpu_lane_upload(self, upload: str, queues, pressure) -> Upload: ...


class CudaDevice:
    def __init__(self, torch_device: torch.device):
        self.torch_device = torch_device

    # ------------------------------------------------------------- streams and events
    def new_stream(self, priority: int = 0):
        return torch.cuda.Stream(device=self.torch_device, priority=priority)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def record(self, stream, timing: bool):
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def record_current(self, timing: bool):
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record()
        return ev

    def wait(self, stream, mark) -> None:
        if mark is not None:
            stream.wait_event(mark)

    def streams_follow_current(self, streams: Iterable) -> None:
        cur = torch.cuda.current_stream(self.torch_device)
        for s in streams:
            s.wait_stream(cur)

    def current_follows(self, streams: Iterable) -> None:
        cur = torch.cuda.current_stream(self.torch_device)
        for s in streams:
            cur.wait_stream(s)

    def synchronize(self, stream) -> None:
        stream.synchronize()

    def wait_for(self, mark) -> None:
        if mark is not None:
            mark.synchronize()

    def start_clock(self) -> Optional[tuple]:
        """(a timing event on the current stream, the host time it was queued at): device times are measured from it.
        Called when the GPU has caught up with the host, so the event runs at about that host time."""
        origin = (torch.cuda.Event(enable_timing=True), time.perf_counter())
        origin[0].record()
        return origin

    def enter_thread(self) -> None:
        """A new host thread starts on device 0; each rank's threads must use its rank's GPU."""
        torch.cuda.set_device(self.torch_device)

    # ------------------------------------------------------------- memory
    def host_empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory that copies to and from the device can use asynchronously (page-locked)."""
        return torch.empty(n, dtype=dtype, pin_memory=True)

    def copy_to_host(self, t: torch.Tensor) -> tuple:
        """(a page-locked host copy of ``t``, the event after which it holds ``t``'s value), queued on the current
        stream behind the work that makes ``t``."""
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def needs_pinning(self, t: torch.Tensor) -> bool:
        """Host memory not page-locked yet (device memory, e.g. a resident subgroup's state, needs none)."""
        return t.device.type == "cpu" and not t.is_pinned()

    def pin_registry(self) -> PinRegistry:
        return PinRegistry()

    def free_bytes(self) -> Optional[int]:
        """Device memory not yet allocated by this process."""
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
            - torch.cuda.memory_allocated()

    # ------------------------------------------------------------- the lanes' device-dependent parts
    def lane_adam(self, beta1: float, beta2: float, lr: float, eps: float, weight_decay: float,
                  adamw: bool) -> LaneAdam:
        return TritonAdam(beta1, beta2, adamw)

    def cpu_lane_upload(self, upload: str, queues, pressure) -> Upload:
        if upload == "gpu_convert":
            return Fp32Upload(queues, self.torch_device, pressure)
        return HalfUpload(queues)


class CpuDevice:
    def __init__(self, torch_device: torch.device):
        self.torch_device = torch_device

    def new_stream(self, priority: int = 0):
        return None

    def on(self, stream):
        return contextlib.nullcontext()

    def record(self, stream, timing: bool):
        return time.perf_counter()

    def record_current(self, timing: bool):
        return time.perf_counter()

    def wait(self, stream, mark) -> None:
        pass

    def streams_follow_current(self, streams: Iterable) -> None:
        pass

    def current_follows(self, streams: Iterable) -> None:
        pass

    def synchronize(self, stream) -> None:
        pass

    def wait_for(self, mark) -> None:
        pass

    def start_clock(self) -> Optional[tuple]:
        """None: the lanes' work is timed by the host spans alone, and adaptive_swing, which needs the device's own
        timing, keeps the tuned split."""
        return None

    def enter_thread(self) -> None:
        pass

    def host_empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype)

    def copy_to_host(self, t: torch.Tensor) -> tuple:
        return t.clone(), None

    def needs_pinning(self, t: torch.Tensor) -> bool:
        return False

    def pin_registry(self) -> NoPins:
        return NoPins()

    def free_bytes(self) -> Optional[int]:
        """None: a CPU device has no memory of its own to check the step's staging against."""
        return None

    def lane_adam(self, beta1: float, beta2: float, lr: float, eps: float, weight_decay: float,
                  adamw: bool) -> LaneAdam:
        return CpuOpAdam(beta1, beta2, lr, eps, weight_decay, adamw)

    def cpu_lane_upload(self, upload: str, queues, pressure) -> Upload:
        """The half-precision partition is host memory, written directly, whichever upload the schedule names."""
        return InlineUpload()


def pick_device() -> Device:
    """The device of this rank, as DeepSpeed's accelerator names it: CUDA, or one without CUDA streams (the CPU)."""
    torch_device = torch.device(get_accelerator().current_device_name())
    return CudaDevice(torch_device) if torch_device.type == "cuda" else CpuDevice(torch_device)
