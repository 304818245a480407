"""`dostune bench`: train the same model, batch and seed under each offload method, one after another, and
measure forward, backward, step and iteration time, peak GPU memory and the loss. With more than one round the
methods run again in reverse order (A B, B A, ...) and their samples are pooled.

Each method runs in its own process (bench/isolate.py): an engine that the out-of-memory killer ends, a CUDA
error that poisons the context, or a crash in native code then costs that method's row (which says what
happened), not the other methods' results.

Under DeepSpeed's launcher (`deepspeed --num_gpus N --module dostune.bench ...`) every rank runs every method, in
its own process, one after another: a method's engine spans all ranks, so a rank that lost its method process
would leave the others waiting in ZeRO-3's collectives, and isolation could not save the rest of the run. After
each method the ranks exchange their figures: the result shows the slowest rank's phases and every rank's peak
memory, and rank 0 writes it."""
from __future__ import annotations

import datetime as _dt
import os
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from .._version import __version__
from ..invocation import invocation
from ..dsconfig import DEFAULT_SUB_GROUP_SIZE, OffloadSettings, TrainSettings, check_precision, deepspeed_config
from ..errors import DostuneError
from ..models.registry import ModelSpec, resolve_model
from ..optim.schedule import ScheduleConfig
from ..deepspeed_support import check_deepspeed
from ..optim.footprint import available_host_bytes
from ..perfmodel.subgroups import param_numels
from ..perfmodel.world import WORLD_KEY, World, gather_ranks, rank
from ..profile.identity import cuda_available, deepspeed_version, nvml, nvml_handle
from ..profile.timing import NullProgress, ProgressSink, iteration_phases, sync_device
from ..stats import Stat
from ..train.engine import free_engine_memory
from ..tune.refit import check_fits
from ..host_memory import fit_host_memory
from ..host_steal import QuietRuns
from .host_peak import gib, peak_rss_bytes, pinned_bytes, reset_host_peaks
from .pool import combine_ranks, pool_rounds
from .record import BenchResult, MethodResult
from .report import signed_swing, steps_by_swing_text

METHODS: dict[str, str] = {
    "no-offload": "ZeRO-3 with the optimizer state on the GPU (ratio 0.0): the ceiling",
    "zero-offload": "DeepSpeed ZeRO-Offload: all optimizer state on the CPU (ratio 1.0)",
    "dostune": "dostune: interleaved CPU+GPU update of the offloaded state",
    "twin-flow-0.5": "DeepSpeed Twin-Flow: half the optimizer state on the GPU (ratio 0.5)",
    "twin-flow-mem": "DeepSpeed Twin-Flow at the ratio that fits dostune's peak GPU memory, or the largest this "
                     "host's memory holds",
    "superoffload": "DeepSpeed SuperOffload (offload_optimizer.super_offload)",
}
GPU_DEFAULT = ["no-offload", "zero-offload", "dostune", "twin-flow-0.5", "twin-flow-mem", "superoffload"]
CPU_DEFAULT = ["zero-offload", "dostune"]
VARIANT_PREFIX = "dostune:"  # a further dostune schedule measured in the same run: "dostune:<label>"


@dataclass(frozen=True)
class Variant:
    """Another dostune schedule to measure beside the first, in the same run and the same round order, so the
    comparison between two schedules is as free of the machine's drift as the one against the baselines."""

    label: str
    schedule: ScheduleConfig
    sub_group_size: Optional[int] = None
    source: str = ""  # where it came from (a config path), for the report
    world: Optional[World] = None  # the world its config was tuned for, when it says

    @property
    def method(self) -> str:
        return VARIANT_PREFIX + self.label


def is_dostune(name: str) -> bool:
    return name == "dostune" or name.startswith(VARIANT_PREFIX)


