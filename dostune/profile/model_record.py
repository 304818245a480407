"""The typed, versioned model profile record (``dostune.model-profile``).

A model profile is measured for one model, micro-batch, sequence length and precision on one node, under
DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU. It is kept in its own file beside the node
profile (``profiles/<node>-<model>-b<B>-s<S>.json``) and names the node it was measured on; the tuner
reads both.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ProfileError
from ..stats import Stat
from .record import _format_validation_error, check_version, read_json_record

# 2: world and ranks (a profile measured under DeepSpeed's launcher). Version 1 profiles still load (one rank).
MODEL_SCHEMA_VERSION = 2
MODEL_READABLE_VERSIONS = (1, 2)
MODEL_KIND = "dostune.model-profile"
PHASES = ("fwd", "bwd", "step")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemorySample(_Record):
    """GPU (or, on a CPU machine, process) memory at one point of an iteration."""

    t: float  # seconds from the start of the iteration
    phase: Literal["fwd", "bwd", "step"]
    allocated_gib: float
    reserved_gib: float
    where: str  # module or event the sample was taken at


class PhaseProfile(_Record):
    time_s: Stat
    peak_allocated_gib: float
    min_allocated_gib: float
    peak_reserved_gib: float
    free_gib: Optional[float]  # device memory minus the phase's peak allocation (None on CPU)


class SubgroupProfile(_Record):
    index: int
    numel: int
    params: int
    grad_ready_s: Optional[float]  # when, from the start of backward, its last gradient was partitioned


class PcieTraffic(_Record):
    """Mean PCIe throughput per phase from NVML's counters (GB/s; tx = device to host)."""

    tx_gbps: float
    rx_gbps: float
    samples: int


class WorldRecord(_Record):
    """The world a model profile was measured in: one rank per GPU."""

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1)


class RankProfile(_Record):
    """One rank's phases, in a profile measured under the launcher."""

    rank: int
    phases: dict[str, PhaseProfile]
    step_overhead_s: Optional[float] = None


class ModelProfile(_Record):
    schema_version: int
    kind: Literal["dostune.model-profile"] = MODEL_KIND
    created: str
    command: str
    dostune_version: str
    node: str
    device: str
    gpu_total_gib: Optional[float]
    model: str
    architecture: dict = Field(default_factory=dict)
    params: int
    micro_batch: int
    seq: int
    precision: str
    sub_group_size: int
    iterations: int
    subgroups: list[SubgroupProfile]
    optimizer_state_bytes: int  # fp32 params + exp_avg + exp_avg_sq + fp32 grads held on the host (one rank's)
    # Under the launcher: each phase as the slowest rank ran it (its time, the highest peak and the least free
    # memory of any rank); every rank's own figures are in ``ranks``. Subgroups and grad-ready times are rank 0's.
    phases: dict[str, PhaseProfile]
    step_overhead_s: Optional[float] = None  # step time outside the per-subgroup updates (prologue, epilogue, engine)
    backward_s: float  # the iteration whose grad-ready times are recorded
    world: WorldRecord = Field(default_factory=WorldRecord)
    ranks: list[RankProfile] = Field(default_factory=list)  # empty for a profile of one rank
    memory_timeline: list[MemorySample]
    pcie: Optional[dict[str, PcieTraffic]] = None
    notes: list[str] = Field(default_factory=list)

    @property
    def num_subgroups(self) -> int:
        return len(self.subgroups)

    @property
    def world_size(self) -> int:
        return self.world.nodes * self.world.gpus_per_node


def slowest_phases(per_rank: list[dict[str, PhaseProfile]]) -> dict[str, PhaseProfile]:
    """Each phase as the slowest rank ran it: that rank's time, and the highest peaks and the least free memory of
    any rank (the ranks wait for each other in ZeRO-3's collectives; memory must fit on every GPU)."""
    out = {}
    for ph in per_rank[0]:
        xs = [r[ph] for r in per_rank]
        free = [x.free_gib for x in xs if x.free_gib is not None]
        out[ph] = PhaseProfile(time_s=max(xs, key=lambda x: x.time_s.median).time_s,
                               peak_allocated_gib=max(x.peak_allocated_gib for x in xs),
                               min_allocated_gib=min(x.min_allocated_gib for x in xs),
                               peak_reserved_gib=max(x.peak_reserved_gib for x in xs),
                               free_gib=min(free) if free else None)
    return out


def load_model_profile(path) -> ModelProfile:
    data = read_json_record(path, "model profile")
    check_version(data, path, MODEL_KIND, MODEL_SCHEMA_VERSION, MODEL_READABLE_VERSIONS)
    try:
        return ModelProfile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(_format_validation_error(str(path), e)) from None
