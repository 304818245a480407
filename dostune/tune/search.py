"""`dostune tune`: fit the performance model to the profiles, search the schedule space with Optuna, emit a
DeepSpeed config with a ``dostune`` section.

This module takes the options and the profiles to a search space and the study's trials to the result and the
config; the Optuna study itself (its sampler, storage and objective) is study.py's."""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .._version import __version__
from ..optim.schedule import ScheduleConfig
from ..dsconfig import (DEFAULT_SUB_GROUP_SIZE, OffloadSettings, Target, TrainSettings, check_precision, check_target,
                        deepspeed_config, hf_config)
from ..errors import DostuneError, ProfileError
from ..host_memory import fit_host_memory
from ..host_steal import steal_note
from ..invocation import invocation
from ..models.registry import resolve_model
from ..perfmodel.inputs import ModelInputs
from ..perfmodel.model import Prediction
from ..perfmodel.zero_offload import ZeroOffloadPrediction
from ..perfmodel.subgroups import param_numels
from ..perfmodel.memory import GiB
from ..perfmodel.world import WORLD_KEY, World, host_memory_gib, rank_inputs
from ..profile.identity import cuda_available
from ..profile.model_record import PROBE_PASSES, ModelProfile, load_model_profile
from ..profile.paths import measured_node_profile, shipped_profile
from ..profile.record import NodeProfile, load_node_profile
from ..records import check_writable
from ..profile.timing import NullProgress, ProgressSink
from .record import PredictedTimes, TrialRecord, TuneResult
from .limits import (GPU_HEADROOM_SHARE, check_host_room, gpu_capacity_gib, limits_line, peak_limit_gib,
                     step_budget_gib, unprofiled_step_ceiling_gib, usable_gpu_gib)
from .regime import NAMES, Scoring, check_regime, scoring
from .space import Space
from .study import SAMPLERS, SEARCH_SPACE_VERSION, check_storage, problem_key, run_study
from .world import check_model_profile_world, check_node_gpus, find_model_profile, host_budget, resolve_world


@dataclass
class TuneOptions:
    model: str = "gpt2-1.3b"
    profile: Optional[Path] = None  # node profile
    model_profile: Optional[Path] = None
    micro_batch: Optional[int] = None  # default: the model profile's
    seq: Optional[int] = None
    precision: Optional[str] = None
    # With gpu_placement in the space, 50 trials found the exhaustive optimum of gpt2-1.3b's space at three
    # sub_group_sizes with 2 of 3 sampler seeds (4% off with the third), 100 with all three (tests/test_tune.py)
    trials: int = 100
    sampler: str = "tpe"
    seed: int = 0
    gpu_memory_budget: str = "auto"  # "auto" (the step's free memory less the headroom, limits.py) or GiB
    # over ZeRO-Offload's measured peak (equal memory); None: the GPU's memory less the headroom (limits.py)
    max_peak_increase: Optional[float] = None
    output_dir: Optional[Path] = None
    storage: Optional[str] = None
    study_name: Optional[str] = None
    lr: float = 1e-4
    clip: float = 1.0
    regime: str = "measured"  # what the schedules are scored in (tune/regime.py): measured, clip, no-clip or both
    target: Target = "deepspeed"  # who reads the emitted config (dsconfig.hf_config)
    activation_checkpointing: bool = False  # the emitted config carries DeepSpeed's activation_checkpointing section
    num_gpus: Optional[int] = None  # GPUs (ranks) per node; default 1, or the hostfile's slots
    nodes: Optional[int] = None  # default 1, or the hostfile's hosts
    hostfile: Optional[Path] = None  # DeepSpeed's MPI-style hostfile: the world it describes
    host_memory_budget: str = "auto"  # pinned host memory of one node's ranks together: "auto" (the profile's) or GiB
    notes: list[str] = field(default_factory=list)  # what the user should know and do (tune.json's notes)
    details: list[str] = field(default_factory=list)  # the rest of what the search found (tune.json's details)
    _world: Optional[World] = field(default=None, repr=False)

    def world(self) -> World:
        """The world to tune for: --num-gpus and --nodes, or the hostfile's (which they must agree with)."""
        if self._world is None:
            self._world = resolve_world(self.num_gpus, self.nodes, self.hostfile)
        return self._world


