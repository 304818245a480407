"""Whether a tuned schedule fits a model, and carrying it over to another model (``dostune refit``).

A ``dostune`` section is tuned for one model at one sub_group_size: it names how many subgroups it expects,
how many of the GPU lane's subgroups stay resident, how many may move between the lanes. On another model those
counts can be impossible (a resident count above the GPU lane's size) or simply not the tuned problem. The
count follows from the model's parameter shapes alone (perfmodel/subgroups.py forms the subgroups the way
DeepSpeed does), so it is checked before any engine is built, which takes minutes for a large model.

Refitting keeps the schedule's shape (the GPU lane's share, staging, upload path, gradients on the GPU,
overlap with backward) and scales the counts to the new model's subgroups: the tuner's own rules, applied to a
model it did not see. It is a starting point to run, not a tuning result: the performance model never scored it.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ..dsconfig import with_schedule
from ..errors import ConfigError
from ..models.registry import ModelSpec
from ..optim.schedule import SECTION, ScheduleConfig, full_swing, gpu_count, make_plan
from ..perfmodel.subgroups import param_numels, subgroup_sizes
from ..perfmodel.world import World, check_local_gpus, check_world

#: DeepSpeed's zero_optimization.sub_group_size when a config does not set it
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class TunedConfig:
    """What a DeepSpeed config carries for dostune, read in one place (``read``): the schedule of its ``dostune``
    section (None without one), the sub_group_size DeepSpeed cuts the subgroups at, whether the config sets it (else
    DeepSpeed's default), and the world it was tuned for (None where it does not say)."""

    schedule: Optional[ScheduleConfig]
    sub_group_size: int
    sub_group_size_given: bool
    world: Optional[World]

    @classmethod
    def read(cls, ds_config: dict, source: str = "the DeepSpeed config") -> "TunedConfig":
        zero = ds_config.get("zero_optimization") or {}
        given = zero.get("sub_group_size")
        return cls(schedule=ScheduleConfig.from_ds_config(ds_config),
                   sub_group_size=int(given or DEEPSPEED_SUB_GROUP_SIZE), sub_group_size_given=bool(given),
                   world=World.from_config(ds_config, source))


def model_subgroups(spec: ModelSpec, sub_group_size: int, world_size: int = 1,
                    numels: Optional[list[int]] = None) -> int:
    """How many ZeRO-3 subgroups DeepSpeed will form for this model on each rank."""
    return len(subgroup_sizes(numels if numels is not None else param_numels(spec), sub_group_size, world_size))


def check_fits(ds_config: dict, spec: ModelSpec, source: str, world: "World | int | None" = None) -> Optional[int]:
    """Refuse, before the engine is built, a dostune section that cannot run here: tuned for another world (the
    config's ``dostune_world``; ``world``: the run's, None = the launcher's environment) or launched with more ranks
    per node than the node has GPUs (checked first), tuned for another subgroup count, or with more resident subgroups than the GPU
    lane has. Returns the subgroup count (None without a dostune section)."""
    tuned = TunedConfig.read(ds_config, source)
    sched = tuned.schedule
    if sched is None:
        return None
    run = World.of_run() if world is None else World(1, world) if isinstance(world, int) else world
    check_local_gpus(run)  # no GPU for this rank says more than "another world" would
    check_world(ds_config, source, spec.name, run)
    world_size = run.size
    sgs = tuned.sub_group_size
    n = model_subgroups(spec, sgs, world_size)
    hint = f"carry the schedule over with: dostune refit --config {source} --model {spec.name} --output NEW.json"
    if sched.expected_subgroups is not None and sched.expected_subgroups != n:
        raise ConfigError(f"{source} was tuned for {sched.expected_subgroups} subgroups but {spec.name} has {n} at "
                          f"sub_group_size {sgs:g}" + (f" on each of {world_size} ranks" if world_size > 1 else ""),
                          hint=f"re-run `dostune tune --model {spec.name}`, or {hint}")
    try:
        make_plan(n, sched)
    except ConfigError as e:
        raise ConfigError(f"{source} does not fit {spec.name}: {e}", hint=hint) from None
    return n


@dataclass
class Refit:
    ds_config: dict
    subgroups: int
    tuned_subgroups: Optional[int]
    notes: list[str] = field(default_factory=list)


def _scaled(count: int, old_total: int, new_total: int) -> int:
    """``count`` of ``old_total`` as the same share of ``new_total`` (at least 1 when it was at least 1)."""
    if count <= 0 or old_total <= 0 or new_total <= 0:
        return 0
    return min(new_total, max(1, round(count * new_total / old_total)))


def refit_schedule(sched: ScheduleConfig, n: int, cores: Optional[int] = None) -> tuple[ScheduleConfig, list[str]]:
    """The schedule's shape on ``n`` subgroups (see the module's docstring); notes say what changed. ``cores``: the
    logical cores one rank has here (thread counts above it are dropped)."""
    notes = []
    old_n = sched.expected_subgroups
    fraction = sched.gpu_fraction
    g = gpu_count(n, fraction)
    if g == 0 and fraction > 0 and n > 1:
        # a share that rounds to nothing on few subgroups would drop the GPU lane the tuner chose
        fraction, g = min(1.0, 1 / n + 1e-9), 1
        notes.append(f"gpu_fraction raised to {fraction:.4g} so that one of the {n} subgroups is updated on the GPU")
    old_g = gpu_count(old_n, sched.gpu_fraction) if old_n else g
    resident = _scaled(sched.resident_subgroups, old_g, g) if sched.resident_subgroups else 0
    if sched.adaptive_swing and old_n and sched.adaptive_swing == full_swing(old_n, old_g, sched.resident_subgroups):
        swing = full_swing(n, g, resident)  # the tuner's rule: every subgroup that can move may, either way
    else:
        swing = min(sched.adaptive_swing, full_swing(n, g, resident))
    threads = sched.cpu_threads
    if threads is not None and cores is not None and threads > cores:
        notes.append(f"cpu_threads {threads} dropped: a rank here has {cores} logical core(s) (CPU Adam uses "
                     "torch's thread count)")
        threads = None
    backward_threads = sched.backward_cpu_threads
    if backward_threads is not None and cores is not None and backward_threads > cores:
        backward_threads = None
    new = sched.model_copy(update=dict(gpu_fraction=fraction, resident_subgroups=resident, adaptive_swing=swing,
                                       cpu_threads=threads,
                                       backward_cpu_threads=backward_threads, expected_subgroups=n))
    for name, before, after in (("resident_subgroups", sched.resident_subgroups, resident),
                                ("adaptive_swing", sched.adaptive_swing, swing)):
        if before != after:
            notes.append(f"{name} {before} -> {after}")
    ScheduleConfig.model_validate(new.model_dump())  # the combination rules still hold
    make_plan(n, new)
    return new, notes


def refit(ds_config: dict, spec: ModelSpec, source: str, sub_group_size: Optional[int] = None,
          micro_batch: Optional[int] = None, world_size: int = 1, cores: Optional[int] = None) -> Refit:
    """``ds_config``'s dostune schedule carried over to ``spec``. Without ``sub_group_size``, one that gives the
    new model about as many subgroups as the schedule was tuned for (the count the shape was chosen at). The world
    stays the one the config was tuned for (its ``dostune_world``; ``world_size`` ranks on one node for a config
    that does not say), and so do its threads per rank where this machine has them."""
    tuned = TunedConfig.read(ds_config, source)
    if tuned.world is not None:
        world_size = tuned.world.size
        if cores is None:
            cores = max(1, (os.cpu_count() or 1) // tuned.world.gpus_per_node)
    sched = tuned.schedule
    if sched is None:
        raise ConfigError(f"{source} has no '{SECTION}' section to refit", hint="run `dostune tune` to emit one")
    if sub_group_size is not None and sub_group_size < 1:
        raise ConfigError(f"--sub-group-size must be positive, got {sub_group_size}")
    if micro_batch is not None and micro_batch < 1:
        raise ConfigError(f"--micro-batch must be at least 1, got {micro_batch}")
    numels = param_numels(spec)
    notes = []
    target = None
    if sub_group_size is None:
        target = sched.expected_subgroups or model_subgroups(spec, tuned.sub_group_size, world_size, numels)
        sub_group_size = max(1, math.ceil(sum(numels) / world_size / target))
    n = model_subgroups(spec, sub_group_size, world_size, numels)
    if target is not None:
        # the count itself is said once, by the caller: a note of "about {target}" beside it would contradict it
        # whenever the model's tensors (never split across subgroups) make fewer
        notes.append(f"sub_group_size {sub_group_size:,}: the model's {sum(numels):,} parameters over the {target} "
                     "subgroups the schedule was tuned for" + ("" if n >= target else
                                                               "; its parameter tensors, which are never split, "
                                                               "make fewer at that size"))
    new_sched, sched_notes = refit_schedule(sched, n, cores if cores is not None else os.cpu_count())
    cfg = copy.deepcopy(ds_config)
    cfg.setdefault("zero_optimization", {})["sub_group_size"] = int(sub_group_size)
    if micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
        cfg.pop("train_batch_size", None)  # DeepSpeed derives it from the micro-batch
    cfg = with_schedule(cfg, new_sched)  # and the offload ratio that keeps its resident subgroups on the GPU
    return Refit(ds_config=cfg, subgroups=n, tuned_subgroups=sched.expected_subgroups, notes=notes + sched_notes)
