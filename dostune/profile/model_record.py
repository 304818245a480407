"""The typed, versioned model profile record (``dostune.model-profile``).

A model profile is measured for one model, micro-batch, sequence length and precision on one node, under
DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU. It is kept in its own file beside the node
profile (``profiles/<node>-<model>-b<B>-s<S>.json``) and names the node it was measured on; the tuner
reads both.
"""
from __future__ import annotations

import statistics
from typing import Literal, Optional

from pydantic import Field

from ..stats import Stat
from ..records import Record, SetAside, load_record
from .record import Series

# 2: world and ranks (a profile measured under DeepSpeed's launcher). Version 1 profiles still load (one rank).
# 3: offload_pin_memory, backward_no_copy_s, backward_lane, step_parts_s, ds_cpu_adam, ds_unscale (the performance
# model's coefficients, docs/performance-model.md). Older profiles still load; the model falls back where they lack
# these, and says so.
# 4: backward_pinned_copy (on a GPU: how much of page-locked gradient copies backward hides). Version 3 profiles take
# that share from ZeRO-Offload's backward where it ran pinned, else take the copies whole.
# 5: steal (the share of CPU time the hypervisor took while the iterations were timed). Older profiles load with none.
# 6: set_aside, probes_set_aside (timed iterations and probe rounds set aside for steal). Older profiles load with none.
# 7: backward_lane.lane_alone_thread_s (the lane alone, timed in its worker thread; recorded beside lane_alone_s, which
# the model reads, for an A/B). Older profiles load with none.
# 8: probe_seconds, probe_forward_s, probe_rounds (the backward probes spread over a span of seconds, the forward
# before each timed, and every round's readings). Older profiles load with none: the model takes forward from the
# timed iterations then.
# 9: taken by a lane probe, since removed, that read its scratch from memory beside backward; such profiles are not
# read.
# 10: step_lane (the CPU lane as the step runs it: from memory, alone and beside page-locked copies both ways; on a
# GPU). Older profiles load with none: the model takes the step's lane from the backward probes' reading then.
# 11: later_window (ZeRO-Offload's step timed again after the backward probes, a second draw of the host's speed).
# Older profiles load with none: the model takes the step from the first timed iterations alone then.
# 12: mode (standard or thorough: the counts the profile started from; ``iterations`` and ``probe_seconds`` say what
# it took). Older profiles load with none.
# 13: grad_norms, clip_threshold (the global gradient norm of each timed iteration, and the clipping it ran with: whether
# training clips, which decides whether overlap_backward's speculation holds). Older profiles load with none.
MODEL_SCHEMA_VERSION = 13
MODEL_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13)
MODEL_KIND = "dostune.model-profile"
# How much a model profile measured: "standard" (`dostune profile --model`) or "thorough" (--thorough, for validation
# work: more iterations, the backward probes over a minute)
ModelMode = Literal["standard", "thorough"]
PHASES = ("fwd", "bwd", "step")


class MemorySample(Record):
    """GPU (or, on a CPU machine, process) memory at one point of an iteration."""

    t: float  # seconds from the start of the iteration
    phase: Literal["fwd", "bwd", "step"]
    allocated_gib: float
    reserved_gib: float
    where: str  # module or event the sample was taken at


class PhaseProfile(Record):
    time_s: Stat
    peak_allocated_gib: float
    min_allocated_gib: float
    peak_reserved_gib: float
    free_gib: Optional[float]  # device memory minus the phase's peak allocation (None on CPU)


class SubgroupProfile(Record):
    index: int
    numel: int
    params: int
    grad_ready_s: Optional[float]  # when, from the start of backward, its last gradient was partitioned


class PcieTraffic(Record):
    """Mean PCIe throughput per phase from NVML's counters (GB/s; tx = device to host)."""

    tx_gbps: float
    rx_gbps: float
    samples: int


class BackwardLaneProfile(Record):
    """Backward (with DeepSpeed's gradient copies to the host dropped, as in ``backward_no_copy_s``) while dostune's
    CPU-lane kernel updates a scratch subgroup in a worker thread, round after round, as ``overlap_backward`` runs it
    (out-of-place CPU Adam, half-precision gradients in and parameters out, the GIL released while it computes):
    how much the lane slows backward's host-bound hooks, and how fast the lane runs beside them."""

    threads: int = Field(ge=1)  # the lane's OpenMP threads (the CPU lane's default during backward)
    elements: int = Field(gt=0)  # one update of the scratch subgroup
    lane_alone_s: Stat  # one update, nothing else running (in bursts: profile/backward_probes.LaneLoad.alone)
    # v7: the same, timed in the worker thread under the lane's GIL switch interval while the main thread waits
    # (recorded beside lane_alone_s for comparison; the model reads lane_alone_s, the reading it was validated with)
    lane_alone_thread_s: Optional[Stat] = None
    lane_beside_s: Stat  # one update that started and ended while backward ran
    backward_s: Stat  # backward while the lane worked throughout


