"""The typed, versioned tuning result (``tune.json`` beside the emitted ``ds_config.json``)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ..records import Record

# 2: world, host_budget_gib; 3: backward's parts in PredictedTimes, ZeRO-Offload's form, the validation's phases and
# figure; 4: the host's steal in the model profile and in each validated run; 5: the timed iterations each set aside
# for steal; 6: each validated row's per-round medians; 7: the swing in each of a validated row's timed iterations;
# 8: details, the notes `dostune tune` prints only with --verbose; 9: the regime (each prediction's, each trial's in
# both, the one the pick was scored for, the clipping and the model profile's gradient norms it was decided from, each
# validated row's), the validation's clipping and the pick's regret against its neighbours (every new field optional:
# older files still parse)
TUNE_SCHEMA_VERSION = 9
TUNE_KIND = "dostune.tune-result"


class PredictedTimes(Record):
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
    # backward = compute (without the offload's gradient copies) + the copies it waits for + what the CPU lane working
    # beside it adds (perfmodel/backward.py); None without a model profile
    bwd_compute_s: Optional[float] = None
    bwd_copies_s: Optional[float] = None
    bwd_interference_s: Optional[float] = None
    pinned: Optional[bool] = None  # ZeRO-Offload only: with page-locked host buffers (pin_memory)
    measured_step: Optional[bool] = None  # ZeRO-Offload only: its step is the model profile's measurement
    # v9. dostune only: the regime predicted (perfmodel/lanes.py: no_clip or clip; None in older files, no_clip then),
    # and the lane balance's swing the prediction settled on there (make_plan's sign: > 0 moved GPU-lane subgroups to
    # the CPU lane)
    regime: Optional[str] = None
    swing: Optional[int] = None


class TrialRecord(Record):
    number: Optional[int] = None  # Optuna trial number (None for non-search entries)
    sub_group_size: int
    subgroups: int
    schedule: dict  # the dostune section
    predicted: PredictedTimes  # in the regime it was scored by (for both, the slower of the two)
    feasible: bool = True
    # v9. The schedule's prediction in each regime, by name (no_clip, clip)
    regimes: dict[str, PredictedTimes] = Field(default_factory=dict)

    def iter_in(self, regime: str) -> Optional[float]:
        """The predicted iteration in ``regime`` (the scored prediction's in an older file, which has only that)."""
        p = self.regimes.get(regime)
        if p is None and (self.predicted.regime or "no_clip") == regime:
            p = self.predicted
        return p.iter_s if p is not None else None


def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """|predicted - measured| / measured (None when either is unknown)."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return abs(predicted - measured) / measured


def median(values) -> Optional[float]:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


PHASES = ("fwd", "bwd", "step", "iter")


class Validation(Record):
    """A schedule (or ZeRO-Offload) run for real next to its prediction, phase by phase."""

    label: str
    method: Literal["zero-offload", "dostune"] = "dostune"
    sub_group_size: int
    schedule: Optional[dict]
    predicted_iter_s: Optional[float]
    predicted_step_s: float
    measured_iter_s: float
    measured_step_s: float
    measured_peak_gpu_gib: Optional[float]
    predicted_fwd_s: Optional[float] = None
    predicted_bwd_s: Optional[float] = None
    measured_fwd_s: Optional[float] = None
    measured_bwd_s: Optional[float] = None
    predicted_peak_gpu_gib: Optional[float] = None
    # v4. The share of CPU time the hypervisor took during this run's timed iterations (bench's MethodResult.steal)
    measured_steal: Optional[float] = None
    # v5. Timed iterations of this run set aside for steal, another run in the place of each (MethodResult.set_aside)
    set_aside: Optional[int] = None
    # v6. The median iteration and step of each round that ran, in the order run: every round runs the method in a
    # fresh process, so these say how far the same schedule moves from one process to the next
    measured_round_iter_s: Optional[list[float]] = None
    measured_round_step_s: Optional[list[float]] = None
    # v7. The swing (adaptive_swing) of each timed iteration, in the order run (bench's MethodResult.swing: k > 0, k
    # GPU-lane subgroups on the CPU lane; k < 0, -k CPU-lane subgroups on the GPU lane); None for a method without a
    # swing. The prediction is of the tuned split, which the swing leaves as it is until the lanes' measured times
    # disagree with it
    measured_swing: Optional[list[int]] = None
    # v9. The regime whose prediction the row holds (the one its runs were in, by the clipping they ran with), and
    # which of the pick's neighbours it is ("GPU lane 3/14", say; None for the pick and the other best schedules)
    regime: Optional[str] = None
    neighbour: Optional[str] = None

    def swung(self) -> Optional[tuple[float, int]]:
        """(median, farthest from 0) swing over the timed iterations; None where it moved nothing or nothing was
        recorded: a row that moved measured another split than the one predicted."""
        xs = self.measured_swing
        if not xs or not any(xs):
            return None
        return median(xs), max(xs, key=abs)

    def predicted(self, phase: str) -> Optional[float]:
        return getattr(self, f"predicted_{phase}_s")

    def measured(self, phase: str) -> Optional[float]:
        return getattr(self, f"measured_{phase}_s")

    def error(self, phase: str) -> Optional[float]:
        return relative_error(self.predicted(phase), self.measured(phase))

    def error_s(self, phase: str) -> Optional[float]:
        """|predicted - measured| of ``phase`` in seconds (None when either is unknown)."""
        p, m = self.predicted(phase), self.measured(phase)
        return None if p is None or m is None else abs(p - m)

    def round_spread(self, phase: str) -> Optional[float]:
        """How much longer ``phase`` (iter or step) took in this row's slowest round than in its fastest, as a
        share of the fastest (None with fewer than two rounds recorded)."""
        xs = getattr(self, f"measured_round_{phase}_s")
        if not xs or len(xs) < 2 or min(xs) <= 0:
            return None
        return max(xs) / min(xs) - 1.0

    @property
    def iter_error(self) -> Optional[float]:
        return self.error("iter")

    @property
    def step_error(self) -> Optional[float]:
        return self.error("step")


class TuneResult(Record):
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
    validation_figure: Optional[str] = None  # predicted against measured, per phase and schedule (tune --validate)
    validation_bench: Optional[str] = None  # the validation's measurements as a bench record (traced steps included)
    # v4. The share of CPU time the hypervisor took while the model profile timed its iterations (ModelProfile.steal)
    profile_steal: Optional[float] = None
    # v5. The model profile's timed iterations set aside for steal (ModelProfile.set_aside)
    profile_set_aside: Optional[int] = None
    notes: list[str] = Field(default_factory=list)  # what the user should know, each with what to do: always printed
    # v8. What the search and the validation found beyond the notes (which profile was read, the rates it stood in,
    # the validation's host diagnostics): printed with --verbose
    details: list[str] = Field(default_factory=list)
    # v9. What the schedules were scored for (no_clip, clip, or both: the worse of the two), the emitted config's
    # gradient clipping, and the model profile's timed iterations' gradient norms (None: no model profile; empty: one
    # from before they were recorded)
    regime: Optional[str] = None
    clip: Optional[float] = None
    profile_grad_norms: Optional[list[Optional[float]]] = None
    # v9. The clipping the validation ran with (0: off)
    validation_clip: Optional[float] = None
    # v9. With tune --neighbours: the pick's measured iteration (pooled median over the rounds) over the best measured
    # among the pick, its neighbours and any other validated schedule (1.0: the pick measured best), and the best's
    # label
    regret: Optional[float] = None
    regret_best: Optional[str] = None

    @property
    def median_iter_error(self) -> Optional[float]:
        return median(v.iter_error for v in self.validation)

    def median_error(self, phase: str, method: Optional[str] = None) -> Optional[float]:
        """The median relative error of ``phase`` over the validated rows (of one ``method``, or all)."""
        return median(v.error(phase) for v in self.validation if method is None or v.method == method)

    def median_error_s(self, phase: str, method: Optional[str] = None) -> Optional[float]:
        """The median absolute error of ``phase`` in seconds over the validated rows (of one ``method``, or all): an
        overlapped schedule's step is what its CPU lane leaves after backward, often a few tens of ms, and there a
        relative error is large on a few ms."""
        return median(v.error_s(phase) for v in self.validation if method is None or v.method == method)

    def host_drift(self, phase: str = "iter") -> Optional[float]:
        """ZeRO-Offload's validated ``phase`` over its prediction (None without that row). Its prediction is the
        model profile's own measurement of it (the step at the profile's sub_group_size, which validation runs), so
        this is how far the host's speed moved between the profile and the validation, in two processes: every
        row's error holds a move of that size, whatever the model."""
        zo = next((v for v in self.validation if v.method == "zero-offload"), None)
        if zo is None or not zo.predicted(phase) or zo.measured(phase) is None:
            return None
        return zo.measured(phase) / zo.predicted(phase)

    def round_spread(self, phase: str = "iter", method: Optional[str] = None) -> Optional[float]:
        """The median over the validated rows (of one ``method``, or all) of how far their rounds, each a fresh
        process running the same schedule, were apart in ``phase`` (Validation.round_spread). A prediction cannot be
        held closer than the measurement agrees with itself."""
        return median(v.round_spread(phase) for v in self.validation if method is None or v.method == method)

    def validation_steal(self) -> Optional[float]:
        """The mean share of CPU time the hypervisor took over the validated runs (None where none was recorded):
        beside ``profile_steal``, whether the host was as quiet when the profile measured as when the runs did."""
        xs = [v.measured_steal for v in self.validation if v.measured_steal is not None]
        return sum(xs) / len(xs) if xs else None

    def validation_set_aside(self) -> Optional[int]:
        """The validated runs' timed iterations set aside for steal, all rows together (None where none recorded)."""
        xs = [v.set_aside for v in self.validation if v.set_aside is not None]
        return sum(xs) if xs else None
