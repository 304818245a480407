"""Page-locked copies both ways between host memory and a GPU, queued ahead so that they stream while the host works:
the load two profile probes put under a CPU update, DeepSpeed's CPU Adam in the node profile (throughput.py) and
dostune's CPU lane in the model profile (step_lane.py).

Neither update leaves a thread free to feed copies (DeepSpeed's CPU Adam holds the GIL; the lane's kernel uses every
core it is given), and the DMA engines need none: enough chunks to outlast the update are queued on two streams before
it starts, and events at each chunk's end say afterwards when each direction moved what.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

# the rate the queue is sized for: generous for one direction of a PCIe 5 x16 link, so the copies outlast the work
QUEUE_GBPS = 60.0


@dataclass
class QueuedCopies:
    """One queue of copies: when it was queued on the host clock, and its events."""

    device: torch.device
    t_queue: float  # perf_counter just before the queue's start events (the GPU was idle: copies start as queued)
    _starts: tuple[torch.cuda.Event, torch.cuda.Event]
    _ends: tuple[list[torch.cuda.Event], list[torch.cuda.Event]]

    def chunk_ends(self) -> tuple[list[float], list[float]]:
        """Each direction's chunk end times (host-to-device, device-to-host), in seconds from the queue's start.
        Waits for the copies to finish."""
        torch.cuda.synchronize(self.device)
        return tuple([start.elapsed_time(e) / 1e3 for e in ends] for start, ends in zip(self._starts, self._ends))


class DuplexCopies:
    """Page-locked buffers on the host and buffers on GPU ``device`` for copies of ``chunk_bytes`` each way, with a
    stream per direction. ``host_chunks`` > 1 rotates each direction's chunks through that many host chunks, so that a
    host buffer larger than the last-level cache makes the DMA engines read and write memory, as they do the GPU lane's
    states."""

    def __init__(self, device: torch.device, chunk_bytes: int, host_chunks: int = 1):
        self.device, self.chunk_bytes, self.host_chunks = device, chunk_bytes, host_chunks
        self.host_up = torch.empty(host_chunks * chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.host_down = torch.empty(host_chunks * chunk_bytes, dtype=torch.uint8, pin_memory=True)
        self.dev_up = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
        self.dev_down = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
        self.up, self.down = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)

    def queue(self, seconds: float) -> QueuedCopies:
        """Enough chunks each way to stream for about three times ``seconds`` at QUEUE_GBPS (at least four), queued
        on an idle GPU."""
        n = max(4, math.ceil(3 * seconds * QUEUE_GBPS * 1e9 / self.chunk_bytes))
        torch.cuda.synchronize(self.device)

        def event() -> torch.cuda.Event:
            return torch.cuda.Event(enable_timing=True)

        starts, ends = (event(), event()), ([], [])
        with torch.cuda.device(self.device):
            t_queue = time.perf_counter()
            for stream, start in zip((self.up, self.down), starts):
                start.record(stream)
            for k in range(n):
                chunk = slice((k % self.host_chunks) * self.chunk_bytes, (k % self.host_chunks + 1) * self.chunk_bytes)
                with torch.cuda.stream(self.up):
                    self.dev_up.copy_(self.host_up[chunk], non_blocking=True)
                    ends[0].append(event())
                    ends[0][-1].record(self.up)
                with torch.cuda.stream(self.down):
                    self.host_down[chunk].copy_(self.dev_down, non_blocking=True)
                    ends[1].append(event())
                    ends[1][-1].record(self.down)
        return QueuedCopies(self.device, t_queue, starts, ends)