class StepLaneProfile(Record):
    """dostune's CPU-lane kernel as ``overlap_backward``'s step runs it (step_lane.py): the step's threads, scratch
    subgroups whose inputs together outgrow the last-level cache taken in turn (each read from memory, as the step reads
    each subgroup once), alone and while page-locked copies stream both ways between host memory and the GPU, as the
    GPU lane's states do. The rounds take the two in turn."""

    threads: int = Field(ge=1)
    elements: int = Field(gt=0)  # one update
    subgroups: int = Field(ge=1)  # the scratch subgroups taken in turn
    alone_s: Stat  # one update, nothing else running
    beside_copies_s: Stat  # one update that started and ended while both copy directions streamed
    h2d_gbps: float  # the copies' rate in each direction while those updates ran
    d2h_gbps: float

    @property
    def copies_slowdown(self) -> float:
        return self.beside_copies_s.median / self.alone_s.median

    def describe(self) -> str:
        return (f"CPU lane as the step runs it ({self.threads} threads, {self.subgroups} subgroups of "
                f"{self.elements / 1e6:g}M elements in turn): {self.alone_s.median / self.elements * 1e9:.3f} ns per "
                f"element alone, {self.copies_slowdown:.2f}x slower beside {self.h2d_gbps + self.d2h_gbps:.0f} GB/s of "
                "copies both ways")


class PinnedCopyProfile(Record):
    """Backward with each gradient partition copied asynchronously into page-locked host memory (in the training's
    half precision, on the stream DeepSpeed's own copies take) instead of DeepSpeed's copies: set against
    ``backward_no_copy_s`` and the node's page-locked copy rate, the share of such copies that backward does not
    hide."""

    bytes: int = Field(ge=0)  # copied in one backward
    backward_s: Stat


# The passes a probe round times and ``ModelProfile.pass_spread`` reads, by ``ProbeRound`` field, as a note names them
PROBE_PASSES = {"forward_s": "forward", "no_copy_s": "backward without copies",
                "beside_lane_s": "backward beside the CPU lane"}


class ProbeRound(Record):
    """One round of the backward probes (backward_probes.py): each pass's seconds, None where it did not run."""

    t_s: float  # when its first pass's backward started, seconds from the first kept round's
    forward_s: float  # the forward before the pass without copies
    no_copy_s: float  # backward without gradient copies
    pinned_copy_s: Optional[float] = None  # ... with page-locked copies (a GPU)
    beside_lane_s: Optional[float] = None  # ... beside the CPU lane
    lane_update_s: Optional[float] = None  # the median lane update inside that backward


class StepWindow(Record):
    """ZeRO-Offload's step timed again in later iterations of the same engine, after the backward probes: a second
    draw of the host's speed. The step's speed moves with the host's over minutes, within one process as much as
    between processes, and both methods' predicted steps lean on it (the measured step, CPU Adam's in-situ rate, the
    step overhead); the model takes the mean of the two draws."""

    after_s: float = Field(ge=0)  # seconds from the end of the first timed iterations to this window's first
    step_s: Stat  # the kept iterations' steps
    step_overhead_s: float  # their median overhead (as ModelProfile.step_overhead_s)
    ds_cpu_adam: Optional[Series] = None  # as ModelProfile.ds_cpu_adam, over this window's steps
    ds_unscale: Optional[Series] = None
    steal: Optional[float] = None
    set_aside: Optional[SetAside] = None


class WorldRecord(Record):
    """The world a model profile was measured in: one rank per GPU."""

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1)


class RankProfile(Record):
    """One rank's phases, in a profile measured under the launcher."""

    rank: int
    phases: dict[str, PhaseProfile]
    step_overhead_s: Optional[float] = None


