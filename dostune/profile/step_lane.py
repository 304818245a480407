"""The CPU lane as ``overlap_backward``'s step runs it, measured by `dostune profile --model` on a GPU.

In the step the lane updates each of its remaining subgroups once, reading their states and gradients from memory,
while the GPU lane streams its states in and out over PCIe, page-locked. The backward probes' lane (backward_probes.py)
updates one 10M-element scratch subgroup over and over, which stays in the last-level cache where it fits; the node
profile's contention is DeepSpeed's CPU Adam beside copies. Neither is the step's lane: on the H100 hosts the lane
read 1.16-1.36x slower taking four scratch subgroups in turn than one over and over, and in training it ran at about
the same rate whatever the cached probe read. This probe reads the lane in the step's conditions: the step's threads,
scratch subgroups taken in turn whose inputs together are at least twice the last-level cache, alone and beside both
copy directions (docs/performance-model.md, "Inputs").
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..optim.footprint import STATE_BYTES
from ..stats import Stat, upper_middle
from .backward_probes import LaneLoad
from .copy_load import DuplexCopies
from .model_record import StepLaneProfile
from .timing import NullProgress, ProgressSink

# assumed where the host does not say how large its last-level cache is: larger than any server CPU's we know of
UNKNOWN_CACHE_BYTES = 1 << 30
# the copies' chunk; each direction's chunks rotate through host buffers at least twice the last-level cache, so the
# DMA engines read and write memory, as they do the GPU lane's states
CHUNK_BYTES = 64 << 20


def last_level_cache_bytes() -> Optional[int]:
    """The largest CPU cache the host lists (Linux sysfs, the first CPU's), in bytes; None where it lists none."""
    sizes = []
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if text[-1:].upper() in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1:].upper()])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def input_bytes(half: torch.dtype) -> int:
    """Bytes of one element the CPU-lane kernel reads: the fp32 parameter, both moments, the half-precision gradient."""
    return STATE_BYTES + torch.tensor([], dtype=half).element_size()


def scratch_subgroups(elements: int, half: torch.dtype, cache: int) -> int:
    """How many scratch subgroups of ``elements`` the probe takes in turn so that their inputs together are at least
    twice ``cache`` bytes: each update then reads from memory."""
    return max(2, math.ceil(2 * cache / (elements * input_bytes(half))))


def beside_copies(spans: Sequence[tuple[float, float]], h2d_ends: Sequence[float], d2h_ends: Sequence[float],
                  chunk_bytes: int) -> tuple[list[float], float, float]:
    """From one round: the updates' (start, end) and each direction's chunk end times, all in seconds from the moment
    the copies were queued (chunks copied back to back from 0), the durations of the updates that ended while both
    directions still streamed, and each direction's rate (GB/s) over the stretch those updates ran. ([], 0, 0) where
    none did."""
    streaming_until = min(h2d_ends[-1], d2h_ends[-1]) if h2d_ends and d2h_ends else 0.0
    kept = [(a, b) for a, b in spans if b <= streaming_until]
    if not kept:
        return [], 0.0, 0.0
    t0, t1 = kept[0][0], kept[-1][1]

    def gbps(ends: Sequence[float]) -> float:
        starts = [0.0, *ends[:-1]]
        # the bytes each chunk moved inside the stretch, taken as moving evenly over its own copy
        moved = sum(chunk_bytes * max(0.0, min(e, t1) - max(s, t0)) / (e - s) for s, e in zip(starts, ends) if e > s)
        return moved / (t1 - t0) / 1e9

    return [b - a for a, b in kept], gbps(h2d_ends), gbps(d2h_ends)


def measure_step_lane(elements: int, threads: int, half: torch.dtype, rounds: int, device: int = 0,
                      progress: Optional[ProgressSink] = None, cache: Optional[int] = None) -> StepLaneProfile:
    """``rounds`` rounds, each one pass over the scratch subgroups alone, then one beside copies both ways on GPU
    ``device``, queued ahead (copy_load.py), after one untimed pass."""
    progress = progress or NullProgress()
    cache = cache or last_level_cache_bytes() or UNKNOWN_CACHE_BYTES
    lane = LaneLoad(elements, threads, half, subgroups=scratch_subgroups(elements, half, cache))
    progress.start(f"the CPU lane as the step runs it: {lane.subgroups} subgroups of {elements / 1e6:.0f}M elements in "
                   f"turn, {threads} threads, alone and beside copies both ways", rounds)
    host_chunks = max(2, math.ceil(2 * cache / CHUNK_BYTES))
    copies = DuplexCopies(torch.device("cuda", device), CHUNK_BYTES, host_chunks)

    def one_pass() -> list[tuple[float, float]]:
        spans = []
        for _ in range(lane.subgroups):
            t0 = time.perf_counter()
            lane.update()
            spans.append((t0, time.perf_counter()))
        return spans

    alone, beside, h2d, d2h = [], [], [], []
    try:
        one_pass()  # untimed: pages touched, the kernel warm
        for _ in range(rounds):
            spans = one_pass()
            alone += [b - a for a, b in spans]
            queued = copies.queue(spans[-1][1] - spans[0][0])
            time.sleep(0.002)  # the DMA engines under way before the lane starts
            spans = one_pass()
            h2d_ends, d2h_ends = queued.chunk_ends()
            kept, up_gbps, down_gbps = beside_copies([(a - queued.t_queue, b - queued.t_queue) for a, b in spans],
                                                     h2d_ends, d2h_ends, CHUNK_BYTES)
            if kept:
                beside += kept
                h2d.append(up_gbps)
                d2h.append(down_gbps)
            progress.advance()
    finally:
        del copies
        torch.cuda.empty_cache()
    if not beside:
        raise RuntimeError("no CPU-lane update ran while the copies streamed")

    return StepLaneProfile(threads=threads, elements=elements, subgroups=lane.subgroups, alone_s=Stat.of(alone),
                           beside_copies_s=Stat.of(beside), h2d_gbps=round(upper_middle(h2d), 2),
                           d2h_gbps=round(upper_middle(d2h), 2))
