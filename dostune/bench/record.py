"""The typed, versioned benchmark result (``results/<node>/bench-<model>.json``)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ..records import Record, SetAside, Span, load_record
from ..stats import Stat

# 2: rounds, and each method's per-iteration samples and per-round medians. 3: nodes, and each method's ranks under
# the launcher. 4: each method's share of CPU time the hypervisor took (steal). 5: the timed iterations set aside for
# steal. 6: each round's median step. 7: dostune's swing in each timed iteration. 8: each method's measured host peak
# (RSS and pinned). Older records still load: the new fields take their defaults.
BENCH_SCHEMA_VERSION = 8
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
BENCH_KIND = "dostune.bench"


class RankFigures(Record):
    """One rank's medians and peak memory, under the launcher."""

    rank: int
    iter_s: float
    fwd_s: float
    bwd_s: float
    step_s: float
    peak_gpu_gib: Optional[float] = None
    host_peak_rss_gib: Optional[float] = None  # v8


class MethodResult(Record):
    """One method's figures: medians over the timed iterations, with spread. Under the launcher: the slowest rank's
    (the one with the longest median iteration), its peak memory the highest of any rank, and every rank's own
    figures in ``ranks`` (the first round's)."""

    method: str
    description: str
    ran: bool = True
    error: Optional[str] = None
    iter_s: Optional[float] = None
    fwd_s: Optional[float] = None
    bwd_s: Optional[float] = None
    step_s: Optional[float] = None
    iter: Optional[Stat] = None
    fwd: Optional[Stat] = None
    bwd: Optional[Stat] = None
    step: Optional[Stat] = None
    peak_gpu_gib: Optional[float] = None
    phase_peak_gib: dict[str, float] = Field(default_factory=dict)  # peak allocated within fwd, bwd, step
    allocated_before_gib: Optional[float] = None  # GPU memory still held when this method started (leak check)
    # v8. The method's measured host peak (bench/host_peak.py): its process's peak resident set from the engine's
    # build to the end of the timed iterations, and the host memory page-locked for it (torch's pinned allocator's
    # peak, DeepSpeed's pinned buffers among it, and what dostune page-locked in place; None without CUDA). Under
    # the launcher: the highest of any rank, each rank's RSS in ``ranks``; over rounds: the highest.
    host_peak_rss_gib: Optional[float] = None
    host_pinned_gib: Optional[float] = None
    update_gelem_s: Optional[float] = None
    final_loss: Optional[float] = None
    losses: list[float] = Field(default_factory=list)
    ds_config: dict = Field(default_factory=dict)
    timeline: list[Span] = Field(default_factory=list)
    # Seconds of every timed iteration, per phase (fwd, bwd, step, iter), all rounds in the order they ran.
    samples: dict[str, list[float]] = Field(default_factory=dict)
    round_iter_s: list[float] = Field(default_factory=list)  # median iteration time of each round
    round_step_s: list[float] = Field(default_factory=list)  # v6. median step time of each round
    # v7. The swing (adaptive_swing) of each timed iteration, in the order of ``samples``: k > 0, k of the GPU lane's
    # streamed subgroups on the CPU lane; k < 0 (records since the swing moves both ways), -k of the CPU lane's
    # subgroups on the GPU lane. Which split a process settled into, which may differ from one process to the next.
    # Empty for a method without a swing.
    swing: list[int] = Field(default_factory=list)
    # v4. The share of the machine's CPU time the hypervisor took (steal, host_steal.py) during the timed iterations:
    # the rounds' mean, and each round's (None, empty where /proc/stat has no steal, or in older records)
    steal: Optional[float] = None
    round_steal: list[float] = Field(default_factory=list)
    # v5. The timed iterations set aside because the hypervisor took from them (another ran in the place of each;
    # samples and steal are the kept ones'), every round's together (None in older records)
    set_aside: Optional[SetAside] = None
    ranks: list[RankFigures] = Field(default_factory=list)  # empty for a world of one
    slowest_rank: Optional[int] = None


class BenchResult(Record):
    schema_version: int = BENCH_SCHEMA_VERSION
    kind: Literal["dostune.bench"] = BENCH_KIND
    created: str
    command: str
    dostune_version: str
    deepspeed_version: Optional[str]
    torch_version: str
    node: str
    gpu: Optional[str]
    model: str
    params: int
    micro_batch: int
    seq: int
    precision: str
    clip: float = 1.0  # gradient clipping of every method (records before it existed used 1.0)
    world_size: int = 1  # ranks (one per GPU); every method ran on each, figures are the slowest rank's
    nodes: int = 1
    warmup: int
    iters: int  # timed iterations per method and round
    rounds: int = 1  # every method measured this many times, the order reversed every other round
    seed: int
    methods: dict[str, MethodResult]

    def _both_ran(self, method: str, other: str) -> Optional[tuple[MethodResult, MethodResult]]:
        a, b = self.methods.get(method), self.methods.get(other)
        return (a, b) if a and b and a.ran and b.ran and a.iter_s and b.iter_s else None

    def speedup(self, method: str, baseline: str = "zero-offload") -> Optional[float]:
        pair = self._both_ran(method, baseline)
        return None if pair is None else pair[1].iter_s / pair[0].iter_s

    def over_ceiling(self, method: str, ceiling: str = "no-offload") -> Optional[tuple[float, list[float]]]:
        """The method's iteration time over no offload's: pooled, and per round. A round measures both methods one
        after the other (the order reversed every other round), so each round's ratio is taken across minutes,
        not across the whole run, on a machine whose speed drifts."""
        pair = None if method == ceiling else self._both_ran(method, ceiling)
        if pair is None:
            return None
        a, b = pair
        per_round = [x / y for x, y in zip(a.round_iter_s, b.round_iter_s) if y]
        return a.iter_s / b.iter_s, per_round


def load_bench(path) -> BenchResult:
    # an older record is read as this version: its new fields take their defaults
    return load_record(path, BenchResult, "bench result", BENCH_KIND, BENCH_SCHEMA_VERSION, READABLE_VERSIONS,
                       upgrade=True)
