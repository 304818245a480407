"""The typed, versioned node profile record (its JSON I/O is dostune/records.py's).

A node profile holds what the performance model needs to know about one machine: who it is
(host, GPU, PCIe link) and what it measured (copy bandwidths, optimizer throughputs, conversion
costs, contention). Every figure in it was measured by `dostune profile`; nothing is typed in.

The schema is versioned (``schema_version``). Readers accept exactly the versions they know and
say so plainly otherwise. ``dostune profile --schema`` prints the JSON schema; see
``docs/profile-schema.md`` for the meaning of each field.
"""
from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import Field

from ..records import Record, load_record
from ..stats import Stat, linear_fit

# 2: host.available_gib and host.gpus, cpu_adam.concurrent, contention.gpus, multi_gpu (docs/profile-schema.md).
# 3: copies.d2h_pageable. 4: contention.h2d_under_cpu. 5: steal. 6: mode. Older profiles still load: the new fields take
# their defaults (the performance model says what it uses instead).
NODE_SCHEMA_VERSION = 6
NODE_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
NODE_KIND = "dostune.node-profile"
# How much a node profile measured: "standard" (`dostune profile`), "thorough" (--thorough: more repeats, for validation
# work) or "quick" (--quick: tiny sizes, a smoke test that tunes nothing real)
NodeMode = Literal["quick", "standard", "thorough"]


class LinearCost(Record):
    """time(amount) = overhead_s + amount / rate_per_s, fitted by least squares over sizes."""

    overhead_s: float
    rate_per_s: float = Field(gt=0)
    r2: float

    def time(self, amount: float) -> float:
        return max(self.overhead_s, 0.0) + amount / self.rate_per_s


class Sample(Record):
    """Repeated timings of one operation at one size (bytes or elements, see the series' unit)."""

    size: int = Field(gt=0)
    seconds: Stat
    threads: Optional[int] = None

    @property
    def rate(self) -> float:
        return self.size / self.seconds.median


class Series(Record):
    """A family of samples over sizes and the linear cost fitted to them."""

    unit: Literal["bytes", "elements"]
    points: list[Sample]
    fit: LinearCost


def fit_series(unit: str, points: list[Sample]) -> Series:
    """Fit time = overhead + size/rate to the samples' medians."""
    xs = [p.size for p in points]
    ys = [p.seconds.median for p in points]
    a, b, r2 = linear_fit(xs, ys) if len(set(xs)) > 1 else (0.0, ys[0] / xs[0], 1.0)
    if a < 0 or b <= 0:
        # A negative per-operation overhead is noise (cache effects at small sizes): fit through the
        # origin instead, which weights the large sizes that dominate real transfers.
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return Series(unit=unit, points=points, fit=LinearCost(overhead_s=a, rate_per_s=1.0 / b, r2=r2))


class HostInfo(Record):
    cpu_model: str
    logical_cores: int
    physical_cores: Optional[int]
    numa_nodes: int
    ram_gib: float
    os: str
    python: str
    torch: str
    deepspeed: Optional[str]
    cuda_runtime: Optional[str]
    available_gib: Optional[float] = None  # host memory available when the profile started
    gpus: Optional[int] = None  # CUDA devices this process saw (None in version 1 profiles)


class PcieLink(Record):
    """PCIe link as NVML reports it. GPUs drop to a lower generation when idle, so the current
    values read at rest can be below the max; theoretical bandwidths are per direction."""

    current_generation: int
    max_generation: int
    current_width: int
    max_width: int
    theoretical_gbps_current: float
    theoretical_gbps_max: float


class GpuInfo(Record):
    index: int
    name: str
    memory_gib: float
    compute_capability: str
    multiprocessors: int
    driver: Optional[str]
    pcie: Optional[PcieLink]


class CopyProfile(Record):
    """Host<->device copies with pinned host memory, and with pageable memory as DeepSpeed copies without pin_memory.

    ``duplex_*`` are the two directions running at the same time on separate streams; each is
    timed on its own stream, so its rate is what that direction gets while the other is busy.
    ``d2h_pageable`` (v3) is timed on the host, as the copy blocks it (ZeRO-Offload's gradient copies in backward).
    """

    h2d: Series
    d2h: Series
    duplex_h2d: Series
    duplex_d2h: Series
    h2d_pageable: Series
    d2h_pageable: Optional[Series] = None


