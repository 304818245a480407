"""A bench method's measured host memory: the peak resident set of its process and the host memory page-locked for
it.

RSS: the kernel's high-water mark (VmHWM in /proc/self/status), reset when the method starts (writing 5 to
/proc/self/clear_refs), so that it is the method's own peak where several run in one process (under the launcher,
or a bench without isolation); a method in a process of its own has its process's peak either way.

Pinned: torch's pinned host allocator's peak (DeepSpeed's pin_memory copies, dostune's own pinned buffers: the
bytes it holds from CUDA, each allocation rounded up to a power of two as it is), plus what dostune's optimizer
page-locked in place (optim/pinned.py) at the end of the timed iterations. Both are counted, not estimated; None
without CUDA, where nothing is page-locked.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

GiB = 2**30


def reset_host_peaks() -> None:
    """Start the method's peaks from now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the process's peak since it started
        pass
    if torch.cuda.is_available():
        torch.cuda.reset_peak_host_memory_stats()


def peak_rss_bytes() -> Optional[int]:
    """The process's peak resident set since start or the last reset_host_peaks (None where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def pinned_bytes(optimizer) -> Optional[int]:
    """Host memory page-locked for the method: the pinned allocator's peak and what ``optimizer`` (dostune's)
    registered in place."""
    if not torch.cuda.is_available():
        return None
    allocated = int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))
    return allocated + int(getattr(optimizer, "dostune_registered_bytes", 0))


def gib(nbytes: Optional[int]) -> Optional[float]:
    return round(nbytes / GiB, 3) if nbytes is not None else None