@dataclass
class BenchOptions:
    model: str = "gpt2-1.3b"
    micro_batch: int = 8
    seq: int = 1024
    precision: str = "bf16"
    clip: float = 1.0
    iters: int = 8
    warmup: int = 3
    rounds: int = 1
    seed: int = 0
    methods: Optional[list[str]] = None
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    schedule: Optional[ScheduleConfig] = None  # dostune's; default: ScheduleConfig()
    dostune_sub_group_size: Optional[int] = None
    dostune_world: Optional[World] = None  # the world dostune's --config was tuned for, when it says
    node: Optional[str] = None
    train: TrainSettings = field(default_factory=TrainSettings)
    variants: list[Variant] = field(default_factory=list)  # further dostune schedules, measured right after dostune
    activation_checkpointing: bool = False  # every method's model recomputes each block's activations in backward
    isolate: bool = True  # each method in its own process (bench/isolate.py); False: in this one (tests)
    # host memory of this node the methods may take (fit_host_memory); None: what it has available when the bench starts
    host_available_bytes: Optional[int] = None

    def resolved_methods(self) -> list[str]:
        methods = self.methods or (GPU_DEFAULT if cuda_available() else CPU_DEFAULT)
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise DostuneError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        if "twin-flow-mem" in methods and not {"dostune", "zero-offload"} <= set(methods):
            raise DostuneError("twin-flow-mem is sized from dostune's peak GPU memory over ZeRO-Offload's: add dostune "
                               "and zero-offload to --methods")
        if self.variants and "dostune" not in methods:
            raise DostuneError("more than one dostune config compares dostune schedules: add dostune to --methods")
        labels = [v.label for v in self.variants]
        if len(set(labels)) != len(labels):
            raise DostuneError(f"dostune configs need distinct labels, got {', '.join(labels)}")
        # dostune first among the offloaders, so twin-flow-mem can be sized from it
        order = list(METHODS)
        out = sorted(dict.fromkeys(methods), key=order.index)
        k = out.index("dostune") + 1 if "dostune" in out else len(out)
        return out[:k] + [v.method for v in self.variants] + out[k:]

    def describe(self, name: str) -> str:
        v = self.variant(name)
        if v is None:
            return METHODS[name]
        return f"{METHODS['dostune']}, schedule {v.label}" + (f" ({v.source})" if v.source else "")

    def variant(self, name: str) -> Optional[Variant]:
        return next((v for v in self.variants if v.method == name), None)


def measure(engine, spec: ModelSpec, seq: int, iters: int, warmup: int, seed: int,
            progress: ProgressSink) -> dict:
    """Time forward, backward and step of ``iters`` iterations the hypervisor left alone (with the device
    synchronised between phases): one it took more than host_steal.QUIET_BELOW of the CPU from is set aside and
    another runs (QuietRuns). Losses are those of the first ``warmup + iters`` iterations, whatever was set aside, so
    that methods compare step for step."""
    gen = torch.Generator().manual_seed(seed + 1)
    mb = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    cuda = torch.cuda.is_available()
    phase_peak = {"fwd": 0, "bwd": 0, "step": 0}
    losses: list[float] = []

    def phase(name: str, fn, timed: bool):
        if cuda and timed:
            torch.cuda.reset_peak_memory_stats()
        out = fn()
        sync_device()  # the peak is read after the phase's device work (iteration_phases syncs again: nothing left)
        if cuda and timed:
            phase_peak[name] = max(phase_peak[name], torch.cuda.max_memory_allocated())
        return out

    opt = getattr(engine, "optimizer", None)
    swings = hasattr(type(opt), "dostune_swing_stats")

    def iteration(timed: bool) -> tuple[float, float, float, float, Optional[int]]:
        f = b = s = 0.0
        # the split this iteration's step runs with (the swing decides after a step, for the next)
        swing = opt.dostune_swing_stats["swing"] if swings else None
        t_it = time.perf_counter()
        for _ in range(gas):
            batch = spec.batch(mb, seq, gen, engine.device)
            loss, f1, b1, s1 = iteration_phases(engine, batch, around=lambda name, fn: phase(name, fn, timed))
            f, b, s = f + f1, b + b1, s + s1
            if len(losses) < (warmup + iters) * gas:
                losses.append(float(loss.detach().float()))
        progress.advance()
        return f, b, s, time.perf_counter() - t_it, swing

    for _ in range(warmup):
        iteration(timed=False)
    runs = QuietRuns(iters, gather=gather_ranks, on_set_aside=lambda share, left: progress.start(
        f"an iteration set aside: the hypervisor took {share:.1%} of the CPU (steal); at most {left} more", left))
    while runs.more():
        runs.start()
        runs.stop(iteration(timed=True))
    fwd, bwd, step, it, swing = (list(x) for x in zip(*runs.kept()))
    peaks = {k: v / 2**30 for k, v in phase_peak.items()} if cuda else None
    return {"fwd": Stat.of(fwd), "bwd": Stat.of(bwd), "step": Stat.of(step), "iter": Stat.of(it),
            "peak": max(peaks.values()) if peaks else None, "phase_peaks": peaks, "losses": losses,
            "samples": {"fwd": fwd, "bwd": bwd, "step": step, "iter": it}, "steal": runs.share,
            "set_aside": runs.set_aside(),
            # a schedule without adaptive_swing counts no steps by swing
            "swing": swing if swings and opt.dostune_swing_stats["steps_by_swing"] else []}


