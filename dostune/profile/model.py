"""`dostune profile --model`: a model's side of the picture under DeepSpeed ZeRO-3 with CPU optimizer offload.

Measures forward / backward / step times, a memory timeline sampled at module boundaries, when each optimizer
subgroup's gradients become final during backward, PCIe traffic per phase (the last three watched by
iteration_observers.py), DeepSpeed's step by part (step_parts.py), and after the timed iterations backward without
the gradient copies, alone and beside dostune's CPU-lane kernel (backward_probes.py); then the step timed again in a
second window (model_record.StepWindow). memory_figure.py draws the memory timeline.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .._version import __version__
from ..dsconfig import DEFAULT_SUB_GROUP_SIZE, OffloadSettings, TrainSettings, deepspeed_config
from ..errors import DostuneError
from ..host_memory import fit_host_memory
from ..host_steal import QuietRuns, set_aside_text, steal_note
from ..invocation import invocation
from ..models.registry import loss_of, resolve_model
from ..optim.footprint import available_host_bytes
from ..perfmodel.subgroups import param_numels
from ..perfmodel.world import World, gather_ranks
from ..stats import Stat
from . import identity
from .backward_probes import measure_backward_probes
from .iteration_observers import GradReadiness, MemoryReader, MemoryRecorder, PcieSampler, install_memory_hooks
from .step_lane import measure_step_lane
from .model_record import (MODEL_SCHEMA_VERSION, ModelMode, ModelProfile, PhaseProfile, RankProfile, StepWindow,
                           SubgroupProfile, WorldRecord, slowest_phases)
from .step_parts import StepParts
from .timing import NullProgress, ProgressSink, iteration_phases, sync_device

GiB = 2**30


@dataclass(frozen=True)
class ModelEffort:
    """How much a mode measures: timed iterations in each of the step's two windows (and the least rounds of the
    backward probes), the seconds the probes' rounds are spread over on a GPU, and rounds of the step-lane probe."""

    iters: int
    probe_seconds: float
    step_lane_rounds: int
    second_window: bool  # time ZeRO-Offload's step again after the probes (StepWindow)


# Backward's host-bound passes run at a pace that wanders in stretches of seconds, so the probes' rounds are spread
# over a span of the host's time rather than run a few in a row, which would read one stretch. "thorough" (for
# validation work) spreads them over a minute (three read one process's pace more closely but predicted no better)
# with five iterations a window, the defaults before the modes existed. "standard" (the default) takes
# every figure "thorough" takes, over a sixth of the span and with three iterations a window, for a first profile
# in less time; scripts/profile-accuracy.sh measures what the longer one buys.
MODEL_EFFORT = {"standard": ModelEffort(iters=3, probe_seconds=10.0, step_lane_rounds=10, second_window=False),
                "thorough": ModelEffort(iters=5, probe_seconds=60.0, step_lane_rounds=20, second_window=True)}
# the step-lane probe's subgroups' least size (a small model's backward-probe scratch is smaller than any subgroup worth
# modelling)
STEP_LANE_MIN_ELEMENTS = 1_000_000


