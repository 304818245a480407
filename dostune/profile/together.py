"""The ranks of one node measured at once: CPU Adam in several processes, and several GPUs copying together.

Under DeepSpeed's launcher one node runs one process per GPU, and the processes reach the optimizer step at the
same moment (the step's collectives line them up). Their CPU Adam teams then share the host's memory bandwidth,
and their copies share PCIe switches and the host's root complex. Measured one at a time, each looks faster than it
will run; these measurements put them side by side, and keep the slowest participant's time (the step waits for
the slowest rank).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Optional, Sequence

import torch

from ..errors import DostuneError
from ..stats import Stat
from .record import PinnedCopies, Sample, Series, fit_series
from .timing import NullProgress, ProgressSink, inner_repeats

# how long a CPU Adam process may wait for the others at a barrier before the measurement is given up
_BARRIER_S = 600.0


def _adam_process(conn, barrier, sizes: list[int], threads: int, repeats: int) -> None:
    """One process of the CPU Adam measurement: its own DeepSpeedCPUAdam and OpenMP team of ``threads``."""
    try:
        from .throughput import CpuAdamBench

        torch.set_num_threads(threads)
        bench = CpuAdamBench(max(sizes))
        times = []
        try:
            barrier.wait(_BARRIER_S)  # every process built and allocated: start together
            for n in sizes:
                row = []
                for _ in range(repeats + 1):  # the first round warms up
                    barrier.wait(_BARRIER_S)
                    t0 = time.perf_counter()
                    bench.step(n)
                    row.append(time.perf_counter() - t0)
                times.append(row[1:])
        finally:
            bench.close()
        conn.send(("ok", times))
    except BaseException as e:  # reported to the parent, which names it
        barrier.abort()
        conn.send(("error", f"{type(e).__name__}: {e}"[:500]))
    finally:
        conn.close()


def measure_cpu_adam_concurrent(sizes: Sequence[int], processes: int, threads: int, repeats: int,
                                progress: Optional[ProgressSink] = None) -> Series:
    """DeepSpeedCPUAdam in ``processes`` processes at once, ``threads`` OpenMP threads each, started together at
    every repeat: the slowest process's time per size (elements). Processes, not threads of one process: the op
    holds the GIL while it runs."""
    progress = progress or NullProgress()
    if processes < 2:
        raise ValueError("a concurrent measurement needs at least 2 processes")
    progress.start(f"DeepSpeedCPUAdam in {processes} processes at once ({threads} threads each)", 1)
    ctx = mp.get_context("spawn")  # a fork would inherit this process's OpenMP and CUDA state
    barrier = ctx.Barrier(processes)
    pipes, procs = [], []
    for k in range(processes):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_adam_process, args=(send, barrier, list(sizes), threads, repeats),
                        name=f"dostune-cpu-adam-{k}")
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    results, errors = [], []
    try:
        for recv, p in zip(pipes, procs):
            try:
                kind, payload = recv.recv()
            except EOFError:
                kind, payload = "error", f"exited with code {p.join(5) or p.exitcode} without a result"
            (results if kind == "ok" else errors).append(payload)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise DostuneError(f"CPU Adam in {processes} processes at once failed: {errors[0]}")
    progress.advance()
    points = []
    for i, n in enumerate(sizes):
        slowest = [max(r[i][rep] for r in results) for rep in range(repeats)]
        points.append(Sample(size=n, threads=threads, seconds=Stat.of(slowest)))
    return fit_series("elements", points)


class _DeviceBuffers:
    """One GPU's buffers for the copy tests: pinned host source and destination, device source and destination."""

    def __init__(self, device: int, size: int):
        self.device = torch.device("cuda", device)
        self.host_src = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
        self.host_dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.dev_src = torch.ones(size, dtype=torch.uint8, device=self.device)
        self.dev_dst = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.up = torch.cuda.Stream(device=self.device)
        self.down = torch.cuda.Stream(device=self.device)


def _copy(b: _DeviceBuffers, kind: str, size: int) -> None:
    stream = b.up if kind == "h2d" else b.down
    with torch.cuda.stream(stream):
        if kind == "h2d":
            b.dev_dst[:size].copy_(b.host_src[:size], non_blocking=True)
        else:
            b.host_dst[:size].copy_(b.dev_src[:size], non_blocking=True)


def _together(bufs: list[_DeviceBuffers], size: int, kinds: tuple[str, ...], repeats: int, inner: int,
              progress: ProgressSink) -> dict[str, Stat]:
    """Every GPU runs ``inner`` copies of each kind in ``kinds`` ("h2d" on its up stream, "d2h" on its down
    stream) at once; per kind, the slowest GPU's seconds per copy, over ``repeats`` rounds after one warm-up. The
    copies are enqueued round-robin over GPUs and kinds, so that every stream is busy from the first copy on."""
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(repeats + 1):
        for b in bufs:
            torch.cuda.synchronize(b.device)
        events = {}
        for b in bufs:
            with torch.cuda.device(b.device):
                for kind in kinds:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(b.up if kind == "h2d" else b.down)
                    events[(b.device, kind)] = (start, end)
        for _ in range(inner):
            for b in bufs:
                with torch.cuda.device(b.device):
                    for kind in kinds:
                        _copy(b, kind, size)
        for b in bufs:
            with torch.cuda.device(b.device):
                for kind in kinds:
                    events[(b.device, kind)][1].record(b.up if kind == "h2d" else b.down)
        for b in bufs:
            torch.cuda.synchronize(b.device)
        if rep:
            for kind in kinds:
                out[kind].append(max(s.elapsed_time(e) for (_, k), (s, e) in events.items() if k == kind)
                                 / 1e3 / inner)
            progress.advance()
    return {k: Stat.of(v) for k, v in out.items()}


def measure_copies_together(sizes_bytes: Sequence[int], repeats: int, devices: Sequence[int],
                            progress: Optional[ProgressSink] = None) -> PinnedCopies:
    """Pinned H2D, D2H and both directions at once, on every GPU of ``devices`` at the same time: each sample is
    the slowest GPU's. Pageable H2D blocks the host thread that issues it, so it is not measured together;
    perfmodel/world.py slows it down as much as the pinned H2D."""
    progress = progress or NullProgress()
    progress.start(f"PCIe copies on {len(devices)} GPUs at once (H2D, D2H, duplex)", len(sizes_bytes) * 3 * repeats)
    top = max(sizes_bytes)
    bufs = [_DeviceBuffers(d, top) for d in devices]
    pts: dict[str, list[Sample]] = {k: [] for k in ("h2d", "d2h", "duplex_h2d", "duplex_d2h")}
    try:
        for size in sizes_bytes:
            inner = inner_repeats(size)
            for kind in ("h2d", "d2h"):
                pts[kind].append(Sample(size=size, seconds=_together(bufs, size, (kind,), repeats, inner,
                                                                     progress)[kind]))
            both = _together(bufs, size, ("h2d", "d2h"), repeats, inner, progress)
            pts["duplex_h2d"].append(Sample(size=size, seconds=both["h2d"]))
            pts["duplex_d2h"].append(Sample(size=size, seconds=both["d2h"]))
    finally:
        del bufs
        torch.cuda.empty_cache()
    return PinnedCopies(**{k: fit_series("bytes", v) for k, v in pts.items()})
