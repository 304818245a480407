"""The interleaved optimizer's schedule: which subgroups go to which lane, in which order, through
which staging buffer. Pure logic, no tensors, so it is tested on any machine.

The schedule lives in the top-level ``dostune`` section of a DeepSpeed config::

    "dostune": {"version": 1, "gpu_fraction": 0.25, "staging_buffers": 2, "cpu_threads": 16,
                "upload": "gpu_convert", "grads_on_gpu": true}

DeepSpeed ignores top-level keys it does not know, so the same file drives plain DeepSpeed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigError

SECTION = "dostune"
SCHEDULE_VERSION = 1
CPU, GPU = "cpu", "gpu"
# Keys of earlier versions whose features lost their measurements and were deleted; a config that still has one
# is refused with this reason rather than as an unknown key.
REMOVED_KEYS = {
    "prefetch_states": "streaming the GPU lane's states in during backward saved 15 ms of step but slowed backward "
                       "by 90 ms on gpt2-1.3b",
    "backward_gpu_subgroups": "the GPU lane during backward emptied the step but slowed backward by more",
}


class ScheduleConfig(BaseModel):
    """The ``dostune`` section of a DeepSpeed config."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = SCHEDULE_VERSION
    gpu_fraction: float = Field(0.25, ge=0.0, le=1.0, description=(
        "share of subgroups updated on the GPU each step, spread evenly (1/k = every k-th subgroup)"))
    staging_buffers: int = Field(2, ge=1, le=16, description=(
        "GPU staging slots for GPU-lane subgroups: the next one streams in while one updates and "
        "another streams out"))
    gpu_placement: Literal["first", "spread", "last"] = Field("first", description=(
        "which subgroups the GPU lane takes: the first ones (their gradients are final last in backward, so "
        "keeping them on the GPU adds least to peak memory), evenly spread (the paper's every k-th), or the last"))
    cpu_threads: Optional[int] = Field(None, ge=1, description="OpenMP threads for CPU Adam (default: torch's)")
    upload: Literal["gpu_convert", "cpu_convert"] = Field("gpu_convert", description=(
        "how CPU-updated subgroups reach the GPU's half-precision params: upload fp32 and convert on the "
        "GPU, or convert on the CPU and upload half precision"))
    grads_on_gpu: bool = Field(True, description=(
        "keep GPU-lane subgroups' gradients on the GPU after backward instead of offloading them (the resident "
        "subgroups' are on the GPU either way)"))
    overlap_backward: bool = Field(False, description=(
        "update CPU-lane subgroups during backward, each as soon as its gradients are final (the last layers "
        "first), into shadow buffers that the step commits once the global gradient norm shows no clipping and "
        "no overflow (else they are recomputed exactly). Costs 12 bytes of host memory per CPU-lane parameter"))
    backward_cpu_threads: Optional[int] = Field(None, ge=1, description=(
        "CPU Adam threads while backward still runs (default: one fewer than cpu_threads, leaving a core to "
        "backward's own host work)"))
    speculative_subgroups: Optional[int] = Field(None, ge=0, description=(
        "with overlap_backward: how many CPU-lane subgroups are updated during backward, speculatively, into shadow "
        "buffers (those whose gradients are final first: the highest indices); the others are updated at the step, "
        "in place, beside the GPU lane. Each speculating subgroup costs 12 bytes of host memory per parameter "
        "(its shadow states); unset (the default): every subgroup the CPU lane may update speculates"))
    resident_subgroups: int = Field(0, ge=0, description=(
        "how many GPU-lane subgroups (the first ones) keep their fp32 params, gradients and Adam states on the GPU "
        "for the whole run, with no copy in host memory: their update streams nothing over PCIe. DeepSpeed builds "
        "them there (its Twin-Flow placement: zero_optimization.offload_optimizer.ratio, which dostune tune writes "
        "from this count). Costs 16 bytes of GPU memory per parameter of those subgroups (dostune tune spends the "
        "peak-memory allowance --max-peak-increase on it) and saves as much host memory. Needs gpu_placement first"))
    adaptive_swing: int = Field(0, ge=0, description=(
        "let up to this many subgroups move between the lanes from step to step, either way: the CPU lane takes "
        "the GPU lane's streamed subgroups (the highest indices, whose gradients are final first) while the "
        "measured lane times predict that the step then ends sooner, and the GPU lane takes the CPU lane's (the "
        "lowest indices, the CPU lane's last work in the step) while the CPU lane ends last, streamed through "
        "its staging slots; decided between steps from the last 3 steps. Each subgroup updates to the same values "
        "in either lane. Costs 12 bytes of host memory per parameter of the GPU-lane subgroups it may move with "
        "overlap_backward, and GPU memory for the widest subgroup (and its gradients) in the staging slots. Needs "
        "a CUDA device to measure (elsewhere the split stays as tuned); 0 (off) by default; dostune tune sets it to "
        "the most either lane can hand over with overlap_backward"))
    expected_subgroups: Optional[int] = Field(None, ge=1, description=(
        "number of subgroups the schedule was tuned for; checked against the model at start-up"))
    trace: bool = Field(False, description="record per-subgroup lane timings (for the timeline plot)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_keys(cls, data):
        if isinstance(data, dict):
            for key, why in REMOVED_KEYS.items():
                if key in data:
                    raise ValueError(f"'{key}' was removed from dostune ({why}): delete it from the dostune section")
        return data

    @model_validator(mode="after")
    def _resident_subgroups_come_first(self) -> "ScheduleConfig":
        if self.resident_subgroups and self.gpu_placement != "first":
            raise ValueError("resident_subgroups needs gpu_placement 'first' (DeepSpeed keeps the first subgroups' "
                             "state on the GPU)")
        return self

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> Optional["ScheduleConfig"]:
        """The schedule in a DeepSpeed config dict, or None if it has no ``dostune`` section."""
        section = ds_config.get(SECTION)
        if section is None:
            return None
        if not isinstance(section, dict):
            raise ConfigError(f"the '{SECTION}' section of the DeepSpeed config must be an object, "
                              f"got {type(section).__name__}")
        try:
            return cls.model_validate(section)
        except ValidationError as e:
            problems = "; ".join((f"'{SECTION}.{'.'.join(map(str, err['loc']))}': " if err["loc"] else f"'{SECTION}': ")
                                 + err["msg"].removeprefix("Value error, ") for err in e.errors())
            raise ConfigError(f"invalid DeepSpeed config: {problems}") from None


_EPS = 1e-9  # so that f = 1/3 gives exactly every 3rd subgroup despite rounding


def gpu_count(num_subgroups: int, gpu_fraction: float) -> int:
    """How many subgroups ``gpu_fraction`` puts on the GPU lane: floor(n f)."""
    return math.floor(num_subgroups * gpu_fraction + _EPS)


def gpu_fraction_for(count: int, num_subgroups: int) -> float:
    """The ``gpu_fraction`` that puts exactly ``count`` of ``num_subgroups`` subgroups on the GPU lane: the one
    conversion from a subgroup count (what the tuner searches) to the config's form (gpu_count's inverse)."""
    return min(1.0, count / num_subgroups) if num_subgroups else 0.0


def twin_flow_gpu_subgroups(ratio: float, num_subgroups: int) -> int:
    """How many subgroups DeepSpeed 0.19.8 builds on the GPU at ``zero_optimization.offload_optimizer.ratio``
    ``ratio`` (its Twin-Flow placement): the first int((1 - ratio) * n). The rest are offloaded to the host."""
    return int((1 - ratio) * num_subgroups)


def resident_offload_ratio(resident: int, num_subgroups: int) -> float:
    """The ``offload_optimizer.ratio`` at which DeepSpeed builds exactly the first ``resident`` of ``num_subgroups``
    subgroups on the GPU (twin_flow_gpu_subgroups' inverse): the one with the fewest decimals, 1.0 for none."""
    if not 0 <= resident <= num_subgroups:
        raise ValueError(f"resident must be in [0, {num_subgroups}], got {resident}")
    if resident == 0:
        return 1.0
    n = num_subgroups
    for digits in range(1, 16):
        scale = 10 ** digits
        top = math.floor((n - resident) / n * scale)
        # the largest decimals at or below (n - resident) / n; the one below it where rounding lands on the edge
        for k in (top, top - 1):
            if twin_flow_gpu_subgroups(k / scale, n) == resident:
                return k / scale
    raise ValueError(f"no offload ratio keeps exactly {resident} of {n} subgroups on the GPU")


def resident_placement_problem(ratio: float, num_subgroups: int, sched: "ScheduleConfig") -> Optional[str]:
    """Why DeepSpeed at ``offload_optimizer.ratio`` ``ratio`` would not build exactly the schedule's resident
    subgroups on the GPU (None: it would): their state must be where DeepSpeed builds it, and no other's."""
    on_gpu = twin_flow_gpu_subgroups(ratio, num_subgroups)
    r = sched.resident_subgroups
    if on_gpu == r:
        return None
    want = repr(resident_offload_ratio(r, num_subgroups)) if r <= num_subgroups else "1.0 and fewer resident_subgroups"
    return (f"offload_optimizer.ratio {ratio:g} keeps {on_gpu} of the {num_subgroups} subgroups on the GPU, but "
            f"resident_subgroups is {r} (DeepSpeed keeps the first int((1 - ratio) * subgroups) on the GPU: set the "
            f"ratio to {want})")


def assign_lanes(num_subgroups: int, gpu_fraction: float, placement: str = "spread") -> list[str]:
    """Lane of each subgroup; gpu_count(n, f) = floor(n*f) of them go to the GPU.

    ``spread``: subgroup i goes to the GPU when floor((i+1)*f) > floor(i*f); with f = 1/k that is every
    k-th subgroup, the last of each run of k, as in the Deep Optimizer States paper. ``first`` / ``last``:
    the lowest / highest indices. The two lanes run independently during the step, so placement does not
    change the step's critical path; it decides when in backward the GPU-lane gradients become final."""
    if num_subgroups < 0:
        raise ValueError("num_subgroups must be >= 0")
    if not 0.0 <= gpu_fraction <= 1.0:
        raise ValueError(f"gpu_fraction must be in [0, 1], got {gpu_fraction}")
    count = gpu_count(num_subgroups, gpu_fraction)
    if placement == "first":
        return [GPU if i < count else CPU for i in range(num_subgroups)]
    if placement == "last":
        return [GPU if i >= num_subgroups - count else CPU for i in range(num_subgroups)]
    if placement != "spread":
        raise ValueError(f"placement must be first, spread or last, got {placement!r}")
    return [GPU if gpu_count(i + 1, gpu_fraction) > gpu_count(i, gpu_fraction) else CPU for i in range(num_subgroups)]


class GpuSlot(NamedTuple):
    """One GPU-lane subgroup: the staging slot it uses and the earlier GPU subgroup whose write-back
    must finish before that slot can be refilled (None for the first pass over the slots). A named tuple: the
    footprint builds a plan for every swing of a schedule, the tuner that for every candidate."""

    subgroup: int
    slot: int
    waits_for: Optional[int]


@dataclass(frozen=True)
class Plan:
    lanes: list[str]
    cpu_order: list[int]
    gpu_slots: list[GpuSlot]  # the GPU-lane subgroups whose states stream through staging slots
    resident: tuple[int, ...] = ()  # the GPU-lane subgroups whose states stay on the GPU
    # GPU-lane subgroups that the GPU lane could not get device memory for at this step: updated on the host with
    # DeepSpeed's own update instead (a plan for one step only, see step.py); in no other list.
    fallback: tuple[int, ...] = ()
    # CPU-lane subgroups the GPU lane takes in this plan (a negative swing): streamed like its own, their gradients
    # offloaded in backward as a CPU-lane subgroup's are and streamed in with the states; also in gpu_slots.
    lent: tuple[int, ...] = ()
    # The streamed GPU-lane subgroups adaptive_swing may move to the CPU lane (a positive swing), and the CPU-lane
    # subgroups it may move to the GPU lane (a negative one), each in the order it does: the same for every swing of
    # one schedule, so not part of a plan's identity.
    swing_candidates: tuple[int, ...] = field(default=(), compare=False)
    lend_candidates: tuple[int, ...] = field(default=(), compare=False)

    @property
    def gpu_subgroups(self) -> list[int]:
        """Every GPU-lane subgroup, in the order the step queues them: the resident ones first (they need no
        copy, so their updates run while the others' states stream in)."""
        return list(self.resident) + [s.subgroup for s in self.gpu_slots]

    @property
    def first_fills(self) -> list[GpuSlot]:
        """The GPU subgroups that fill a fresh staging slot (the ones whose states can be prefetched)."""
        return [s for s in self.gpu_slots if s.waits_for is None]

    @property
    def swing_range(self) -> range:
        """Every swing this schedule's plans may run: -len(lend_candidates) .. len(swing_candidates)."""
        return range(-len(self.lend_candidates), len(self.swing_candidates) + 1)


def updates_in_backward(plan: Plan, sched: ScheduleConfig) -> bool:
    """Whether the CPU lane runs during backward (overlap_backward, with any subgroup it may update)."""
    return sched.overlap_backward and bool(plan.cpu_order or plan.swing_candidates or plan.lend_candidates)


def kept_gradients(plan: Plan, grads_on_gpu: bool) -> frozenset:
    """The streamed GPU-lane subgroups whose gradients backward keeps on the GPU (grads_on_gpu): all but the lent ones.
    (A resident subgroup's gradients are on the GPU whatever grads_on_gpu says: DeepSpeed's own buffer is there.)"""
    streamed = frozenset(s.subgroup for s in plan.gpu_slots)
    return streamed.difference(plan.lent) if grads_on_gpu else frozenset()


def streamed_gradients(plan: Plan, grads_on_gpu: bool) -> frozenset:
    """The streamed GPU-lane subgroups whose gradients stream in from DeepSpeed's fp32 host buffer with their states:
    every one without grads_on_gpu, else the lent ones."""
    streamed = frozenset(s.subgroup for s in plan.gpu_slots)
    return streamed.difference(kept_gradients(plan, grads_on_gpu))


def host_half_gradients(num_subgroups: int, sched: ScheduleConfig) -> frozenset:
    """The subgroups whose gradients stay in DeepSpeed's half-precision gradient-partition buffer on the host, with no
    fp32 host buffer of their own (4 bytes per element less host memory): with the CPU lane in backward, every
    subgroup the CPU lane starts with, wherever a swing puts it (the CPU lane reads them there, and lent to the GPU
    lane they stream in from there). Empty without overlap_backward: the CPU lane at the step reads DeepSpeed's fp32
    buffer."""
    plan = make_plan(num_subgroups, sched)
    return frozenset(plan.cpu_order) if updates_in_backward(plan, sched) else frozenset()


def swing_candidates(num_subgroups: int, sched: ScheduleConfig) -> list[int]:
    """The GPU-lane subgroups adaptive_swing may hand to the CPU lane, in the order it does."""
    return list(make_plan(num_subgroups, sched).swing_candidates)


def full_swing(num_subgroups: int, gpu_subgroups: int, resident: int) -> int:
    """The ``adaptive_swing`` that lets every streamed GPU-lane subgroup move to the CPU lane and every CPU-lane
    subgroup to the GPU lane (``gpu_subgroups`` of ``num_subgroups`` on the GPU lane, ``resident`` of them
    resident); 0 without a streamed GPU-lane subgroup (make_plan: nothing can move either way)."""
    gpu = min(gpu_subgroups, num_subgroups)
    return max(gpu - resident, num_subgroups - gpu) if gpu > resident else 0


def make_plan(num_subgroups: int, sched: ScheduleConfig, swing: int = 0, fallback: frozenset = frozenset()) -> Plan:
    """The lanes, CPU-lane order and GPU-lane staging chain. ``swing`` k > 0: the first k of the GPU lane's
    ``swing_candidates`` go to the CPU lane; k < 0: the first -k of the CPU lane's ``lend_candidates`` go to the
    GPU lane (``lent``), streamed like its own. The GPU-lane subgroups in ``fallback`` go to the plan's ``fallback``
    (the others keep their places: no streamed subgroup becomes resident)."""
    lanes = assign_lanes(num_subgroups, sched.gpu_fraction, sched.gpu_placement)
    gpu = [i for i, lane in enumerate(lanes) if lane == GPU]
    if sched.resident_subgroups > len(gpu):
        raise ConfigError(f"resident_subgroups is {sched.resident_subgroups} but the GPU lane has only {len(gpu)} "
                          f"subgroups (gpu_fraction {sched.gpu_fraction} of {num_subgroups})",
                          hint="lower resident_subgroups or raise gpu_fraction")
    own_resident = gpu[:sched.resident_subgroups]
    # The CPU lane takes the streamed ones (resident subgroups keep their states on the GPU), highest index first:
    # their gradients are final first, nearest the CPU lane's. The GPU lane takes the CPU lane's lowest indices
    # first: their gradients are final last, so they are the CPU lane's last work in the step (balance.py says why);
    # only a GPU lane that streams subgroups takes any (the staging slots, and the measured cost of one more).
    own_streamed = gpu[sched.resident_subgroups:]
    candidates = tuple(sorted(own_streamed, reverse=True)[:sched.adaptive_swing])
    lend = tuple([i for i, lane in enumerate(lanes) if lane == CPU][:sched.adaptive_swing]) if own_streamed else ()
    if not -len(lend) <= swing <= len(candidates):
        raise ValueError(f"swing {swing} is outside this schedule's range {-len(lend)}..{len(candidates)}")
    for i in candidates[:max(swing, 0)]:
        lanes[i] = CPU
    lent = lend[:max(-swing, 0)]
    for i in lent:
        lanes[i] = GPU
    cpu_order = [i for i, lane in enumerate(lanes) if lane == CPU]
    gpu = [i for i, lane in enumerate(lanes) if lane == GPU]
    moved = tuple(i for i in gpu if i in fallback)
    for i in moved:
        lanes[i] = CPU
    resident = tuple(i for i in own_resident if i not in fallback)
    skip = fallback.union(own_resident)
    streamed = [i for i in gpu if i not in skip]
    n = sched.staging_buffers
    slots = [GpuSlot(subgroup=sg, slot=k % n, waits_for=streamed[k - n] if k >= n else None)
             for k, sg in enumerate(streamed)]
    return Plan(lanes=lanes, cpu_order=cpu_order, gpu_slots=slots, resident=resident, fallback=moved,
                lent=tuple(i for i in lent if i not in fallback), swing_candidates=candidates, lend_candidates=lend)