@dataclass
class ModelProfileOptions:
    """What to measure; the defaults are the standard mode's (``of_mode`` takes another's)."""

    model: str = "gpt2-1.3b"
    micro_batch: int = 8
    seq: int = 1024
    precision: str = "bf16"
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    reduce_bucket_size: int = 50_000_000  # DeepSpeed's gradient bucket: grads become final bucket by bucket
    mode: ModelMode = "standard"
    iters: int = MODEL_EFFORT["standard"].iters
    warmup: int = 2
    seed: int = 0
    node: Optional[str] = None
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # the scratch subgroup the CPU-lane kernel updates beside backward (backward_probes.py); None: a 16th of the
    # model, between 64K and 10M elements (~3 ms per update on the H100 host)
    lane_elements: Optional[int] = None
    # the seconds the backward probes' rounds are spread over (backward_probes.py); None: the mode's on a GPU, 0
    # (``iters`` rounds in a row) on a CPU machine, whose profile tunes nothing real
    probe_seconds: Optional[float] = None
    step_lane_rounds: int = MODEL_EFFORT["standard"].step_lane_rounds
    # ZeRO-Offload's step timed again after the probes, a second draw of the host's speed that the model averages
    # with the first; the standard mode leaves it to --thorough (a window of a 1B model's iterations takes ~8 s)
    second_window: bool = MODEL_EFFORT["standard"].second_window

    @classmethod
    def of_mode(cls, mode: str, **given) -> "ModelProfileOptions":
        """``mode``'s counts, but for those ``given`` (None: the mode's)."""
        if mode not in MODEL_EFFORT:
            raise DostuneError(f"unknown model profile mode {mode!r}: " + " or ".join(MODEL_EFFORT))
        effort = MODEL_EFFORT[mode]
        given = {k: v for k, v in given.items() if v is not None}
        return cls(**({"mode": mode, "iters": effort.iters, "step_lane_rounds": effort.step_lane_rounds,
                        "second_window": effort.second_window} | given))

    def resolved_probe_seconds(self, cuda: bool) -> float:
        if self.probe_seconds is not None:
            return self.probe_seconds
        return MODEL_EFFORT[self.mode].probe_seconds if cuda else 0.0

    def validate(self) -> None:
        if self.mode not in MODEL_EFFORT:
            raise DostuneError(f"unknown model profile mode {self.mode!r}: " + " or ".join(MODEL_EFFORT))
        if self.step_lane_rounds < 1:
            raise DostuneError(f"step_lane_rounds must be positive, got {self.step_lane_rounds}")
        if self.iters < 1 or self.warmup < 0 or self.micro_batch < 1 or self.seq < 1 or self.sub_group_size < 1:
            raise DostuneError("--iters, --micro-batch, --seq and --sub-group-size must be positive, --warmup >= 0")
        if self.probe_seconds is not None and not self.probe_seconds >= 0:
            raise DostuneError(f"--probe-seconds must be 0 or more, got {self.probe_seconds}")
        if self.lane_elements is not None and self.lane_elements < 1:
            raise DostuneError(f"lane_elements must be positive, got {self.lane_elements}")


