"""Which form of an offload method this host's memory can hold, decided before anything is built (by bench for
each method, and by the model profile for its ZeRO-Offload run): what does not fit is said in one line instead of
minutes of engine building ended by the OOM killer."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from .dsconfig import OffloadSettings
from .errors import DostuneError
from .optim.footprint import (HOST_BASE_BYTES, HOST_USABLE_SHARE, deepspeed_offload_host_bytes, grad_buffer_bytes,
                               pinned_host_bytes)
from .optim.schedule import make_plan
from .perfmodel.subgroups import subgroup_sizes


def fit_host_memory(name: str, off: OffloadSettings, numels: list[int], precision: str,
                    available: Optional[int]) -> tuple[OffloadSettings, str]:
    """The method's offload settings as this host's memory allows, and a note for its row ('' when unchanged):
    ZeRO-Offload (and Twin-Flow, on the subgroups it offloads) without pin_memory where its pinned buffers would not
    fit (DeepSpeed's own setting that does); DostuneError, before anything is built, where even that cannot fit.
    ``available``: host bytes for this rank (None: unknown, nothing is changed), of which the method may take
    HOST_USABLE_SHARE, as check_host_fits and the tuner's budget allow: on a 125 GiB H200 host ZeRO-Offload's pinned
    buffers of a 6.2B LLaMA, estimated at 122.7 GiB, filled the host and were killed by the OOM killer."""
    if available is None or off.ratio == 0.0 or off.super_offload:
        return off, ""
    usable = HOST_USABLE_SHARE * available
    sizes = subgroup_sizes(numels, off.sub_group_size, int(os.environ.get("WORLD_SIZE", "1")))
    gb = grad_buffer_bytes(precision)
    gib = 2**30
    room = f"{available / gib:.1f} GiB are available, of which it may take {HOST_USABLE_SHARE:.0%}"
    if off.schedule is not None:
        need = pinned_host_bytes(sizes, make_plan(len(sizes), off.schedule), off.schedule, gb) + HOST_BASE_BYTES
        if need > usable:
            raise DostuneError(f"not run: its optimizer state needs about {need / gib:.1f} GiB of host memory, {room}")
        return off, ""
    pinned = deepspeed_offload_host_bytes(sizes, True, gb, off.ratio) + HOST_BASE_BYTES
    if not off.pin_memory or pinned <= usable:
        return off, ""
    pageable = deepspeed_offload_host_bytes(sizes, False, gb, off.ratio) + HOST_BASE_BYTES
    if pageable > usable:
        raise DostuneError(f"not run: its optimizer state needs about {pageable / gib:.1f} GiB of host memory "
                           f"({pinned / gib:.1f} pinned), {room}")
    return replace(off, pin_memory=False), (f"pin_memory false: pinned it needs about {pinned / gib:.0f} GiB of host "
                                            f"memory, {available / gib:.0f} GiB are available, of which it may take "
                                            f"{HOST_USABLE_SHARE:.0%}")