def resolve_profiles(opts: TuneOptions) -> tuple[NodeProfile, Path, Optional[ModelProfile], Optional[Path]]:
    if opts.profile is not None:
        node_path = Path(opts.profile)
    elif not cuda_available():
        node_path = shipped_profile()
        # the schedule splits the optimizer step between a GPU and its host: a profile of this machine has neither
        opts.notes.append("no --profile given and this machine has no GPU: tuned from the shipped H200 profile; to "
                          "tune for your GPU machine, run `dostune profile` there and pass --profile")
    else:
        node_path = measured_node_profile()
    opts.details.append(f"node profile: {node_path}")
    node = load_node_profile(node_path)
    world = opts.world()
    model_path = Path(opts.model_profile) if opts.model_profile else None
    if model_path is None:
        model_path = find_model_profile(node, node_path, opts.model, opts.micro_batch, opts.seq, world, opts.notes,
                                        opts.details)
    model = load_model_profile(model_path) if model_path is not None else None
    if model is not None and model.model != opts.model:
        raise ProfileError(f"{model_path} profiles {model.model}, not {opts.model}")
    if model is not None:
        check_model_profile_world(model, model_path, world, node.name)
    check_node_gpus(node, node_path, world)
    if model is not None and model.node != node.name:
        opts.notes.append(f"the model profile was measured on '{model.node}', the node profile on '{node.name}': "
                          "the predictions mix two machines; profile the model on the node you tune for")
    if model is None:
        opts.notes.append("no model profile: forward/backward times and the step's free memory are unknown, so the "
                          "search minimises the optimizer step alone (run `dostune profile --model` for more)")
    # a profile measured while the hypervisor took CPU time is a slower host's: the profile said so when it was taken,
    # and the tune says it again, beside the predictions it makes from it
    notes = [steal_note(node.steal, f"{node_path.name} was measured")]
    if model is not None:
        notes.append(steal_note(model.steal, f"{model_path.name} timed ZeRO-Offload's iterations"))
        # a detail, not a note: host-paced passes wander on an idle machine too, and nothing need be done about it
        wide = wide_pass_note(model)
        if wide:
            opts.details.append(wide)
    opts.notes += [n for n in notes if n]
    return node, node_path, model, model_path


# A pass whose probe rounds spread wider than this (interquartile range over the median) is named: the model predicts
# it at the median, and the iteration's prediction is meant to land within 10% of the measurement.
WIDE_PASS_SPREAD = 0.10


def wide_pass_note(model: ModelProfile) -> Optional[str]:
    """A note naming the passes whose time varied by more than ``WIDE_PASS_SPREAD`` over the model profile's probe
    rounds: such passes are paced by the host, whose speed moves in stretches of seconds, and training measured
    minutes later may fall in another stretch."""
    wide = {name: x for name, x in model.pass_spread().items() if x > WIDE_PASS_SPREAD}
    if not wide:
        return None
    passes = ", ".join(f"{PROBE_PASSES[name]} by about {x:.0%}" for name, x in wide.items())
    return (f"the host's speed moved while the model profile timed its passes ({passes} from one probe round to "
            "another): the predictions take each pass's typical time, so a measured iteration may be off by as much")