def method_offload(name: str, opts: BenchOptions, twin_ratio: Optional[float]) -> OffloadSettings:
    """The offload settings of bench method ``name`` (a dostune schedule's as the options give it)."""
    sgs = opts.sub_group_size
    if name == "no-offload":
        return OffloadSettings(sub_group_size=sgs, ratio=0.0)
    if name == "zero-offload":
        return OffloadSettings(sub_group_size=sgs, ratio=1.0)
    if name == "twin-flow-0.5":
        return OffloadSettings(sub_group_size=sgs, ratio=0.5)
    if name == "twin-flow-mem":
        if twin_ratio is None:
            raise ValueError("twin-flow-mem's ratio is decided by run_bench (twin_flow_host_ratio)")
        return OffloadSettings(sub_group_size=sgs, ratio=twin_ratio)
    if name == "superoffload":
        return OffloadSettings(sub_group_size=sgs, ratio=1.0, super_offload=True)
    v = opts.variant(name)
    sched = v.schedule if v is not None else (opts.schedule or ScheduleConfig())
    dsgs = v.sub_group_size if v is not None else opts.dostune_sub_group_size
    # pin_memory off: dostune page-locks DeepSpeed's buffers in place, without the power-of-two rounding
    # (optim/footprint.py)
    return OffloadSettings(sub_group_size=dsgs or sgs, ratio=1.0, pin_memory=False,
                           schedule=sched.model_copy(update={"trace": True}))


def twin_flow_matching_ratio(params: int, dostune_peak: float, offload_peak: float) -> float:
    """Twin-Flow keeps (1 - ratio) of fp32 params, exp_avg, exp_avg_sq and grads (16 bytes per element) on the
    GPU: the ratio whose extra memory equals dostune's extra peak over ZeRO-Offload."""
    if params <= 0:
        raise DostuneError(f"Twin-Flow's matching ratio needs the model's parameter count, got {params}")
    extra = max(0.0, dostune_peak - offload_peak) * 2**30
    return round(min(1.0, max(0.0, 1.0 - extra / (16.0 * params))), 3)


def twin_flow_host_ratio(matched: Optional[float], sub_group_size: int, numels: list[int], precision: str,
                         host_available: Optional[int]) -> tuple[float, str]:
    """twin-flow-mem's ratio and what to say of it: ``matched`` (dostune's peak GPU memory; None where ZeRO-Offload
    did not run to match it against) where this host's memory holds it, else the largest ratio, in hundredths, that it
    holds (Twin-Flow then keeps more on the GPU than dostune; a llama-13b on a 125 GiB host holds none that matches).
    DostuneError where it holds none above 0 (ratio 0 is no offload)."""
    def fits(ratio: float) -> bool:
        try:
            fit_host_memory("twin-flow-mem", OffloadSettings(sub_group_size=sub_group_size, ratio=ratio), numels,
                            precision, host_available)
        except DostuneError:
            return False
        return True

    if matched is not None and fits(matched):
        return matched, ""
    top = round(100 * matched) if matched is not None else 100
    held = next((k / 100 for k in range(top, 0, -1) if fits(k / 100)), None)
    why = (f"dostune's GPU memory would need ratio {matched}" if matched is not None
           else "ZeRO-Offload did not run to match dostune's GPU memory against")
    if held is None:
        raise DostuneError(f"not run: this host's memory holds no ratio of Twin-Flow's offload above 0 ({why})")
    return held, f"the largest this host's memory holds; {why}"