class PinnedCopies(Record):
    """Pinned copies only (several GPUs copying at once; pageable copies block the host one GPU at a time)."""

    h2d: Series
    d2h: Series
    duplex_h2d: Series
    duplex_d2h: Series


class CpuAdamProfile(Record):
    """DeepSpeedCPUAdam (fp32 params, grads and states) over sizes and OpenMP thread counts."""

    by_threads: dict[int, Series]
    best_threads: int
    # Key: how many processes ran CPU Adam at once, each with logical cores // key threads (as that many ranks of
    # one node do); the series holds the slowest process's time at each size.
    concurrent: dict[int, Series] = Field(default_factory=dict)


class ConvertProfile(Record):
    """fp32 -> half-precision conversion (the one the optimizer does after each update)."""

    dtype: Literal["bf16", "fp16"]
    cpu: Series
    gpu: Optional[Series]


class ContentionProfile(Record):
    """CPU Adam time alone and while both PCIe directions stream pinned memory, and how the host-to-device copies ran
    while it computed."""

    elements: int
    threads: int
    alone_s: Stat
    with_dma_s: Stat
    dma_gbps_during: float  # per direction, all GPUs together
    gpus: int = 1  # how many GPUs streamed at once
    # host-to-device rate of the copies that ran while CPU Adam computed, over that of the ones after it (same stream,
    # same window): the copies read host memory that CPU Adam is streaming through. None: not measured (schema < 4)
    h2d_under_cpu: Optional[float] = None

    @property
    def slowdown(self) -> float:
        return self.with_dma_s.median / self.alone_s.median


class MultiGpuProfile(Record):
    """The node's GPUs measured together, as the ranks of one node use them under the launcher."""

    gpus: list[int]  # CUDA device indices, in the launcher's order ([0:N) with --num_gpus N)
    names: list[str]
    numa_node: list[Optional[int]]  # the host NUMA node each GPU is attached to (None: unknown)
    # NVML's nearest common ancestor of each pair of GPUs, one of perfmodel/world.py TOPOLOGY_LEVELS ("self" on the
    # diagonal; null when NVML could not say): GPUs under one PCIe switch share its uplink
    common_ancestor: list[list[Optional[str]]]
    copies: PinnedCopies  # every GPU copying at once; each sample is the slowest GPU's time


class NodeProfile(Record):
    schema_version: int
    kind: Literal["dostune.node-profile"] = NODE_KIND
    name: str
    created: str
    command: str
    dostune_version: str
    # v6: the mode whose repeats and sizes it started from (None: measured before profiles recorded a mode)
    mode: Optional[NodeMode] = None
    repeats: int
    host: HostInfo
    gpu: Optional[GpuInfo]
    notes: list[str] = Field(default_factory=list)
    copies: Optional[CopyProfile]
    cpu_adam: CpuAdamProfile
    gpu_adam: Optional[Series]
    convert: ConvertProfile
    unscale: Optional[Series] = None  # CPU grad *= 1/scale at the best CPU Adam thread count
    ds_upload: Optional[Series] = None  # DeepSpeed's blocking fp32 (pageable) -> half GPU copy, by elements
    contention: Optional[ContentionProfile]
    multi_gpu: Optional[MultiGpuProfile] = None
    # v5. The share of the machine's CPU time the hypervisor took (steal, host_steal.py) while this profile measured;
    # None where /proc/stat has no steal
    steal: Optional[float] = None

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.copies is not None and self.gpu_adam is not None


def load_node_profile(path: str | os.PathLike) -> NodeProfile:
    return load_record(path, NodeProfile, "profile", NODE_KIND, NODE_SCHEMA_VERSION, NODE_READABLE_VERSIONS)


def node_profile_schema() -> dict:
    return NodeProfile.model_json_schema()