def _budget(opts: TuneOptions, m: ModelInputs, model_path: Optional[Path], node_path: Path, node_p: NodeProfile,
            numels: list[int]) -> Optional[float]:
    node_name = node_p.name
    if opts.gpu_memory_budget == "auto":
        if model_path is None:
            # the budget is only the first thing that needs the model profile: name what is missing
            w = opts.world()
            host = host_memory_gib(node_p) * GiB / w.gpus_per_node
            try:  # a model profile measures ZeRO-Offload: where the node cannot hold its state, none can be made there
                fit_host_memory("zero-offload", OffloadSettings(sub_group_size=DEFAULT_SUB_GROUP_SIZE, ratio=1.0),
                                numels, opts.precision, int(host))
            except DostuneError as e:
                ceiling = unprofiled_step_ceiling_gib(numels, node_p, w.size)
                most = f"at most {ceiling:.0f} GiB on {node_name} (the GPU less a {GPU_HEADROOM_SHARE:.0%} headroom " \
                       "and the parameter partition), less your micro-batch's activations" if ceiling else "in GiB"
                raise ProfileError(f"no model profile for {opts.model} on {node_name}, and none can be measured there: "
                                   f"a model profile runs ZeRO-Offload, whose {str(e).removeprefix('not run: its ')}",
                                   hint=f"give --gpu-memory-budget {most}; `dostune plan --model {opts.model}` shows "
                                        "what each method needs") from None
            suffix, how = (f"-{w.nodes}x{w.gpus_per_node}", f"deepspeed --num_gpus {w.gpus_per_node} --module "
                           "dostune.profile") if w.size > 1 else ("", "dostune profile")
            raise ProfileError(f"no model profile for {opts.model} on {node_name} ({w.describe()}): none given and no "
                               f"{node_name}-{opts.model}-b*-s*{suffix}.json beside {node_path}",
                               hint=f"measure it on the GPU node ({how} --model {opts.model} --name {node_name}) and "
                                    "pass --model-profile, or give --gpu-memory-budget in GiB")
        if m.free_step_gib is None:
            raise ProfileError(f"model profile {model_path} was measured without a GPU, so the GPU memory free "
                               "during the step is unknown", hint="profile the model on the GPU node, or give "
                                                                  "--gpu-memory-budget in GiB")
        return step_budget_gib(m.free_step_gib, m.gpu_total_gib)
    try:
        value = float(opts.gpu_memory_budget)
    except ValueError:
        raise DostuneError(f"--gpu-memory-budget must be 'auto' or a number of GiB, got {opts.gpu_memory_budget!r}") \
            from None
    if value <= 0:
        raise DostuneError(f"--gpu-memory-budget must be positive, got {value}")
    return value


def build_space(opts: TuneOptions) -> tuple[Space, NodeProfile, Path, Optional[ModelProfile], Optional[Path], ModelInputs]:
    node_p, node_path, model_p, model_path = resolve_profiles(opts)
    world = opts.world()
    node, world_notes = rank_inputs(node_p, world, opts.details)
    opts.notes += world_notes
    spec = resolve_model(opts.model)
    numels = param_numels(spec)
    if model_p is not None:
        m = ModelInputs.from_profile(model_p)
        prof_sub = ([s.numel for s in model_p.subgroups], [s.grad_ready_s for s in model_p.subgroups], model_p.backward_s)
    else:
        m = ModelInputs(model=opts.model, params=sum(numels))
        prof_sub = None
    capacity = gpu_capacity_gib(m, node_p)
    peak_limit = peak_limit_gib(m, capacity, opts.max_peak_increase)
    host = host_budget(opts.host_memory_budget, node_p, world.gpus_per_node)
    space = Space(node, m, numels, None, peak_limit, world=world, profile_subgroups=prof_sub, host_budget_gib=host)
    if space.coeffs.lacking:
        opts.notes.append(f"the {' and the '.join(space.coeffs.lacking)} come from an older dostune and lack "
                          "measurements this one makes; the model stands in defaults for them (listed with --verbose "
                          "and in tune.json): profile again with this dostune for closer predictions")
    check_host_room(space, opts.model, usable_gpu_gib(capacity))
    # after the host check: a model whose state no schedule fits is refused before asking for its model profile
    space.budget_gib = _budget(opts, m, model_path, node_path, node_p, numels)
    space.regime = scored_regime(opts, model_p)
    opts.details.append(limits_line(space, capacity, opts.max_peak_increase))
    return space, node_p, node_path, model_p, model_path, m


def scored_regime(opts: TuneOptions, model_p: Optional[ModelProfile]) -> Scoring:
    """The regime the search scores in for ``opts.regime`` (tune/regime.py), with why among the details and, where
    the user may want another, a note."""
    regime, why, note = scoring(opts.regime, opts.clip, model_p.grad_norms if model_p is not None else None)
    opts.details.append(f"schedules scored for {NAMES[regime]} ({why})")
    if note:
        opts.notes.append(note)
    return regime


def predicted_times(p: Prediction) -> PredictedTimes:
    """A schedule's prediction in the record's form (tune.json's trials and validated rows)."""
    s, mem, b = p.step, p.memory, p.backward
    return PredictedTimes(fwd_s=p.fwd_s, bwd_s=p.bwd_s, step_s=p.step_s, iter_s=p.iter_s, lanes_s=s.lanes_s,
                          overhead_s=s.overhead_s, cpu_busy_s=s.cpu_busy_s, h2d_busy_s=s.h2d_busy_s,
                          d2h_busy_s=s.d2h_busy_s, update_gelem_s=p.update_gelem_s, peak_gpu_gib=mem.peak_gpu_gib,
                          extra_step_gib=mem.extra_step_gib, extra_bwd_gib=mem.extra_bwd_gib,
                          pinned_host_gib=mem.pinned_host_gib, bwd_compute_s=b.compute_s if b else None,
                          bwd_copies_s=b.copies_s if b else None, bwd_interference_s=b.interference_s if b else None,
                          regime=p.regime, swing=p.swing)


