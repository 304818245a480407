"""`dostune plan`: the host RAM, pinned memory and GPU memory each way of offloading the optimizer state needs on a
node, and whether it fits there, worked out from the profiles before anything is allocated (no GPU needed).

The methods: DeepSpeed's ZeRO-Offload with its host buffers pinned and pageable (offload_optimizer.pin_memory),
Twin-Flow (offload_optimizer.ratio) keeping as much of the optimizer state on the GPU as fits, and dostune's pick
(the tuner's own search, its study kept in memory). Host memory is counted by the optimizer's footprints
(optim/footprint.py), as the optimizer's start-up check, the tuner and the bench count it. The GPU peak is
ZeRO-Offload's as the model profile measured it, Twin-Flow's that plus the state it keeps on the GPU, dostune's the
performance model's prediction. Without a model profile the GPU peaks are floors: what each method keeps on the GPU
between steps (the half-precision parameter partition and the optimizer state it keeps there), activations not
included; the plan says so.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from typing import Callable, Literal, Optional, Sequence

from pydantic import Field

from ._version import __version__
from .dsconfig import DEFAULT_SUB_GROUP_SIZE, check_precision
from .errors import DostuneError, ProfileError
from .invocation import invocation
from .models.registry import resolve_model
from .optim.footprint import (HALF_BYTES, HOST_BASE_BYTES, deepspeed_gpu_state_bytes, deepspeed_offload_host_bytes,
                              deepspeed_offload_pinned_bytes, gpu_step_bytes, grad_buffer_bytes, pinned_host_bytes)
from .optim.schedule import ScheduleConfig, make_plan, resident_offload_ratio
from .perfmodel.inputs import ModelInputs
from .perfmodel.memory import GiB, predict_memory
from .perfmodel.subgroups import param_numels, subgroup_sizes
from .perfmodel.world import World, host_memory_gib
from .profile.record import NodeProfile
from .profile.timing import NullProgress, ProgressSink
from .records import Record
from .tune.limits import HostTooSmall, gpu_capacity_gib, least_host, unprofiled_step_ceiling_gib, usable_gpu_gib
from .tune.record import TrialRecord
from .tune.search import TuneOptions, build_space, emit_config, ranked, resolve_profiles, run_settings, trial_record
from .tune.study import run_study
from .tune.world import host_budget

PLAN_SCHEMA_VERSION = 1
PLAN_KIND = "dostune.memory-plan"
HOST, GPU = "host RAM", "GPU memory"  # the resources a method may fall short of


class MethodNeeds(Record):
    """What one method needs on one rank (the node's ranks together: ``gpus_per_node`` times the host figures)."""

    method: Literal["zero-offload", "zero-offload-pageable", "twin-flow", "dostune"]
    label: str
    sub_group_size: int
    host_gib: float  # host RAM, the process itself included
    pinned_gib: float  # of which page-locked
    gpu_peak_gib: Optional[float]
    gpu_peak_floor: bool = False  # no model profile: what the method keeps on the GPU, activations not included
    fits: bool
    short_of: list[str] = Field(default_factory=list)  # what it does not fit: HOST, GPU
    ratio: Optional[float] = None  # DeepSpeed's offload_optimizer.ratio
    pin_memory: Optional[bool] = None  # DeepSpeed's offload_optimizer.pin_memory
    schedule: Optional[dict] = None  # dostune's section
    subgroups: Optional[int] = None  # dostune's, at its sub_group_size
    predicted_iter_s: Optional[float] = None  # dostune's pick, with a model profile


class MemoryPlan(Record):
    schema_version: int = PLAN_SCHEMA_VERSION
    kind: Literal["dostune.memory-plan"] = PLAN_KIND
    created: str
    command: str
    dostune_version: str
    node: str
    node_profile: str
    model_profile: Optional[str]
    model: str
    params: int
    micro_batch: int
    seq: Optional[int]
    precision: str
    activation_checkpointing: bool
    world: dict
    host_available_gib: float  # the node's host memory available when it was profiled
    host_usable_gib: float  # what the node's ranks may take of it together
    gpu_gib: Optional[float]
    gpu_usable_gib: Optional[float]  # what a method's peak may reach: the GPU's less the headroom
    methods: list[MethodNeeds]
    twin_flow_ratios: Optional[tuple[float, float]] = None  # the lowest and the highest ratio that fit
    # ZeRO-Offload's iteration in the form the model profile ran it, beside dostune's predicted_iter_s
    zero_offload_iter_s: Optional[float] = None
    estimated: list[str] = Field(default_factory=list)  # what is estimated, and from what
    notes: list[str] = Field(default_factory=list)
    details: list[str] = Field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.world["gpus_per_node"]


def _last_true(n: int, ok: Callable[[int], bool]) -> Optional[int]:
    """The largest k in [0, n] with ok(k), for ok true up to some k and false beyond (None: true nowhere)."""
    if not ok(0):
        return None
    lo, hi = 0, n
    while hi > lo:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _first_true(n: int, ok: Callable[[int], bool]) -> Optional[int]:
    """The smallest k in [0, n] with ok(k), for ok false up to some k and true beyond (None: true nowhere)."""
    if not ok(n):
        return None
    lo, hi = 0, n
    while hi > lo:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


class _Node:
    """What a node holds: its ranks' host memory together, and each rank's GPU."""

    def __init__(self, host_usable_gib: float, gpu_usable_gib: Optional[float], ranks: int):
        self.host, self.gpu, self.ranks = host_usable_gib, gpu_usable_gib, ranks

    def host_fits(self, host_gib: float) -> bool:
        return host_gib * self.ranks <= self.host

    def gpu_fits(self, peak_gib: Optional[float]) -> bool:
        return self.gpu is None or peak_gib is None or peak_gib <= self.gpu

    def short_of(self, host_gib: float, peak_gib: Optional[float]) -> list[str]:
        return ([] if self.host_fits(host_gib) else [HOST]) + ([] if self.gpu_fits(peak_gib) else [GPU])


def _host_gib(nbytes: int) -> float:
    return (nbytes + HOST_BASE_BYTES) / GiB


def deepspeed_rows(sizes: Sequence[int], sub_group_size: int, grad_buffer: int, gpu_base_gib: Optional[float],
                   floor: bool, node: _Node) -> tuple[list[MethodNeeds], Optional[tuple[float, float]]]:
    """ZeRO-Offload pinned and pageable, and Twin-Flow keeping on the GPU as many subgroups as fit there (pinned
    where the host holds that, as bench runs it), with the lowest and highest ratio that fit. ``gpu_base_gib``:
    ZeRO-Offload's GPU peak (with ``floor``, what it keeps on the GPU)."""
    rows = []
    for pin in (True, False):
        host = _host_gib(deepspeed_offload_host_bytes(sizes, pin, grad_buffer))
        short = node.short_of(host, gpu_base_gib)
        rows.append(MethodNeeds(method="zero-offload" if pin else "zero-offload-pageable",
                                label=f"ZeRO-Offload, {'pinned' if pin else 'pageable'}", sub_group_size=sub_group_size,
                                host_gib=host, pinned_gib=deepspeed_offload_pinned_bytes(sizes, grad_buffer) / GiB
                                if pin else 0.0, gpu_peak_gib=gpu_base_gib, gpu_peak_floor=floor, fits=not short,
                                short_of=short, ratio=1.0, pin_memory=pin))
    n = len(sizes)

    def gpu(k: int) -> Optional[float]:
        if gpu_base_gib is None:
            return None
        return gpu_base_gib + deepspeed_gpu_state_bytes(sizes, resident_offload_ratio(k, n)) / GiB

    def host(k: int, pin: bool) -> float:
        return _host_gib(deepspeed_offload_host_bytes(sizes, pin, grad_buffer, resident_offload_ratio(k, n)))

    # k subgroups kept on the GPU: its memory grows with k, the host's falls
    most = _last_true(n, lambda k: node.gpu_fits(gpu(k)))
    fewest = _first_true(n, lambda k: node.host_fits(host(k, False)))
    k = most or 0
    pin = node.host_fits(host(k, True))
    r, h = resident_offload_ratio(k, n), host(k, pin)
    short = node.short_of(h, gpu(k))
    rows.append(MethodNeeds(method="twin-flow", label=f"Twin-Flow, ratio {r:g}, {'pinned' if pin else 'pageable'}",
                            sub_group_size=sub_group_size, host_gib=h,
                            pinned_gib=deepspeed_offload_pinned_bytes(sizes, grad_buffer, r) / GiB if pin else 0.0,
                            gpu_peak_gib=gpu(k), gpu_peak_floor=floor, fits=not short, short_of=short, ratio=r,
                            pin_memory=pin))
    return rows, (r, resident_offload_ratio(fewest, n)) if not short and fewest is not None else None


def dostune_needs(label: str, sub_group_size: int, sizes: Sequence[int], sched: ScheduleConfig,
                  m: Optional[ModelInputs], grad_buffer: int, node: _Node, peak_gib: Optional[float] = None,
                  iter_s: Optional[float] = None) -> MethodNeeds:
    """A dostune schedule's needs: every byte of its optimizer's host memory page-locked in place; its GPU peak as
    ``peak_gib`` gives it (the search's prediction), else as the performance model predicts it from the model
    profile, else (no model profile) the floor: the parameter partition and what the step holds on the GPU."""
    plan = make_plan(len(sizes), sched)
    pinned = pinned_host_bytes(sizes, plan, sched, grad_buffer)
    if m is None:
        peak = (HALF_BYTES * sum(sizes) + gpu_step_bytes(sizes, plan, sched)) / GiB
    else:
        peak = peak_gib if peak_gib is not None else predict_memory(sizes, sched, m, plan=plan).peak_gpu_gib
    short = node.short_of(_host_gib(pinned), peak)
    return MethodNeeds(method="dostune", label=label, sub_group_size=sub_group_size, host_gib=_host_gib(pinned),
                       pinned_gib=pinned / GiB, gpu_peak_gib=peak, gpu_peak_floor=m is None, fits=not short,
                       short_of=short, schedule=sched.model_dump(exclude_none=True), subgroups=len(sizes),
                       predicted_iter_s=iter_s)


def _nearest(space, study) -> Optional[TrialRecord]:
    """The trial that came nearest to the limits (the least memory over them, GiB), where none met them."""
    best = None
    for t in study.trials:
        if t.state.name != "COMPLETE":
            continue
        c = space.candidate(t.params)
        p = space.evaluate(c)
        over = sum(max(0.0, v) for v in space.violations(p))
        if best is None or over < best[0]:
            best = (over, trial_record(space, p, t.number))
    return best[1] if best else None


def memory_plan(opts: TuneOptions, progress: Optional[ProgressSink] = None) -> tuple[MemoryPlan, Optional[dict]]:
    """The memory plan of ``opts``' model on its node and world, and the DeepSpeed config of dostune's pick (None
    when it does not fit). Nothing is written."""
    progress = progress or NullProgress()
    if opts.trials < 1:
        raise DostuneError(f"--trials must be at least 1, got {opts.trials}")
    check_precision(opts.precision, hint="leave --precision out for the model profile's (bf16 without one)")
    world = opts.world()
    node_p, node_path, model_p, model_path = resolve_profiles(opts)
    if model_p is not None and model_p.gpu_total_gib is None:
        raise ProfileError(f"model profile {model_path} was measured without a GPU: its memory is the host's",
                           hint="profile the model on the GPU node, or leave out --model-profile for estimates")
    micro_batch, precision = run_settings(opts, model_p)
    m = ModelInputs.from_profile(model_p) if model_p is not None else None
    spec = resolve_model(opts.model)
    numels = param_numels(spec)
    ranks = world.gpus_per_node
    gpu_total = gpu_capacity_gib(m, node_p)
    node = _Node(host_budget(opts.host_memory_budget, node_p, ranks) + ranks * HOST_BASE_BYTES / GiB,
                 usable_gpu_gib(gpu_total), ranks)
    ds_sgs = model_p.sub_group_size if model_p is not None else DEFAULT_SUB_GROUP_SIZE
    sizes = subgroup_sizes(numels, ds_sgs, world.size)
    grad_buffer = grad_buffer_bytes(precision)
    partition_gib = HALF_BYTES * sum(sizes) / GiB
    rows, twin_range = deepspeed_rows(sizes, ds_sgs, grad_buffer, m.offload_peak_gib if m else partition_gib,
                                      m is None, node)
    estimated = [f"host RAM and pinned memory: counted from {opts.model}'s parameters, as the optimizer's start-up "
                 f"check counts them, with {HOST_BASE_BYTES / GiB:.0f} GiB for each process; DeepSpeed's pinned "
                 "buffers rounded up to powers of two, as torch's pinned allocator makes them"]
    if m is None:
        ac = " --activation-checkpointing" if opts.activation_checkpointing else ""
        where = f" in a world of {world.describe()}" if world.size > 1 else ""
        estimated.append(f"GPU peaks (marked >=): no model profile of {opts.model} on {node_p.name}{where}, so each "
                         "is what the method keeps on the GPU between steps: the "
                         f"half-precision parameter partition ({partition_gib:.1f} GiB a rank) and the optimizer state "
                         "it keeps there; activations and gathered layers come on top. " + (
                             f"Measure them on the GPU node: dostune profile --model {opts.model}{ac}"
                             if any(r.fits for r in rows if r.method.startswith("zero-offload")) else
                             "A model profile, which measures ZeRO-Offload's iterations, cannot run on this node: "
                             "profile it where ZeRO-Offload's state fits (more host memory, or several nodes)"))
    else:
        estimated.append(f"GPU peaks: ZeRO-Offload's as the model profile measured it ({m.offload_peak_gib:.1f} GiB); "
                         "Twin-Flow's that plus the fp32 params, gradients and Adam states it keeps on the GPU; "
                         "dostune's predicted by the performance model")
        if opts.activation_checkpointing and not model_p.activation_checkpointing:
            opts.notes.append(f"{model_path.name} was measured without activation checkpointing: with it the GPU "
                              "peaks are lower than shown; profile the model with --activation-checkpointing for "
                              "them")
        elif model_p.activation_checkpointing and not opts.activation_checkpointing:
            opts.notes.append(f"{model_path.name} was measured with activation checkpointing: without it the "
                              "activations take more GPU memory than shown; pass --activation-checkpointing, or "
                              "profile the model without it")
    search = _Search(opts, node_path, model_path, m, numels, micro_batch, precision, grad_buffer, node, node_p)
    pick, config, zo_iter_s = search.pick(partition_gib, estimated, progress)
    plan = MemoryPlan(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), command=invocation(),
        dostune_version=__version__, node=node_p.name, node_profile=str(node_path),
        model_profile=str(model_path) if model_path else None, model=opts.model, params=sum(numels),
        micro_batch=micro_batch, seq=model_p.seq if model_p else opts.seq, precision=precision,
        activation_checkpointing=opts.activation_checkpointing, world=world.as_config(),
        host_available_gib=host_memory_gib(node_p), host_usable_gib=node.host, gpu_gib=gpu_total,
        gpu_usable_gib=node.gpu, methods=rows + [pick], twin_flow_ratios=twin_range, zero_offload_iter_s=zo_iter_s,
        estimated=estimated, notes=list(opts.notes), details=list(opts.details))
    return plan, config


