"""The typed, versioned tuning result (``tune.json`` beside the emitted ``ds_config.json``)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

TUNE_SCHEMA_VERSION = 2  # 2: world, host_budget_gib
TUNE_KIND = "dostune.tune-result"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PredictedTimes(_Record):
    fwd_s: Optional[float]
    bwd_s: Optional[float]
    step_s: float
    iter_s: Optional[float]
    lanes_s: float
    overhead_s: float
    cpu_busy_s: float
    h2d_busy_s: float
    d2h_busy_s: float
    update_gelem_s: float
    peak_gpu_gib: Optional[float]
    extra_step_gib: float
    extra_bwd_gib: float
    pinned_host_gib: float


class TrialRecord(_Record):
    number: Optional[int] = None  # Optuna trial number (None for non-search entries)
    sub_group_size: int
    subgroups: int
    schedule: dict  # the dostune section
    predicted: PredictedTimes
    feasible: bool = True


class Validation(_Record):
    """A schedule run for real next to its prediction."""

    label: str
    sub_group_size: int
    schedule: Optional[dict]
    predicted_iter_s: Optional[float]
    predicted_step_s: float
    measured_iter_s: float
    measured_step_s: float
    measured_peak_gpu_gib: Optional[float]

    @property
    def iter_error(self) -> Optional[float]:
        if self.predicted_iter_s is None:
            return None
        return abs(self.predicted_iter_s - self.measured_iter_s) / self.measured_iter_s


class TuneResult(_Record):
    schema_version: int = TUNE_SCHEMA_VERSION
    kind: Literal["dostune.tune-result"] = TUNE_KIND
    created: str
    command: str
    dostune_version: str
    node_profile: str
    model_profile: Optional[str]
    model: str
    params: int
    micro_batch: int
    seq: Optional[int]
    precision: str
    budget_gib: Optional[float]
    max_peak_gib: Optional[float]
    study_name: str
    storage: str
    sampler: str
    trials: int
    best: TrialRecord
    top: list[TrialRecord]
    closed_form: list[TrialRecord]
    ds_offload: Optional[PredictedTimes] = None  # DeepSpeed ZeRO-Offload (ratio 1.0) at its sub_group_size
    ds_sub_group_size: Optional[int] = None
    world: dict = Field(default_factory=lambda: {"nodes": 1, "gpus_per_node": 1})  # tuned for; predictions per rank
    host_budget_gib: Optional[float] = None  # pinned host memory the ranks of one node may hold together
    validation: list[Validation] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @property
    def median_iter_error(self) -> Optional[float]:
        errs = sorted(e for e in (v.iter_error for v in self.validation) if e is not None)
        if not errs:
            return None
        n = len(errs)
        return errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2