def zero_offload_times(z: ZeroOffloadPrediction, m: ModelInputs) -> PredictedTimes:
    """ZeRO-Offload's predicted times in the record's form (its CPU lane is its whole step's per-subgroup work)."""
    b = z.backward
    total = sum(z.sizes)
    return PredictedTimes(fwd_s=z.fwd_s, bwd_s=z.bwd_s, step_s=z.step_s, iter_s=z.iter_s, lanes_s=z.lanes_s,
                          overhead_s=z.overhead_s, cpu_busy_s=z.lanes_s, h2d_busy_s=0.0, d2h_busy_s=0.0,
                          update_gelem_s=total / z.step_s / 1e9, peak_gpu_gib=m.offload_peak_gib, extra_step_gib=0.0,
                          extra_bwd_gib=0.0, pinned_host_gib=8 * total / 2**30 if z.pinned else 0.0,
                          bwd_compute_s=b.compute_s if b else None, bwd_copies_s=b.copies_s if b else None,
                          bwd_interference_s=0.0 if b else None, pinned=z.pinned, measured_step=z.measured_step)


def trial_record(space: Space, p: Prediction, number: Optional[int] = None) -> TrialRecord:
    """A scored prediction in the record's form, beside its schedule's prediction in each regime."""
    return TrialRecord(number=number, sub_group_size=p.sub_group_size, subgroups=len(p.sizes),
                       schedule=p.schedule.model_dump(exclude_none=True), predicted=predicted_times(p),
                       feasible=space.feasible(p),
                       regimes={g: predicted_times(x) for g, x in space.in_every_regime(p).items()})


def ranked(space: Space, study) -> list[TrialRecord]:
    from optuna.trial import TrialState

    seen, out = set(), []
    trials = sorted((t for t in study.trials if t.state == TrialState.COMPLETE and t.user_attrs.get("feasible")),
                    key=lambda t: t.value)
    for t in trials:
        c = space.candidate(t.params)
        if c in seen:
            continue
        seen.add(c)
        out.append(trial_record(space, space.evaluate(c), t.number))
    return out


def emit_config(rec: TrialRecord, micro_batch: int, precision: str, lr: float, clip: float,
                target: Target = "deepspeed", activation_checkpointing: bool = False, world: World = World()) -> dict:
    """The DeepSpeed config of a tuned schedule. It names the world it was tuned for (WORLD_KEY), which `dostune
    train` and `dostune bench` check before building the engine; train_batch_size is left for DeepSpeed to derive
    (micro-batch x gradient accumulation x ranks), so the same file runs under any launcher of that world."""
    sched = ScheduleConfig.model_validate(rec.schedule)
    train = TrainSettings(micro_batch=micro_batch, precision=precision, lr=lr, clip=clip,
                          activation_checkpointing=activation_checkpointing)
    # pin_memory off: dostune page-locks DeepSpeed's buffers in place, without the power-of-two rounding of
    # DeepSpeed's pinned copies (optim/footprint.py: what lets llama-7b fit a 125 GiB host)
    cfg = deepspeed_config(train, OffloadSettings(sub_group_size=rec.sub_group_size, pin_memory=False, schedule=sched))
    cfg[WORLD_KEY] = world.as_config()
    return hf_config(cfg, target)


def output_dir(opts: TuneOptions) -> Path:
    return Path(opts.output_dir or Path("runs") / "tune" / opts.model.replace(":", "_"))


OUTPUT_FILES = ("ds_config.json", "tune.json", "timeline.png", "validation.png")