def _build_and_measure(name: str, spec: ModelSpec, opts: BenchOptions, cfg: dict, progress: ProgressSink) -> MethodResult:
    from ..train.engine import build_engine

    begun = []

    def phase(what: str) -> None:  # one progress line per part of the build: which part takes the time shows
        if begun:
            progress.advance()
        begun.append(what)
        progress.start(f"{name}: {what}", 1)

    reset_host_peaks()
    engine = build_engine(spec, cfg, seed=opts.seed, use_dostune=is_dostune(name), phase=phase)
    try:
        progress.advance()
        progress.start(f"{name}: {opts.warmup} warm-up + {opts.iters} timed iterations", opts.warmup + opts.iters)
        m = measure(engine, spec, opts.seq, opts.iters, opts.warmup, opts.seed, progress)
        host_rss, host_pinned = peak_rss_bytes(), pinned_bytes(engine.optimizer)
        params = sum(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat) \
            if hasattr(engine.optimizer, "fp32_partitioned_groups_flat") else spec.num_params
        timeline, description = [], opts.describe(name)
        if is_dostune(name):
            # Spans before 0 ran during backward (overlap_backward).
            timeline = list(engine.optimizer.dostune_last_trace)
            st = engine.optimizer.dostune_overlap_stats
            if st["steps"]:
                description += (f"; overlap_backward: {st['speculative']} of {st['committed']} CPU-lane updates "
                                f"started during backward, {st['redone']} of them recomputed (clipping)")
            sw = engine.optimizer.dostune_swing_stats
            if sw["steps_by_swing"]:
                description += (f"; adaptive_swing: steps by swing {steps_by_swing_text(sw['steps_by_swing'])} "
                                f"(+k: k GPU-lane subgroups on the CPU lane, -k: k CPU-lane subgroups on the GPU "
                                f"lane), {signed_swing(sw['swing'])} at the end")
            ph = engine.optimizer.dostune_step_phases
            if ph:
                description += ("; step host time, median ms: " +
                                ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in ph.items()))
    finally:
        engine.destroy()
    return MethodResult(method=name, description=description, iter_s=m["iter"].median, fwd_s=m["fwd"].median,
                        bwd_s=m["bwd"].median, step_s=m["step"].median, iter=m["iter"], fwd=m["fwd"],
                        bwd=m["bwd"], step=m["step"],
                        peak_gpu_gib=round(m["peak"], 3) if m["peak"] is not None else None,
                        phase_peak_gib={k: round(v, 3) for k, v in m["phase_peaks"].items()}
                        if m["phase_peaks"] else {},
                        update_gelem_s=round(params / m["step"].median / 1e9, 3), final_loss=m["losses"][-1],
                        losses=m["losses"], ds_config=cfg, timeline=timeline, samples=m["samples"],
                        round_iter_s=[m["iter"].median], round_step_s=[m["step"].median], steal=m["steal"],
                        round_steal=[m["steal"]] if m["steal"] is not None else [], set_aside=m["set_aside"],
                        swing=m["swing"], host_peak_rss_gib=gib(host_rss), host_pinned_gib=gib(host_pinned))


def gpu_allocated_gib() -> Optional[float]:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