class _Search:
    """dostune's row: the tuner's search on the plan's profiles."""

    def __init__(self, opts: TuneOptions, node_path, model_path, m: Optional[ModelInputs], numels: list[int],
                 micro_batch: int, precision: str, grad_buffer: int, node: _Node, node_p: NodeProfile):
        self.opts, self.m, self.numels, self.node, self.node_p = opts, m, numels, node, node_p
        self.micro_batch, self.precision, self.grad_buffer = micro_batch, precision, grad_buffer
        # the profiles the plan read, named, so that the search reads the same ones and says nothing twice
        self.tune = replace(opts, profile=node_path, model_profile=model_path, notes=[], details=[])

    def needs(self, label: str, sub_group_size: int, sizes: Sequence[int], sched: ScheduleConfig,
              rec: Optional[TrialRecord] = None) -> MethodNeeds:
        peak = rec.predicted.peak_gpu_gib if rec is not None and self.m is not None else None
        return dostune_needs(label, sub_group_size, sizes, sched, self.m, self.grad_buffer, self.node, peak,
                             rec.predicted.iter_s if rec is not None else None)

    def pick(self, partition_gib: float, estimated: list[str],
             progress: ProgressSink) -> tuple[MethodNeeds, Optional[dict], Optional[float]]:
        """The search's pick (its study in memory) or, where no schedule's host memory fits, the schedule that comes
        nearest; its config (None when it does not fit) and ZeRO-Offload's iteration as the search scored it (None
        without a search)."""
        opts, tune, node, m = self.opts, self.tune, self.node, self.m
        world = opts.world()
        if m is None:
            # no step's free memory measured: the GPU less the headroom and the parameter partition, a ceiling
            budget = unprofiled_step_ceiling_gib(self.numels, self.node_p, world.size) or 0.0
            if budget <= 0:  # not even the parameters fit the GPU: no schedule to search
                sizes = subgroup_sizes(self.numels, DEFAULT_SUB_GROUP_SIZE, world.size)
                return self.needs("dostune", DEFAULT_SUB_GROUP_SIZE, sizes, ScheduleConfig(gpu_fraction=0.0)), \
                    None, None
            tune.gpu_memory_budget = f"{budget:.3f}"
            estimated.append(f"dostune's pick: searched for the optimizer step alone, staging at most {budget:.1f} "
                             "GiB on the GPU (the GPU less the headroom and the parameter partition)")
        space = too_small = None
        try:
            space = build_space(tune)[0]
        except HostTooSmall as e:
            too_small = e
        opts.notes += [n for n in tune.notes if n not in opts.notes]
        opts.details += [n for n in tune.details if n not in opts.details]
        if too_small is not None:
            # the nearest schedule again, its resident subgroups beside the parameter partition (or the model
            # profile's peak) rather than in the whole GPU
            room = None if node.gpu is None else node.gpu - (m.offload_peak_gib if m is not None else partition_gib)
            least = least_host(too_small.space, room)
            opts.notes.append("dostune: no schedule fits the node's host memory, not even one that keeps on the GPU "
                              "as many subgroups as it holds and updates nothing during backward (the row): spread "
                              "the model over more ranks (--num-gpus, --nodes)")
            return self.needs("dostune, least host memory", least.sub_group_size,
                              too_small.space.sizes(least.sub_group_size), least.schedule), None, None
        study = run_study(space, tune, None, f"plan-{opts.model}", "plan", progress)
        top = ranked(space, study)
        rec = top[0] if top else _nearest(space, study)
        row = self.needs("dostune's pick", rec.sub_group_size, space.sizes(rec.sub_group_size),
                         ScheduleConfig.model_validate(rec.schedule), rec)
        if not top:
            opts.notes.append(f"dostune: none of the {opts.trials} schedules searched met the memory limits; the row "
                              "is the nearest: raise --trials, or spread the model over more ranks (--num-gpus, "
                              "--nodes)")
        config = emit_config(rec, self.micro_batch, self.precision, opts.lr, opts.clip, opts.target,
                             opts.activation_checkpointing, world) if top and row.fits else None
        return row, config, space.zero_offload().iter_s


def describe_world(world: dict) -> str:
    return World(world["nodes"], world["gpus_per_node"]).describe()