def check_options(opts: TuneOptions) -> None:
    """Everything about the options that can be refused without the profiles, refused before any work."""
    if opts.trials < 1:
        raise DostuneError(f"--trials must be at least 1, got {opts.trials}")
    check_target(opts.target)
    check_precision(opts.precision, hint="leave --precision out to tune for the one the model profile was measured in")
    if opts.sampler not in SAMPLERS:
        raise DostuneError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {opts.sampler!r}")
    if opts.max_peak_increase is not None and not opts.max_peak_increase >= 0:
        raise DostuneError(f"--max-peak-increase must be 0 or more, got {opts.max_peak_increase}")
    if not opts.lr > 0:
        raise DostuneError(f"--lr must be positive, got {opts.lr}")
    if not opts.clip >= 0:
        raise DostuneError(f"--clip must be 0 (off) or positive, got {opts.clip}")
    check_regime(opts.regime, opts.clip)
    out = check_writable(output_dir(opts), "--output-dir", directory=True)
    for name in OUTPUT_FILES:
        check_writable(out / name, "--output-dir")
    if opts.storage is not None:
        check_storage(opts.storage)
    opts.world()  # a bad --num-gpus/--nodes or hostfile (a node that does not resolve): now, before any work


def run_settings(opts: TuneOptions, model_p: Optional[ModelProfile]) -> tuple[int, str]:
    """The micro-batch and precision tuned for: the options', else the model profile's (which they must agree
    with: its times and memory are that batch's)."""
    micro_batch = opts.micro_batch or (model_p.micro_batch if model_p else 8)
    if model_p is not None and micro_batch != model_p.micro_batch:
        raise DostuneError(f"--micro-batch {micro_batch} differs from the model profile's {model_p.micro_batch}: "
                           "its forward/backward times and memory would not apply", hint="profile that batch size")
    return micro_batch, opts.precision or (model_p.precision if model_p else "bf16")


def run_tune(opts: TuneOptions, progress: Optional[ProgressSink] = None) -> tuple[TuneResult, dict, Space]:
    progress = progress or NullProgress()
    check_options(opts)
    space, node_p, node_path, model_p, model_path, m = build_space(opts)
    micro_batch, precision = run_settings(opts, model_p)
    if opts.activation_checkpointing and model_p is not None and not model_p.activation_checkpointing:
        opts.notes.append(f"the emitted config checkpoints every block, but {model_path.name} was measured without "
                          "it: the predicted times and GPU memory are those of a run without checkpointing; profile "
                          "the model with --activation-checkpointing for them")
    out_dir = output_dir(opts)
    out_dir.mkdir(parents=True, exist_ok=True)
    storage = opts.storage or f"sqlite:///{(out_dir / 'study.db').as_posix()}"
    world = opts.world()
    study_name = opts.study_name or (f"{node_p.name}-{opts.model}-b{micro_batch}"
                                     + (f"-{world.nodes}x{world.gpus_per_node}" if world.size > 1 else "")
                                     + f"-v{SEARCH_SPACE_VERSION}")
    study = run_study(space, opts, storage, study_name, problem_key(node_p, model_p, opts, space), progress)
    top = ranked(space, study)
    if not top:
        raise DostuneError("no schedule met the GPU and host memory limits in the trials run",
                           hint="raise --gpu-memory-budget / --max-peak-increase / --host-memory-budget, or run more "
                                "--trials")
    closed = [trial_record(space, space.evaluate(c)) for c in space.closed_form_candidates()]
    ds_sgs = space.ds_sub_group_size
    ds_pred = zero_offload_times(space.zero_offload(), m)
    result = TuneResult(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), command=invocation(),
        dostune_version=__version__, node_profile=str(node_path), model_profile=str(model_path) if model_path else None,
        model=opts.model, params=sum(space.numels), micro_batch=micro_batch,
        seq=model_p.seq if model_p else opts.seq, precision=precision, budget_gib=space.budget_gib,
        max_peak_gib=space.max_peak_gib, study_name=study_name, storage=storage, sampler=opts.sampler,
        trials=sum(1 for t in study.trials if t.state.name == "COMPLETE"), best=top[0], top=top[:5], closed_form=closed, ds_offload=ds_pred,
        ds_sub_group_size=ds_sgs, world=world.as_config(), host_budget_gib=space.host_budget_gib,
        profile_steal=model_p.steal if model_p else None,
        profile_set_aside=model_p.set_aside.runs if model_p and model_p.set_aside else None,
        notes=list(opts.notes), details=list(opts.details) + [n for n in space.coeffs.notes if n not in opts.details],
        regime=space.regime, clip=opts.clip, profile_grad_norms=model_p.grad_norms if model_p else None)
    return result, emit_config(top[0], micro_batch, precision, opts.lr, opts.clip, opts.target,
                               opts.activation_checkpointing, world), space
