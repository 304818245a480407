"""The typed, versioned node profile record and its JSON I/O.

A node profile holds what the performance model needs to know about one machine: who it is
(host, GPU, PCIe link) and what it measured (copy bandwidths, optimizer throughputs, conversion
costs, contention). Every figure in it was measured by `dostune profile`; nothing is typed in.

The schema is versioned (``schema_version``). Readers accept exactly the versions they know and
say so plainly otherwise. ``dostune profile --schema`` prints the JSON schema; see
``docs/profile-schema.md`` for the meaning of each field.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import DostuneError, ProfileError
from ..stats import Stat, linear_fit

# 2: host.available_gib and host.gpus, cpu_adam.concurrent, contention.gpus, multi_gpu (docs/profile-schema.md).
# Version 1 profiles still load: the new fields take their defaults.
NODE_SCHEMA_VERSION = 2
NODE_READABLE_VERSIONS = (1, 2)
NODE_KIND = "dostune.node-profile"


class _Record(BaseModel):
    # Unknown keys are an error: a typo in a hand-edited profile must not pass silently.
    model_config = ConfigDict(extra="forbid")


class LinearCost(_Record):
    """time(amount) = overhead_s + amount / rate_per_s, fitted by least squares over sizes."""

    overhead_s: float
    rate_per_s: float = Field(gt=0)
    r2: float

    def time(self, amount: float) -> float:
        return max(self.overhead_s, 0.0) + amount / self.rate_per_s


class Sample(_Record):
    """Repeated timings of one operation at one size (bytes or elements, see the series' unit)."""

    size: int = Field(gt=0)
    seconds: Stat
    threads: Optional[int] = None

    @property
    def rate(self) -> float:
        return self.size / self.seconds.median


class Series(_Record):
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


class HostInfo(_Record):
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


class PcieLink(_Record):
    """PCIe link as NVML reports it. GPUs drop to a lower generation when idle, so the current
    values read at rest can be below the max; theoretical bandwidths are per direction."""

    current_generation: int
    max_generation: int
    current_width: int
    max_width: int
    theoretical_gbps_current: float
    theoretical_gbps_max: float


class GpuInfo(_Record):
    index: int
    name: str
    memory_gib: float
    compute_capability: str
    multiprocessors: int
    driver: Optional[str]
    pcie: Optional[PcieLink]


class CopyProfile(_Record):
    """Host<->device copies with pinned host memory (and pageable H2D for comparison).

    ``duplex_*`` are the two directions running at the same time on separate streams; each is
    timed on its own stream, so its rate is what that direction gets while the other is busy.
    """

    h2d: Series
    d2h: Series
    duplex_h2d: Series
    duplex_d2h: Series
    h2d_pageable: Series


class PinnedCopies(_Record):
    """Pinned copies only (several GPUs copying at once; pageable copies block the host one GPU at a time)."""

    h2d: Series
    d2h: Series
    duplex_h2d: Series
    duplex_d2h: Series


class CpuAdamProfile(_Record):
    """DeepSpeedCPUAdam (fp32 params, grads and states) over sizes and OpenMP thread counts."""

    by_threads: dict[int, Series]
    best_threads: int
    # Key: how many processes ran CPU Adam at once, each with logical cores // key threads (as that many ranks of
    # one node do); the series holds the slowest process's time at each size.
    concurrent: dict[int, Series] = Field(default_factory=dict)


class ConvertProfile(_Record):
    """fp32 -> half-precision conversion (the one the optimizer does after each update)."""

    dtype: Literal["bf16", "fp16"]
    cpu: Series
    gpu: Optional[Series]


class ContentionProfile(_Record):
    """CPU Adam time alone and while both PCIe directions stream pinned memory."""

    elements: int
    threads: int
    alone_s: Stat
    with_dma_s: Stat
    dma_gbps_during: float  # per direction, all GPUs together
    gpus: int = 1  # how many GPUs streamed at once

    @property
    def slowdown(self) -> float:
        return self.with_dma_s.median / self.alone_s.median


class MultiGpuProfile(_Record):
    """The node's GPUs measured together, as the ranks of one node use them under the launcher."""

    gpus: list[int]  # CUDA device indices, in the launcher's order ([0:N) with --num_gpus N)
    names: list[str]
    numa_node: list[Optional[int]]  # the host NUMA node each GPU is attached to (None: unknown)
    # NVML's nearest common ancestor of each pair of GPUs, one of perfmodel/world.py TOPOLOGY_LEVELS ("self" on the
    # diagonal; null when NVML could not say): GPUs under one PCIe switch share its uplink
    common_ancestor: list[list[Optional[str]]]
    copies: PinnedCopies  # every GPU copying at once; each sample is the slowest GPU's time


class NodeProfile(_Record):
    schema_version: int
    kind: Literal["dostune.node-profile"] = NODE_KIND
    name: str
    created: str
    command: str
    dostune_version: str
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

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.copies is not None and self.gpu_adam is not None


def _format_validation_error(path: str, err: ValidationError) -> str:
    """One line: the file and its first problems (a message that wraps is still one line in a log)."""
    problems = []
    for e in err.errors()[:4]:
        loc = ".".join(str(p) for p in e["loc"]) or "<top level>"
        problems.append(f"field '{loc}': {e['msg']}")
    more = len(err.errors()) - 4
    if more > 0:
        problems.append(f"and {more} more problem(s)")
    return f"{path} is not a valid dostune profile: " + "; ".join(problems)


def read_json_record(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object from ``path`` or raise ProfileError that names the file and the problem."""
    p = Path(path)
    if not p.exists():
        raise ProfileError(f"{what} {p} does not exist")
    if p.is_dir():
        raise ProfileError(f"{what} {p} is a directory, not a JSON file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ProfileError(f"cannot read {what} {p}: {e.strerror or e}") from None
    if not raw.strip():
        raise ProfileError(f"{what} {p} is empty")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProfileError(f"{what} {p} is not a JSON text file (it holds binary data)") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise ProfileError(f"{p} is nested too deeply to be a {what}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p} must hold a JSON object, found {type(data).__name__}")
    return data


def check_version(data: dict, path, kind: str, version: int, readable: tuple[int, ...] = ()) -> None:
    """Refuse another kind of record or a schema version this dostune does not read (``version``, the one it
    writes, or one of the older ``readable`` ones)."""
    found_kind = data.get("kind")
    if found_kind is not None and found_kind != kind:
        raise ProfileError(f"{path} holds a '{found_kind}', expected a '{kind}'")
    v = data.get("schema_version")
    if v is None:
        raise ProfileError(f"{path}: field 'schema_version' is missing; is this a dostune {kind} file?")
    if v != version and v not in readable:
        older = isinstance(v, int) and v < version
        newer = isinstance(v, int) and v > version
        raise ProfileError(f"{path}: field 'schema_version' is {v!r}, this dostune reads version {version}"
                           + (" (the file is from an older dostune)" if older else
                              " (the file is from a newer dostune)" if newer else ""),
                           hint="make the file again with this dostune" if older else
                           "upgrade dostune to read it" if newer else None)


def load_node_profile(path: str | os.PathLike) -> NodeProfile:
    data = read_json_record(path, "profile")
    check_version(data, path, NODE_KIND, NODE_SCHEMA_VERSION, NODE_READABLE_VERSIONS)
    try:
        return NodeProfile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(_format_validation_error(str(path), e)) from None


@functools.lru_cache(maxsize=1)
def _file_mode() -> int:
    """The mode a plain open() would give a new file: 0666 less the umask (mkstemp's 0600 is for secrets). Read
    once: reading the umask means setting it, which another thread creating a file at that moment would see."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def check_writable(path: str | os.PathLike, what: str, *, directory: bool = False) -> Path:
    """Fail now, before any work, if ``path`` (a file, or with ``directory`` a folder) cannot be written: it is
    the wrong kind of thing, lies under a file, or its nearest existing folder refuses a new file. Creates
    nothing that stays behind (a probe file is made and removed)."""
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise DostuneError(f"{what} {p} is a file, not a folder", hint="give a folder path")
        if not directory and p.is_dir():
            raise DostuneError(f"{what} {p} is a folder, not a file", hint="give a file path inside it")
    folder = p if directory else p.parent
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DostuneError(f"{what} {p} cannot be created: {existing} is a file, not a folder",
                           hint="choose a path whose folders are folders")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dostune-write-check.", dir=existing)
    except OSError as e:
        raise DostuneError(f"{what} {p} cannot be written: {e.strerror or e} in {existing}",
                           hint="choose a path in a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write via a temporary file next to ``path`` and rename, so an interrupted write never leaves half a
    file. The file gets the usual mode (0644 under the common umask)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    except OSError as e:
        raise DostuneError(f"cannot write {p}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, p)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DostuneError(f"cannot write {p}: {e.strerror or e}") from None
        raise
    return p


def save_record(record: BaseModel, path: str | os.PathLike) -> Path:
    return atomic_write_text(path, record.model_dump_json(indent=2) + "\n")


def node_profile_schema() -> dict:
    return NodeProfile.model_json_schema()
