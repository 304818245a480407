"""The schedule search: what is searched (declared once, in ``Space.choices``), how one candidate is scored, and the
exhaustive reference."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from ..dsconfig import DEFAULT_SUB_GROUP_SIZE
from ..errors import DostuneError
from ..optim.footprint import RESIDENT_BYTES
from ..optim.schedule import ScheduleConfig, full_swing, gpu_count, gpu_fraction_for, make_plan
from ..perfmodel.coefficients import Coefficients
from ..perfmodel.inputs import ModelInputs, NodeInputs
from ..perfmodel.lanes import REGIMES, Regime
from ..perfmodel.memory import GiB, grad_alloc_fractions, grad_ready_fractions
from ..perfmodel.model import Prediction, best_gpu_fraction, gpu_count_for_share, predict
from ..perfmodel.subgroups import subgroup_sizes
from ..perfmodel.world import World, node_pinned_gib
from ..perfmodel.zero_offload import ZeroOffloadPrediction, predict_zero_offload
from .regime import Scoring
from .limits import fit_speculation

SUB_GROUP_SIZES = (10_000_000, 25_000_000, 50_000_000, 100_000_000, 200_000_000, 400_000_000)
BUFFERS = (1, 2, 3, 4)
UPLOADS = ("gpu_convert", "cpu_convert")
# which subgroups the GPU lane takes (ScheduleConfig.gpu_placement): "spread" is the Deep Optimizer States paper's
# every k-th subgroup
PLACEMENTS = ("first", "spread", "last")
GPU_SHARE = "gpu_share"  # the GPU lane's share of the subgroups: a float in [0, 1] to Optuna, a count to a Candidate
# what each of Space.violations measures, in its order
LIMITS = ("the GPU memory budget of the step", "the peak GPU memory limit", "the node's pinned host memory")


@dataclass(frozen=True)
class Candidate:
    """One point of the search space. Its fields other than gpu_count are ``Space.choices``' parameters."""

    sub_group_size: int
    gpu_count: int  # subgroups on the GPU lane
    staging_buffers: int
    cpu_threads: int
    upload: str
    grads_on_gpu: bool
    overlap_backward: bool = False
    gpu_placement: str = "first"