def run_method(name: str, spec: ModelSpec, opts: BenchOptions, offload: OffloadSettings,
               progress: ProgressSink) -> MethodResult:
    """One method's measurement: in its own process unless ``opts.isolate`` is off or this is one rank of several
    (see the module's docstring). Never raises for a method that fails: the result says what happened (``ran``
    False, ``error``)."""
    if World.of_run().size > 1:
        return combine_ranks(gather_ranks(run_method_here(name, spec, opts, offload, progress)))
    if opts.isolate:
        from .isolate import run_isolated

        return run_isolated(name, opts, offload, progress)
    return run_method_here(name, spec, opts, offload, progress)


def run_method_here(name: str, spec: ModelSpec, opts: BenchOptions, offload: OffloadSettings,
                    progress: ProgressSink) -> MethodResult:
    cfg = deepspeed_config(opts.train, offload)
    free_engine_memory()
    before = gpu_allocated_gib()
    try:
        # The engine lives only inside _build_and_measure: once it returns, nothing here refers to it and the
        # collection below frees its GPU memory before the next method is measured.
        res = _build_and_measure(name, spec, opts, cfg, progress)
        res.allocated_before_gib = round(before, 3) if before is not None else None
        return res
    except (Exception, SystemExit) as e:  # a method that cannot run here is reported, not fatal
        if isinstance(e, DostuneError):
            msg = str(e) + (f" (hint: {e.hint})" if e.hint else "")
        else:
            msg = f"{type(e).__name__}: {e}".strip() + "\n" + traceback.format_exc(limit=3)
        return MethodResult(method=name, description=opts.describe(name), ran=False, error=msg[:2000],
                            ds_config=cfg)
    finally:
        free_engine_memory()


def train_settings(opts: BenchOptions) -> TrainSettings:
    return replace(opts.train, micro_batch=opts.micro_batch, precision=opts.precision, clip=opts.clip,
                   activation_checkpointing=opts.activation_checkpointing)


def check_bench_options(opts: BenchOptions) -> tuple[ModelSpec, int, list[str]]:
    """Everything a bench can refuse before the first engine (minutes on a GPU), refused now; returns the model,
    its parameter count and the methods in the order they run."""
    if opts.rounds < 1:
        raise DostuneError(f"--rounds must be at least 1, got {opts.rounds}")
    if opts.iters < 1 or opts.warmup < 0 or opts.micro_batch < 1 or opts.seq < 1:
        raise DostuneError("--iters, --micro-batch and --seq must be at least 1, --warmup at least 0")
    methods = opts.resolved_methods()
    spec = resolve_model(opts.model)
    spec.check_seq(opts.seq)
    check_precision(opts.precision, hint="leave --precision out for bf16, the default")
    train_settings(opts).validate()
    numels = param_numels(spec)  # a factory model has no analytic count: count its parameters (meta build)
    for name in methods:
        if is_dostune(name):
            off = method_offload(name, opts, None)
            cfg = {"zero_optimization": {"sub_group_size": off.sub_group_size},
                   "dostune": off.schedule.model_dump(exclude_none=True)}
            v = opts.variant(name)
            tuned = v.world if v is not None else opts.dostune_world
            if tuned is not None:
                cfg[WORLD_KEY] = tuned.as_config()
            check_fits(cfg, spec, v.source if v and v.source else f"the {name} schedule")
    check_deepspeed("dostune bench")
    return spec, spec.num_params or sum(numels), methods


def gpu_name() -> Optional[str]:
    """The GPU's name, read through NVML so that this process does not start CUDA (the methods run in their
    own processes and get the whole GPU)."""
    if not cuda_available():
        return None
    with nvml() as nv:
        if nv is not None:
            try:
                name = nv.nvmlDeviceGetName(nvml_handle(nv, 0))
                return name.decode() if isinstance(name, bytes) else name
            except nv.NVMLError:
                pass
    return torch.cuda.get_device_name()


def node_label(opts: BenchOptions, gpu: Optional[str] = None) -> str:
    """--node, else the GPU's name (``gpu`` where the caller has read it), else the host's cores."""
    return opts.node or gpu or gpu_name() or f"cpu-{os.cpu_count()}c"


