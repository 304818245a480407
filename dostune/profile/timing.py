"""Timing primitives shared by the profilers: host clocks for CPU work, CUDA events for GPU work."""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, Protocol

import torch

from ..stats import Stat


class ProgressSink(Protocol):
    """Where long measurements report progress. The CLI passes a rich progress bar."""

    def start(self, description: str, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...


class NullProgress:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


class LineProgress:
    """Progress as one line per phase on stderr (no refresh thread): for logs and for tools without the CLI's bar."""

    def start(self, description: str, total: int) -> None:
        print(description, file=sys.stderr, flush=True)

    def advance(self, n: int = 1) -> None:
        pass


def cpu_samples(fn: Callable[[], object], repeats: int, warmup: int = 1,
                progress: Optional[ProgressSink] = None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` on the host clock, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if progress:
            progress.advance()
    return samples


def time_cpu(fn: Callable[[], object], repeats: int, warmup: int = 1,
             progress: Optional[ProgressSink] = None) -> Stat:
    return Stat.of(cpu_samples(fn, repeats, warmup, progress))


def sync_device() -> None:
    """Wait for the CUDA device's queued work (nothing to wait for without one): a phase timed on the host clock
    between two of these counts its device work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run(name: str, fn: Callable[[], object]) -> object:
    return fn()


def iteration_phases(engine, batch: dict, sync: Callable[[], None] = sync_device, step: bool = True,
                     around: Callable[[str, Callable[[], object]], object] = _run
                     ) -> tuple[object, float, float, float]:
    """One micro-batch through a DeepSpeed ``engine``: forward, backward and (with ``step``) the optimizer step.
    Returns (loss, forward s, backward s, step s; 0 without ``step``), each phase on the host clock with ``sync()``
    (sync_device: the device's) at its ends, so a phase's queued device work counts in it. ``around(name, fn)``
    runs each phase: a caller's hook around it ("fwd", "bwd", "step"), such as bench's peak memory per phase. The
    training loop, the bench and the model profile's backward probes time their passes with it."""
    from ..models.registry import loss_of

    sync()
    t0 = time.perf_counter()
    loss = around("fwd", lambda: loss_of(engine(**batch)))
    sync()
    t1 = time.perf_counter()
    around("bwd", lambda: engine.backward(loss))
    sync()
    t2 = time.perf_counter()
    if not step:
        return loss, t1 - t0, t2 - t1, 0.0
    around("step", engine.step)
    sync()
    return loss, t1 - t0, t2 - t1, time.perf_counter() - t2


def time_cuda(fn: Callable[[], object], repeats: int, inner: int = 1, warmup: int = 1,
              stream: Optional[torch.cuda.Stream] = None, progress: Optional[ProgressSink] = None) -> Stat:
    """Median seconds of one call of ``fn``, timed with CUDA events around ``inner`` back-to-back calls,
    so that sub-millisecond operations are not dominated by event resolution."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(inner):
                fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
            if progress:
                progress.advance()
    return Stat.of(samples)


def inner_repeats(size_bytes: int, target_bytes: int = 256 << 20, cap: int = 64) -> int:
    """How many back-to-back copies make one timed sample of at least ``target_bytes``."""
    return max(1, min(cap, target_bytes // max(size_bytes, 1)))
