"""PCIe copy tests: pinned H2D, D2H, both at once (duplex), and pageable H2D and D2H."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..stats import Stat
from .record import CopyProfile, Sample, fit_series
from .timing import NullProgress, ProgressSink, inner_repeats, time_cpu, time_cuda

COPY_KINDS = ("h2d", "d2h", "duplex", "h2d_pageable", "d2h_pageable")


def _duplex_samples(size: int, host_src, dev_dst, dev_src, host_dst, repeats: int, inner: int,
                    progress: ProgressSink) -> tuple[Stat, Stat]:
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    h2d, d2h = [], []
    for rep in range(repeats + 1):  # first round warms up
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record(up)
        ev[2].record(down)
        for _ in range(inner):
            with torch.cuda.stream(up):
                dev_dst[:size].copy_(host_src[:size], non_blocking=True)
            with torch.cuda.stream(down):
                host_dst[:size].copy_(dev_src[:size], non_blocking=True)
        ev[1].record(up)
        ev[3].record(down)
        torch.cuda.synchronize()
        if rep:
            h2d.append(ev[0].elapsed_time(ev[1]) / 1e3 / inner)
            d2h.append(ev[2].elapsed_time(ev[3]) / 1e3 / inner)
            progress.advance()
    return Stat.of(h2d), Stat.of(d2h)


def _blocking_d2h(dst, src, size: int, device) -> None:
    dst[:size].copy_(src[:size])
    torch.cuda.synchronize(device)


def measure_copies(sizes_bytes: Sequence[int], repeats: int, device: int = 0,
                   progress: Optional[ProgressSink] = None) -> CopyProfile:
    progress = progress or NullProgress()
    progress.start("PCIe copies (H2D, D2H, duplex, pageable both ways)", len(sizes_bytes) * len(COPY_KINDS) * repeats)
    top = max(sizes_bytes)
    dev = torch.device("cuda", device)
    # Buffers are allocated once at the largest size; smaller tests use their prefixes.
    host_a = torch.empty(top, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_b = torch.empty(top, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(top, dtype=torch.uint8)
    pageable_dst = torch.empty(top, dtype=torch.uint8)
    dev_a = torch.empty(top, dtype=torch.uint8, device=dev)
    dev_b = torch.ones(top, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(device=dev)
    pts: dict[str, list[Sample]] = {k: [] for k in ("h2d", "d2h", "duplex_h2d", "duplex_d2h", "h2d_pageable",
                                                    "d2h_pageable")}
    for size in sizes_bytes:
        inner = inner_repeats(size)
        pts["h2d"].append(Sample(size=size, seconds=time_cuda(
            lambda: dev_a[:size].copy_(host_a[:size], non_blocking=True), repeats, inner, stream=stream,
            progress=progress)))
        pts["d2h"].append(Sample(size=size, seconds=time_cuda(
            lambda: host_b[:size].copy_(dev_b[:size], non_blocking=True), repeats, inner, stream=stream,
            progress=progress)))
        up, down = _duplex_samples(size, host_a, dev_a, dev_b, host_b, repeats, inner, progress)
        pts["duplex_h2d"].append(Sample(size=size, seconds=up))
        pts["duplex_d2h"].append(Sample(size=size, seconds=down))
        # Pageable copies are staged through a driver buffer and are synchronous: few, big samples.
        pts["h2d_pageable"].append(Sample(size=size, seconds=time_cuda(
            lambda: dev_a[:size].copy_(pageable[:size]), repeats, max(1, inner // 4), stream=stream,
            progress=progress)))
        # Into pageable memory, as ZeRO-Offload copies gradients in backward without pin_memory: the host thread
        # waits for the copy (the driver stages it through a pinned buffer), so it is timed on the host.
        pts["d2h_pageable"].append(Sample(size=size, seconds=time_cpu(
            lambda: _blocking_d2h(pageable_dst, dev_b, size, dev), repeats, progress=progress)))
    del host_a, host_b, pageable, pageable_dst, dev_a, dev_b
    torch.cuda.empty_cache()
    return CopyProfile(**{k: fit_series("bytes", v) for k, v in pts.items()})