def measure_model(opts: ModelProfileOptions, progress: Optional[ProgressSink] = None,
                  command: Optional[str] = None) -> ModelProfile:
    from ..train.engine import build_engine, free_engine_memory

    opts.validate()
    progress = progress or NullProgress()
    spec = resolve_model(opts.model)
    if spec.max_seq is not None and opts.seq > spec.max_seq:
        raise DostuneError(f"--seq {opts.seq} exceeds {opts.model}'s {spec.max_seq} positions")
    cuda = identity.cuda_available()
    notes = [] if cuda else ["measured on the CPU: memory is the process's RSS and times are CPU times; "
                             "GPU figures need a GPU"]
    train = TrainSettings(micro_batch=opts.micro_batch, precision=opts.precision,
                          activation_checkpointing=opts.activation_checkpointing)
    if opts.activation_checkpointing:
        notes.append("activation checkpointing on: backward includes each block's recomputed forward, and memory "
                     "holds only the blocks' inputs between forward and backward")
    offload = OffloadSettings(sub_group_size=opts.sub_group_size, ratio=1.0,
                              extra_zero={"reduce_bucket_size": opts.reduce_bucket_size})
    # ZeRO-Offload as this host's memory holds it (without pin_memory where its pinned copies would not fit: the
    # OOM killer would end the profile otherwise); a model whose state cannot fit at all stops here, in one line
    try:
        offload, host_note = fit_host_memory("zero-offload", offload, param_numels(spec), opts.precision,
                                             available_host_bytes())
    except DostuneError as e:
        raise DostuneError(f"{opts.model}'s model profile measures ZeRO-Offload's iterations, which this host cannot "
                           f"hold: {str(e).removeprefix('not run: ')}",
                           hint="profile it where ZeRO-Offload's state fits (a node with more host memory, or spread "
                                "over several nodes); `dostune plan --model MODEL` shows what each method needs") from e
    if host_note:
        notes.append(f"ZeRO-Offload measured with {host_note}")
    cfg = deepspeed_config(train, offload)
    progress.start(f"{opts.model}: building the ZeRO-3 offload engine", 1)
    engine = build_engine(spec, cfg, seed=opts.seed, use_dostune=False)
    progress.advance()
    mem = MemoryReader(cuda)
    rec = MemoryRecorder(mem)
    handles = install_memory_hooks(engine.module, rec)
    ready = GradReadiness(engine.optimizer, cuda)
    overhead = StepParts(engine.optimizer)
    pcie = PcieSampler(torch.cuda.current_device(), lambda: rec.phase) if cuda else None
    if pcie:
        pcie.start()
    peaks = {ph: 0.0 for ph in ("fwd", "bwd", "step")}
    peaks_res = {ph: 0.0 for ph in peaks}
    gen = torch.Generator().manual_seed(opts.seed + 1)
    # the last iteration records the memory timeline and when gradients are final; its hooks slow it (backward by up
    # to 1.6x in the profiles before schema 3, which timed it too), so it is not one of the timed ones
    total = opts.warmup + opts.iters + 1
    progress.start(f"{opts.model}: {opts.warmup} warm-up + {opts.iters} profiled iterations + 1 recorded", total)
    backward_s = 0.0

    def iteration(timed: bool = False, last: bool = False,
                  peak: bool = True) -> tuple[dict[str, float], int, float, Optional[float]]:
        """One iteration: its phases' seconds, its place among StepParts' closed steps and its step overhead (-1 and
        0 untimed), and its gradient norm; ``peak``: a timed one counts towards the phases' memory peaks."""
        nonlocal backward_s
        batch = spec.batch(opts.micro_batch, opts.seq, gen, engine.device)
        sync_device()
        if last:
            rec.start()
        secs, closed, step_overhead = {}, -1, 0.0
        for ph in ("fwd", "bwd", "step"):
            rec.phase = ph
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if ph == "bwd" and last:
                ready.begin()
            overhead.reset()
            rec.sample(f"{ph}:begin")
            t0 = time.perf_counter()
            if ph == "fwd":
                loss = loss_of(engine(**batch))
            elif ph == "bwd":
                engine.backward(loss)
            else:
                engine.step()
            sync_device()
            secs[ph] = dt = time.perf_counter() - t0
            rec.sample(f"{ph}:end")
            if ph == "bwd" and last:
                backward_s = dt
            if timed:
                if ph == "step":
                    step_overhead = overhead.close(dt)
                    closed = len(overhead.steps) - 1
                if cuda and peak:
                    peaks[ph] = max(peaks[ph], torch.cuda.max_memory_allocated() / GiB)
                    peaks_res[ph] = max(peaks_res[ph], torch.cuda.max_memory_reserved() / GiB)
        rec.active = False
        progress.advance()
        return secs, closed, step_overhead, grad_norm(engine)

    # iterations the hypervisor took from are set aside and run again (QuietRuns): every rate the model takes from
    # this profile is then the machine's own, as the runs checked against it keep theirs
    def quiet_runs() -> QuietRuns:
        return QuietRuns(opts.iters, gather=gather_ranks, on_set_aside=lambda share, left: progress.start(
            f"{opts.model}: an iteration set aside: the hypervisor took {share:.1%} of the CPU (steal); at most {left} "
            "more", left + 1))

    timed_runs = quiet_runs()
    later_window = None  # StepWindow: --thorough only
    try:
        for _ in range(opts.warmup):
            iteration()
        while timed_runs.more():
            timed_runs.start()
            timed_runs.stop(iteration(timed=True))
        first_end = time.perf_counter()
        iteration(last=True)
        if pcie:  # the traffic of the iterations above alone: the probes and the later window leave its phase label
            pcie.stop_flag.set()
        kept = timed_runs.kept()
        times = {ph: [secs[ph] for secs, *_ in kept] for ph in peaks}
        overheads = [o for _, _, o, _ in kept]
        grad_norms = [norm for *_, norm in kept]
        overhead.keep_steps([closed for _, closed, *_ in kept])
        grad_ready = ready.per_subgroup()
        opt = engine.optimizer
        subgroups = [SubgroupProfile(index=i, numel=int(opt.fp16_partitioned_groups_flat_numel[i]),
                                     params=len(g), grad_ready_s=grad_ready[i])
                     for i, g in enumerate(opt.fp16_groups)]
        numel = sum(s.numel for s in subgroups)
        step_parts, ds_cpu_adam, ds_unscale = overhead.summary([s.numel for s in subgroups])

        def backward_pass() -> tuple[float, float, float]:
            _, fwd, bwd, _ = iteration_phases(engine, spec.batch(opts.micro_batch, opts.seq, gen, engine.device),
                                              step=False)
            end = time.perf_counter()
            return fwd, end - bwd, end

        lane_elements = opts.lane_elements or min(10_000_000, max(65_536, numel // 16))
        # the lane's gradients and results in the training's half precision (bf16 for an fp32 profile: the probe is
        # about how the two slow each other, which the dtype barely changes)
        half = torch.float16 if opts.precision == "fp16" else torch.bfloat16
        probe_seconds = opts.resolved_probe_seconds(cuda)
        probes = measure_backward_probes(opt, backward_pass, opts.iters, lane_elements, half, progress,
                                         gather=gather_ranks, seconds=probe_seconds)
        notes += probes.notes
        # The step again, after the probes: a second draw of the host's speed (StepWindow). One untimed iteration first:
        # the probes' backward passes left gradients that no step took, which its step takes (and their memory peaks
        # are not the training's, so these iterations count towards none).
        if opts.second_window:
            progress.start(f"{opts.model}: 1 warm-up + {opts.iters} iterations timed again, the step's second window",
                           opts.iters + 1)
            iteration()
            later_runs = quiet_runs()
            after_s = time.perf_counter() - first_end
            while later_runs.more():
                later_runs.start()
                later_runs.stop(iteration(timed=True, peak=False))
            later = later_runs.kept()
            overhead.keep_steps([closed for _, closed, *_ in later])
            _, later_adam, later_unscale = overhead.summary([s.numel for s in subgroups])
            # under the launcher the slowest rank's step, as the first window's phases
            later_step = max(gather_ranks(Stat.of([secs["step"] for secs, *_ in later])), key=lambda t: t.median)
            later_window = StepWindow(after_s=round(after_s, 3), step_s=later_step,
                                      step_overhead_s=max(gather_ranks(Stat.of([o for _, _, o, _ in later]).median)),
                                      ds_cpu_adam=later_adam, ds_unscale=later_unscale, steal=later_runs.share,
                                      set_aside=later_runs.set_aside())
    finally:
        for h in handles:
            h.remove()
        ready.restore()
        overhead.restore()
        if pcie:
            pcie.stop_flag.set()
            pcie.join(timeout=1)
        engine.destroy()
        del engine
        free_engine_memory()

    step_lane = None
    if cuda and probes.lane is not None:  # the lane's kernel built: measure it as the step runs it (step_lane.py)
        try:
            step_lane = measure_step_lane(max(lane_elements, STEP_LANE_MIN_ELEMENTS), torch.get_num_threads(), half,
                                          opts.step_lane_rounds, torch.cuda.current_device(), progress)
        except (DostuneError, OSError, RuntimeError) as e:
            notes.append(f"the CPU lane beside the step's copies not measured ({str(e).splitlines()[0]}): the tuner "
                         "takes the step's lane from the backward probes' reading; fix that and profile again to "
                         "measure it")
    gpu_total = torch.cuda.get_device_properties(0).total_memory / GiB if cuda else None
    phases = {}
    for ph in times:
        in_phase = [s for s in rec.samples if s.phase == ph]
        peak = peaks[ph] if cuda else max(s.allocated_gib for s in in_phase)
        phases[ph] = PhaseProfile(time_s=Stat.of(times[ph]), peak_allocated_gib=round(peak, 3),
                                  min_allocated_gib=round(min(s.allocated_gib for s in in_phase), 3),
                                  peak_reserved_gib=round(peaks_res[ph] if cuda else peak, 3),
                                  free_gib=round(gpu_total - peak, 3) if gpu_total else None)
    node = opts.node or identity.node_name(identity.gpu_info(0) if cuda else None)
    overhead_s = Stat.of(overheads).median
    note = steal_note(timed_runs.share, "ZeRO-Offload's iterations were timed")
    for aside, what in ((timed_runs.set_aside(), ("timed iteration", "timed iterations")),
                        (probes.set_aside, ("round of the backward probes", "rounds of the backward probes"))):
        text = set_aside_text(aside, what)
        if text:
            notes.append(f"{text}; the figures are the kept ones'")
    if note:
        notes.append(note)
    world, ranks = World.of_run(), []
    if world.size > 1:  # under the launcher: every rank measured its own partition; the slowest rank sets the pace
        ranks = [RankProfile(rank=r, phases=ph, step_overhead_s=o)
                 for r, ph, o in gather_ranks((int(os.environ.get("RANK", "0")), phases, overhead_s))]
        phases = slowest_phases([r.phases for r in ranks])
        overhead_s = max(r.step_overhead_s for r in ranks)
        notes.append(f"measured under the launcher on {world.describe()}: each phase is the slowest rank's, memory the "
                     "highest of any rank; subgroups and gradient readiness are rank 0's partition")
    return ModelProfile(
        schema_version=MODEL_SCHEMA_VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=command or invocation(), dostune_version=__version__, mode=opts.mode, node=node,
        device="cuda" if cuda else "cpu",
        gpu_total_gib=round(gpu_total, 3) if gpu_total else None, model=opts.model, architecture=spec.config,
        params=spec.num_params or numel, micro_batch=opts.micro_batch, seq=opts.seq, precision=opts.precision,
        sub_group_size=opts.sub_group_size, iterations=opts.iters, subgroups=subgroups,
        optimizer_state_bytes=16 * numel, phases=phases, step_overhead_s=overhead_s, backward_s=backward_s,
        world=WorldRecord(**world.as_config()), ranks=ranks, memory_timeline=rec.samples,
        pcie=pcie.summary() if pcie else None, offload_pin_memory=offload.pin_memory,
        backward_no_copy_s=probes.no_copy, backward_lane=probes.lane, backward_pinned_copy=probes.pinned_copy,
        step_parts_s=step_parts, ds_cpu_adam=ds_cpu_adam, ds_unscale=ds_unscale, steal=timed_runs.share,
        set_aside=timed_runs.set_aside(), probes_set_aside=probes.set_aside, probe_seconds=probe_seconds,
        probe_forward_s=probes.forward, probe_rounds=probes.rounds, step_lane=step_lane, later_window=later_window,
        grad_norms=grad_norms, clip_threshold=train.clip, notes=notes)


def grad_norm(engine) -> Optional[float]:
    """The global gradient norm DeepSpeed computed for clipping at the engine's last step, unscaled (the same on every
    rank); None for a step it skipped (an overflow) or where the engine did not compute one."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    norm = float(norm)
    return norm if math.isfinite(norm) else None


def model_profile_name(node: str, model: str, micro_batch: int, seq: int, world: World = World()) -> str:
    """The file name `dostune tune` looks for beside the node profile: NODE-MODEL-bB-sS.json for one rank,
    NODE-MODEL-bB-sS-MxN.json for M nodes of N GPUs."""
    suffix = f"-{world.nodes}x{world.gpus_per_node}" if world.size > 1 else ""
    return f"{node}-{model}-b{micro_batch}-s{seq}{suffix}.json"