def bench_record(opts: BenchOptions, params: int, methods: dict[str, MethodResult], created: Optional[str] = None,
                 command: Optional[str] = None) -> BenchResult:
    """The bench record of ``methods`` (each pooled over its rounds) measured with ``opts`` on this machine."""
    gpu, world = gpu_name(), World.of_run()
    return BenchResult(
        created=created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=command or invocation(), dostune_version=__version__, deepspeed_version=deepspeed_version(),
        torch_version=torch.__version__, node=node_label(opts, gpu), gpu=gpu,
        model=opts.model, params=params, micro_batch=opts.micro_batch, seq=opts.seq, precision=opts.precision,
        clip=opts.clip, warmup=opts.warmup, iters=opts.iters, rounds=opts.rounds, seed=opts.seed,
        world_size=world.size, nodes=world.nodes, methods=methods)


def run_bench(opts: BenchOptions, progress: Optional[ProgressSink] = None, command: Optional[str] = None,
              on_result: Optional[Callable[[BenchResult], None]] = None) -> BenchResult:
    """Measure every method; ``on_result`` gets the result so far after each method, so that a caller can keep
    what finished (the CLI writes it out) whatever happens to the rest."""
    progress = progress or NullProgress()
    spec, params, methods = check_bench_options(opts)
    opts.train = train_settings(opts)
    runs: dict[str, list[MethodResult]] = {name: [] for name in methods}
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

    def result() -> BenchResult:
        return bench_record(opts, params, {name: pool_rounds(runs[name]) for name in methods if runs[name]},
                            created=created, command=command)

    numels = param_numels(spec)
    host_available = opts.host_available_bytes if opts.host_available_bytes is not None else available_host_bytes()
    if host_available is not None:  # the ranks of one node share it
        host_available //= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    twin: Optional[tuple[float, str]] = None  # twin-flow-mem's ratio and what to say of it, once decided
    for r in range(opts.rounds):
        # Reversed every other round: a machine that drifts over minutes then favours no method.
        for name in (methods if r % 2 == 0 else methods[::-1]):
            sink = RoundProgress(progress, f"round {r + 1}/{opts.rounds}: ") if opts.rounds > 1 else progress
            try:
                if name == "twin-flow-mem" and twin is None:
                    d, z = runs.get("dostune"), runs.get("zero-offload")
                    matched = None
                    if d and d[0].ran and z and z[0].ran and d[0].peak_gpu_gib is not None:
                        matched = twin_flow_matching_ratio(params, d[0].peak_gpu_gib, z[0].peak_gpu_gib)
                    elif not (d and d[0].ran):
                        raise DostuneError("not run: its ratio is sized from dostune's peak GPU memory, and dostune "
                                           "did not run")
                    twin = twin_flow_host_ratio(matched, opts.sub_group_size, numels, opts.precision, host_available)
                twin_ratio = twin[0] if twin is not None else None
                off, note = fit_host_memory(name, method_offload(name, opts, twin_ratio), numels, opts.precision,
                                            host_available)
            except DostuneError as e:
                res = MethodResult(method=name, description=opts.describe(name), ran=False, error=str(e))
            else:
                res = run_method(name, spec, opts, off, sink)
                if note and res.ran:
                    res.description += f" ({note})"
            if name == "twin-flow-mem" and twin is not None:  # a row that failed says at which ratio too
                res.description += f" (ratio {twin[0]}{': ' + twin[1] if twin[1] else ''})"
            runs[name].append(res)
            if on_result is not None and rank() == 0:  # every rank holds the same result; rank 0 keeps it
                on_result(result())
    return result()


class RoundProgress:
    """Progress of one round: the round's number before each description."""

    def __init__(self, inner: ProgressSink, prefix: str):
        self.inner, self.prefix = inner, prefix

    def start(self, description: str, total: int) -> None:
        self.inner.start(self.prefix + description, total)

    def advance(self, n: int = 1) -> None:
        self.inner.advance(n)