class ModelProfile(Record):
    schema_version: int
    kind: Literal["dostune.model-profile"] = MODEL_KIND
    created: str
    command: str
    dostune_version: str
    mode: Optional[ModelMode] = None  # v12 (None: measured before profiles recorded a mode)
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
    # v3. Whether ZeRO-Offload's host buffers were page-locked (offload_optimizer.pin_memory): its gradient copies in
    # backward are then asynchronous, else blocking copies to pageable memory (None in older profiles: their notes say
    # "ZeRO-Offload measured with pin_memory false" when it was off).
    offload_pin_memory: Optional[bool] = None
    # v3. Backward with each gradient partition dropped on the device instead of copied to the host: the compute and
    # ZeRO-3's hooks without the offload's copies (after the timed iterations; no step follows them).
    backward_no_copy_s: Optional[Stat] = None
    backward_lane: Optional[BackwardLaneProfile] = None  # v3
    backward_pinned_copy: Optional[PinnedCopyProfile] = None  # v4, on a GPU (backward_probes.py)
    # v3. DeepSpeed's step outside the per-subgroup updates, by part (median seconds per step): its prologue helpers
    # (_pre_step, _partition_all_parameters, _overflow_check_and_loss_scale_update, _get_norm_groups,
    # _loss_scale_update_and_overflow_cleanup), its epilogue (_post_step) and "engine" (the engine's own work around
    # optimizer.step). They add up to step_overhead_s.
    step_parts_s: dict[str, float] = Field(default_factory=dict)
    # v3. DeepSpeedCPUAdam as ZeRO-Offload's step calls it (_optimizer_step) and its unscale (unscale_and_clip_grads):
    # host seconds per subgroup (one point per subgroup: its elements, the median over the timed iterations, the
    # threads it ran with), fitted like the node profile's series: the rates in this engine's own memory.
    ds_cpu_adam: Optional[Series] = None
    ds_unscale: Optional[Series] = None
    # v5. The share of the machine's CPU time the hypervisor took (steal, host_steal.py) during the timed iterations:
    # a miss of a prediction from this profile reads against it (None where /proc/stat has no steal)
    steal: Optional[float] = None
    # v6. Timed iterations, and rounds of the backward probes, set aside because the hypervisor took from them (another
    # ran in the place of each, host_steal.QuietRuns): the figures above are the kept ones', steal included
    set_aside: Optional[SetAside] = None
    probes_set_aside: Optional[SetAside] = None
    # v8. The seconds the probes' rounds were spread over (0: ``iterations`` rounds in a row), the forward before each
    # backward without copies over those rounds (the model's forward: the timed iterations, a few in a row, read one
    # stretch of the host's speed), and every kept round's readings
    probe_seconds: Optional[float] = None
    probe_forward_s: Optional[Stat] = None
    probe_rounds: list[ProbeRound] = Field(default_factory=list)
    step_lane: Optional[StepLaneProfile] = None  # v10, on a GPU (step_lane.py)
    # v11. The step timed again after the backward probes (one rank's; under the launcher the slowest rank's step)
    later_window: Optional[StepWindow] = None
    # v13. The global gradient norm DeepSpeed computed for clipping in each kept timed iteration, unscaled, in the order
    # run (None for a step it skipped: an overflow), and the clipping threshold those iterations ran with (0: off).
    # The model is freshly initialised, so these are the norms of a training's first steps.
    grad_norms: list[Optional[float]] = Field(default_factory=list)
    clip_threshold: Optional[float] = None
    notes: list[str] = Field(default_factory=list)

    @property
    def num_subgroups(self) -> int:
        return len(self.subgroups)

    @property
    def world_size(self) -> int:
        return self.world.nodes * self.world.gpus_per_node

    def pass_spread(self) -> dict[str, float]:
        """How far forward, backward without copies and backward beside the CPU lane each wandered over the probe
        rounds (schema 8): the interquartile range over the median, by ``ProbeRound`` field. Empty where a pass has
        fewer than four rounds (older profiles have none)."""
        out = {}
        for name in PROBE_PASSES:
            xs = [x for r in self.probe_rounds if (x := getattr(r, name)) is not None]
            if len(xs) >= 4:
                q1, _, q3 = statistics.quantiles(xs, n=4)
                out[name] = (q3 - q1) / statistics.median(xs)
        return out

    def clipped(self, threshold: float) -> Optional[tuple[int, int]]:
        """(how many, of how many) timed iterations clipping at ``threshold`` clips (``clipped_count``); None where the
        profile recorded no norm (schema 12 and older)."""
        return clipped_count(self.grad_norms, threshold)

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the profile ran with activation checkpointing (its notes say so)."""
        return any(n.startswith("activation checkpointing on") for n in self.notes)

    @property
    def offload_pinned(self) -> bool:
        """Whether ZeRO-Offload ran with page-locked host buffers: the v3 field, else (older profiles) the note that
        the model profile writes when it ran it without ("ZeRO-Offload measured with pin_memory false: ...")."""
        if self.offload_pin_memory is not None:
            return self.offload_pin_memory
        return not any("pin_memory false" in note for note in self.notes)


def clipped_count(norms: list[Optional[float]], threshold: float) -> Optional[tuple[int, int]]:
    """(how many, of how many) of ``norms`` (None: a skipped step, not counted) clipping at ``threshold`` clips, by
    DeepSpeed's test (norm + 1e-6 over the threshold, as its unscale_and_clip_grads scales); None without a norm. A
    threshold of 0 clips nothing."""
    known = [x for x in norms if x is not None]
    if not known:
        return None
    return sum(threshold > 0 and x + 1e-6 > threshold for x in known), len(known)


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
    return load_record(path, ModelProfile, "model profile", MODEL_KIND, MODEL_SCHEMA_VERSION, MODEL_READABLE_VERSIONS)