class Space:
    """Everything the search needs, fixed for one (node, model, batch) problem."""

    def __init__(self, node: NodeInputs, model: ModelInputs, param_numels: list[int], budget_gib: Optional[float],
                 max_peak_gib: Optional[float], world: World = World(),
                 profile_subgroups: Optional[tuple[list[int], list[Optional[float]], float]] = None,
                 sub_group_sizes=SUB_GROUP_SIZES, host_budget_gib: Optional[float] = None):
        """``node``: one rank's inputs (perfmodel/world.py rank_inputs); ``host_budget_gib``: the pinned host memory
        the ranks of one node may hold together (None: unchecked)."""
        self.node, self.model = node, model
        self.numels = param_numels
        self._sizes: dict[int, tuple[int, ...]] = {}
        self.world = world
        self.world_size = world.size
        self.host_budget_gib = host_budget_gib
        total = sum(param_numels)
        self.sub_group_sizes = [s for s in sub_group_sizes if s < total] or [total]
        self.threads = sorted(t for t in node.cpu_adam if t * 2 >= max(node.cpu_adam))
        self.budget_gib, self.max_peak_gib = budget_gib, max_peak_gib
        self.ds_sub_group_size = model.ds_sub_group_size or DEFAULT_SUB_GROUP_SIZE
        # every coefficient of the model, from the two profiles (perfmodel/coefficients.py)
        self.coeffs = Coefficients.of(node, model, self.sizes(self.ds_sub_group_size))
        self.node = self.coeffs.node  # with CPU Adam at the rates the model's engine ran it, where measured
        self._profile_subgroups = profile_subgroups
        self._fractions: dict[int, tuple[Optional[tuple[float, ...]], Optional[tuple[float, ...]]]] = {}
        # what a candidate is scored by (tune/regime.py): its prediction in one regime, or the worse of the two
        self.regime: Scoring = "no_clip"

    def sizes(self, sub_group_size: int) -> tuple[int, ...]:
        if sub_group_size not in self._sizes:
            self._sizes[sub_group_size] = tuple(subgroup_sizes(self.numels, sub_group_size, self.world_size))
        return self._sizes[sub_group_size]

    def _profile_fractions(self, sub_group_size: int):
        """(first gradient, all gradients final) per subgroup as fractions of backward, from the model profile;
        (None, None) without one."""
        if sub_group_size not in self._fractions:
            alloc = ready = None
            if self._profile_subgroups is not None:
                psizes, pready, bwd = self._profile_subgroups
                sizes = self.sizes(sub_group_size)
                alloc = tuple(grad_alloc_fractions(sizes, psizes, pready, bwd))
                r = grad_ready_fractions(sizes, psizes, pready, bwd)
                ready = tuple(r) if r is not None else None
            self._fractions[sub_group_size] = (alloc, ready)
        return self._fractions[sub_group_size]

    def grad_alloc(self, sub_group_size: int) -> Optional[tuple[float, ...]]:
        return self._profile_fractions(sub_group_size)[0]

    def grad_ready(self, sub_group_size: int) -> Optional[tuple[float, ...]]:
        """When in backward each subgroup's gradients are all final (fractions), from the model profile."""
        return self._profile_fractions(sub_group_size)[1]

    def schedule(self, c: Candidate, resident: int = 0) -> ScheduleConfig:
        n = len(self.sizes(c.sub_group_size))
        # With overlap_backward every streamed GPU-lane subgroup may swing to the CPU lane, and every CPU-lane
        # subgroup to the GPU lane: the lane times measured at run time decide how many do (the model, fitted to one
        # profile, cannot know how fast the host runs that minute, nor whether clipping stops speculation). The
        # prediction keeps the tuned split: with "first" placement, moving the k highest GPU-lane subgroups gives
        # the lanes of the candidate with k fewer, which the search scores anyway, so the model's best split is
        # already its pick. Their shadow states count in the pinned host memory, the staging of the widest range in
        # the GPU memory. On the H100 with gpt2-1.3b the measured step fell from 0.106 to 0.099 s and from 0.104 to
        # 0.078 s with the swing (to the CPU lane) on.
        swing = full_swing(n, c.gpu_count, resident) if c.overlap_backward else 0
        base = ScheduleConfig(gpu_fraction=gpu_fraction_for(c.gpu_count, n), staging_buffers=c.staging_buffers,
                              gpu_placement=c.gpu_placement, cpu_threads=c.cpu_threads, upload=c.upload,
                              grads_on_gpu=c.grads_on_gpu,
                              overlap_backward=c.overlap_backward, resident_subgroups=resident, adaptive_swing=swing,
                              expected_subgroups=n)
        # how many CPU-lane subgroups speculate during backward: as many as the node's host budget holds (limits.py)
        return fit_speculation(self, c.sub_group_size, base)

    def _predict(self, c: Candidate, resident: int, regime: Regime = "no_clip") -> Prediction:
        return self.predict_schedule(c.sub_group_size, self.schedule(c, resident), regime)

    @property
    def regimes(self) -> tuple[Regime, ...]:
        """The regimes a candidate's score takes the worst of."""
        return REGIMES if self.regime == "both" else (self.regime,)

    def predict_schedule(self, sub_group_size: int, sched: ScheduleConfig, regime: Regime = "no_clip") -> Prediction:
        """The model's prediction for any schedule at ``sub_group_size`` on this node and model, in ``regime``."""
        return predict(self.sizes(sub_group_size), sub_group_size, sched, self.coeffs, self.model,
                       self.grad_alloc(sub_group_size), self.grad_ready(sub_group_size), regime)

    def zero_offload(self) -> ZeroOffloadPrediction:
        """DeepSpeed's ZeRO-Offload at the model profile's sub_group_size, as this host's memory holds it (the form
        the model profile ran it in)."""
        return predict_zero_offload(self.coeffs, self.model, self.sizes(self.ds_sub_group_size),
                                    self.ds_sub_group_size)

    def evaluate(self, c: Candidate) -> Prediction:
        """The candidate's prediction, with as many resident subgroups as the memory limits leave room for, in the
        regime it is scored by (the slower of its two predictions where ``regime`` is both)."""
        first = self._predict(c, 0, self.regimes[0])
        r = self.resident_room(c, first)
        return self.scored(c, r, first if not r else None)

    def scored(self, c: Candidate, resident: int, known: Optional[Prediction] = None) -> Prediction:
        """The candidate's prediction with ``resident`` resident subgroups in the regime it is scored by (``known``:
        that prediction in one regime, already made)."""
        preds = [known if known is not None and known.regime == g else self._predict(c, resident, g)
                 for g in self.regimes]
        return max(preds, key=lambda p: p.objective_s)

    def in_every_regime(self, p: Prediction) -> dict[Regime, Prediction]:
        """``p`` and its schedule's prediction in the other regime."""
        return {g: p if g == p.regime else self.predict_schedule(p.sub_group_size, p.schedule, g) for g in REGIMES}

    def candidate_of(self, sub_group_size: int, sched: ScheduleConfig) -> Candidate:
        """The candidate whose schedule ``sched`` is (its resident subgroups aside)."""
        return Candidate(sub_group_size=sub_group_size, gpu_count=gpu_count(len(self.sizes(sub_group_size)),
                                                                            sched.gpu_fraction),
                         staging_buffers=sched.staging_buffers, cpu_threads=sched.cpu_threads, upload=sched.upload,
                         grads_on_gpu=sched.grads_on_gpu, overlap_backward=sched.overlap_backward,
                         gpu_placement=sched.gpu_placement)

    def neighbours(self, sub_group_size: int, sched: ScheduleConfig) -> tuple[list[tuple[str, Prediction]], list[str]]:
        """The schedules one step from ``sched`` in each main knob, each either way where the space has the step: one
        GPU-lane subgroup fewer and more, the next smaller and larger sub_group_size (the same share of the elements
        on the GPU lane, and as many resident subgroups as the limits leave room for, as the search gives it), one
        resident subgroup fewer and more, and overlap_backward switched. Returns ((label, scored prediction) of each
        that meets the memory limits, a line for each that does not)."""
        c, r = self.candidate_of(sub_group_size, sched), sched.resident_subgroups
        sizes, n = self.sizes(sub_group_size), len(self.sizes(sub_group_size))
        moves: list[tuple[str, Candidate, Optional[int]]] = []  # resident None: as the search fills them
        for k in (c.gpu_count - 1, c.gpu_count + 1):
            if 0 <= k <= n:
                moves.append((f"GPU lane {k}/{n}", replace(c, gpu_count=k), min(r, k)))
        share = sum(sizes[i] for i in make_plan(n, sched).gpu_subgroups) / sum(sizes)
        ordered = sorted(self.sub_group_sizes)
        at = ordered.index(sub_group_size) if sub_group_size in ordered else None
        for j in ((at - 1, at + 1) if at is not None else ()):
            if 0 <= j < len(ordered):
                other = ordered[j]
                k = gpu_count_for_share(self.sizes(other), share, c.gpu_placement)
                moves.append((f"sub_group_size {other:.3g}", replace(c, sub_group_size=other, gpu_count=k), None))
        for k in (r - 1, r + 1):
            if 0 <= k <= c.gpu_count and (k == 0 or c.grads_on_gpu):
                moves.append((f"{k} resident", c, k))
        if c.overlap_backward or self.overlap_possible:
            switched = not c.overlap_backward
            moved = replace(c, overlap_backward=switched, **self.settled({"overlap_backward": switched}))
            moves.append(("overlap_backward " + ("on" if switched else "off"), moved, r))
        out, left_out, seen = [], [], {(sub_group_size, sched.model_dump_json())}
        for label, moved, resident in moves:
            p = self.evaluate(moved) if resident is None else self.scored(moved, resident)
            key = (p.sub_group_size, p.schedule.model_dump_json())
            if key in seen:
                continue
            seen.add(key)
            if self.feasible(p):
                out.append((label, p))
            else:
                over = [f"{what} by {v:.2f} GiB" for what, v in zip(LIMITS, self.violations(p)) if v > 0]
                left_out.append(f"{label}: predicted over " + " and ".join(over))
        return out, left_out

    def resident_room(self, c: Candidate, p: Prediction) -> int:
        """How many of the candidate's GPU-lane subgroups (in lane order) can keep their states on the GPU within the
        peak-memory limit and the step's budget, given its prediction without any: a resident subgroup streams nothing,
        so the model never finds more of them slower, and the search need not try fewer. 0 without a known limit, and
        unless the GPU lane takes the first subgroups (the ones DeepSpeed can keep on the GPU)."""
        if not c.grads_on_gpu or not c.gpu_count or c.gpu_placement != "first":
            return 0
        room = float("inf")
        if self.max_peak_gib is not None and p.memory.peak_gpu_gib is not None:
            room = self.max_peak_gib - p.memory.peak_gpu_gib
        if self.budget_gib is not None:
            room = min(room, self.budget_gib - p.memory.extra_step_gib)
        if room == float("inf") or room <= 0:
            return 0
        count, used = 0, 0.0
        for i in make_plan(len(p.sizes), p.schedule).gpu_subgroups:  # the tuned lanes, before any swing
            used += RESIDENT_BYTES * p.sizes[i] / GiB
            if used > room:
                break
            count += 1
        return count

    def violations(self, p: Prediction) -> list[float]:
        """Constraint values, <= 0 when satisfied (Optuna's convention): GiB over the staging budget, GiB over
        the peak limit, GiB of pinned host memory that the ranks of one node hold over the node's."""
        out = [p.memory.extra_step_gib - self.budget_gib if self.budget_gib is not None else -1.0]
        peak = p.memory.peak_gpu_gib
        out.append(peak - self.max_peak_gib if (self.max_peak_gib is not None and peak is not None) else -1.0)
        out.append(self.node_pinned_gib(p) - self.host_budget_gib if self.host_budget_gib is not None else -1.0)
        return out

    def node_pinned_gib(self, p: Prediction) -> float:
        return node_pinned_gib(p.memory.pinned_host_gib, self.world)

    def feasible(self, p: Prediction) -> bool:
        return all(v <= 0 for v in self.violations(p))

    def closed_form_candidates(self) -> Iterator[Candidate]:
        """The closed-form GPU share for each sub_group_size at the fastest CPU thread count: seeds for the search."""
        t = max(self.threads, key=lambda x: self.node.cpu_adam[x].rate)
        f = best_gpu_fraction(sum(self.numels), self.node, t)
        for sgs in self.sub_group_sizes:
            for buffers in (2, 4):
                yield Candidate(sgs, gpu_count_for_share(self.sizes(sgs), f), buffers, t, "gpu_convert", True)
            if self.overlap_possible:  # the CPU lane hides under backward: give it the larger share
                for buffers in (2, 4):
                    yield Candidate(sgs, gpu_count_for_share(self.sizes(sgs), f / 2), buffers, self.lane_threads or t,
                                    "gpu_convert", True, True)

    @property
    def overlap_possible(self) -> bool:
        """overlap_backward is only searched when the model profile says when gradients become final."""
        return self.model.bwd_s is not None and self.grad_ready(self.sub_group_sizes[0]) is not None

    @property
    def lane_threads(self) -> Optional[int]:
        """The CPU threads of every overlap_backward schedule: the step's count whose backward count (one fewer,
        ScheduleConfig.backward_cpu_threads) the model profile's lane probe ran with. The model knows the lane's rate
        at that count only; at another it could read it only through CPU Adam's rates, and on an H200 host the lane
        at 7 threads ran 1.9x slower than its 15-thread probe where CPU Adam's rates said 1.2x. None where the model
        profile has no lane probe: every count is searched."""
        t = self.model.lane_threads
        return self.node.threads_near(t + 1) if t is not None else None

    def settled(self, params: dict) -> dict:
        """The parameters that those in ``params`` fix: an overlap_backward schedule's threads (``lane_threads``)."""
        if params.get("overlap_backward") and self.lane_threads is not None:
            return {"cpu_threads": self.lane_threads}
        return {}

    def choices(self) -> dict[str, list]:
        """Every searched parameter but the GPU lane's share, with its values: the one declaration Optuna's trials,
        the exhaustive reference and the enqueued seeds all read. A parameter that those before it fix
        (``settled``) is not searched in that trial."""
        out = {"sub_group_size": list(self.sub_group_sizes), "gpu_placement": list(PLACEMENTS),
               "staging_buffers": list(BUFFERS), "upload": list(UPLOADS), "grads_on_gpu": [True, False]}
        if self.overlap_possible or self.model.bwd_s is None:
            # Without a model profile (the step alone is searched) an overlap_backward schedule is predicted with its
            # CPU lane wholly in the step: what it saves there is its host memory (no fp32 gradients on the CPU lane,
            # speculation only as far as the host holds it), which is what a model too large for ZeRO-Offload's host
            # memory needs.
            out["overlap_backward"] = [False, True]
        out["cpu_threads"] = list(self.threads)
        return out

    def candidate(self, params: dict) -> Candidate:
        """The candidate of a trial's parameters (``GPU_SHARE`` a float in [0, 1], the others ``choices``' less those
        ``settled``)."""
        n = len(self.sizes(params["sub_group_size"]))
        return Candidate(gpu_count=round(params[GPU_SHARE] * n),
                         **{k: v for k, v in {**params, **self.settled(params)}.items() if k != GPU_SHARE})

    def params(self, c: Candidate) -> dict:
        """A candidate as a trial's parameters (``candidate``'s inverse)."""
        n = len(self.sizes(c.sub_group_size))
        given = {k: getattr(c, k) for k in self.choices()}
        settled = self.settled(given)
        return {GPU_SHARE: c.gpu_count / n, **{k: v for k, v in given.items() if k not in settled}}

    def all_candidates(self) -> Iterator[Candidate]:
        choices = self.choices()
        names = [k for k in choices if k != "sub_group_size"]
        for sgs in choices["sub_group_size"]:
            for k in range(len(self.sizes(sgs)) + 1):
                for values in itertools.product(*(choices[name] for name in names)):
                    params = dict(zip(names, values))
                    if all(params[name] == v for name, v in self.settled(params).items()):
                        yield Candidate(sub_group_size=sgs, gpu_count=k, **params)


def brute_force(space: Space) -> tuple[Candidate, Prediction]:
    """Exhaustive search over the discrete space: the reference the tuner is tested against."""
    best = None
    for c in space.all_candidates():
        p = space.evaluate(c)
        if space.feasible(p) and (best is None or p.objective_s < best[1].objective_s):
            best = (c, p)
    if best is None:
        raise DostuneError("no schedule fits the GPU memory budget; raise --gpu-memory-budget or --max-peak-increase")
    return best
