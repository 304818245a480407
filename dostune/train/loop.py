"""`dostune train`: training runs with a DeepSpeed config (and its dostune section), checkpoints and resume."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from ..dsconfig import activation_checkpointing, plain_deepspeed_config, with_activation_checkpointing
from ..errors import ConfigError, DostuneError
from ..models.registry import ModelSpec, resolve_model
from ..optim.schedule import ScheduleConfig
from ..profile.timing import iteration_phases
from ..deepspeed_support import check_deepspeed
from ..records import check_writable, read_json_record
from ..tune.refit import check_fits
from .checkpoint import load_latest, read_latest, save
from .data import make_data
from .engine import build_engine, free_engine_memory
from .faults import (RankLost, StepWatchdog, StopSignals, agree_stop, default_rank_timeout, describe,
                     is_lost_rank_error, lost_rank_message, stop_exit_code)


class Interrupted(DostuneError):
    """A stop signal ended the run after a checkpoint; exit code 128 + the signal's number."""

    def __init__(self, message: str, signum: int, **kw):
        super().__init__(message, **kw)
        self.exit_code = stop_exit_code(signum)


@dataclass
class TrainOptions:
    config: Path
    model: str = "gpt2-1.3b"
    steps: int = 100
    seq: int = 1024
    data: Optional[Path] = None
    tokenizer: Optional[Path] = None
    seed: int = 0
    save_dir: Optional[Path] = None
    save_every: int = 0
    resume: bool = False
    log_every: int = 10
    metrics: Optional[Path] = None
    plain_deepspeed: bool = False  # ignore the dostune section
    deterministic: bool = False  # PyTorch's deterministic kernels: fewer run-to-run differences on a GPU
    activation_checkpointing: bool = False  # on even where the config has no activation_checkpointing section
    rank_timeout: Optional[float] = None  # seconds; a lost rank stops the others after it (None: DeepSpeed's 10 min)
    resume_command: Optional[str] = None  # the command that continues this run, quoted in stop messages


def use_deterministic_kernels() -> None:
    """Some CUDA backward kernels (embedding, flash attention's dq) accumulate with atomics, so two identical
    steps can differ in the last bits of a gradient; a resumed run then drifts from an uninterrupted one however
    exact the checkpoint is. PyTorch's deterministic mode picks ordered kernels instead, at some speed cost.
    Strict mode on purpose: with warn_only=True PyTorch merely warns about flash attention's backward and keeps
    its racy kernel (that is what left one qkv weight gradient varying on the H100)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS first initialises
    torch.use_deterministic_algorithms(True)


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    iter_s: float
    fwd_s: float
    bwd_s: float
    step_s: float
    tokens_per_s: float
    gpu_mem_gib: Optional[float]
    grad_norm: Optional[float]
    # adaptive_swing: the swing this step ran (k > 0: k GPU-lane subgroups on the CPU lane, k < 0: -k CPU-lane
    # subgroups on the GPU lane); None without one
    swing: Optional[int] = None


@dataclass
class TrainSummary:
    steps_run: int
    first_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    optimizer: str = ""
    interrupted: bool = False
    stop_signal: int = 0  # the signal that stopped the run (0: it ran to --steps)


def load_ds_config(path: Path) -> dict:
    cfg = read_json_record(path, "DeepSpeed config")
    ScheduleConfig.from_ds_config(cfg)  # a malformed dostune section fails here, before any work
    activation_checkpointing(cfg)  # ... and so does a malformed activation_checkpointing section
    auto = _auto_keys(cfg)
    if auto:
        # DeepSpeed itself cannot read "auto": only the HF Trainer and Accelerate fill those values in
        raise ConfigError(f"{path} leaves {', '.join(auto[:4])}{' ...' if len(auto) > 4 else ''} as \"auto\" for the "
                          "Hugging Face Trainer or Accelerate to fill in; dostune train needs them concrete",
                          hint="use the config `dostune tune` writes without --for (or --for deepspeed), or run it "
                               "from the Trainer / Accelerate, which fill them in")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tb, mb, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))
    if isinstance(tb, int) and isinstance(mb, int) and isinstance(gas, int) and tb != mb * gas * world:
        raise ConfigError(f"{path}: train_batch_size {tb} != micro-batch {mb} x gradient accumulation {gas} x "
                          f"{world} GPU(s)",
                          hint="remove train_batch_size from the config (DeepSpeed derives it from the other two "
                               "and the number of GPUs), or make it match")
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        raise ConfigError(f"{path}: dostune trains with ZeRO stage 3; set zero_optimization.stage to 3",
                          hint="or make the config with `dostune tune`, which writes stage 3")
    return cfg


def _auto_keys(cfg, prefix: str = "") -> list[str]:
    """The dotted keys whose value is "auto" (left for the HF Trainer or Accelerate to fill)."""
    if isinstance(cfg, dict):
        return [k for key, v in cfg.items() for k in _auto_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if cfg == "auto" else []


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass
class Prepared:
    """What check_options read and checked, for train() to run without reading it again (a corpus is tokenised
    once)."""

    ds_config: dict
    spec: ModelSpec
    data: object  # data.SyntheticData or data.TextCorpus


def check_options(opts: TrainOptions) -> Prepared:
    """Everything train() can refuse before building the engine (which takes minutes for a large model),
    refused now: the config and its schedule against the model, the paths, the data, the DeepSpeed release."""
    if opts.steps < 1:
        raise DostuneError(f"--steps must be at least 1, got {opts.steps}")
    if opts.resume and opts.save_dir is None:
        raise DostuneError("--resume needs --save-dir (where the checkpoints are)",
                           hint="give --save-dir the folder the interrupted run saved into")
    cfg = load_ds_config(Path(opts.config))
    spec = resolve_model(opts.model)
    spec.check_seq(opts.seq)
    check_deepspeed("dostune train")
    latest = None
    if opts.save_dir is not None:
        check_writable(opts.save_dir, "--save-dir", directory=True)
        latest = read_latest(Path(opts.save_dir))
        if not opts.resume and latest is not None:
            # A fresh run would overwrite the step tags of an earlier one and mix their histories.
            raise DostuneError(f"{opts.save_dir} already holds checkpoints (latest: {latest}); they were left as "
                               "they are", hint="pass --resume to continue that run, or choose another --save-dir")
    if opts.resume and latest is None:
        raise DostuneError(f"--resume: no checkpoint in {opts.save_dir} (DeepSpeed writes a 'latest' file there)",
                           hint="give --save-dir the folder the interrupted run saved into, or drop --resume")
    if opts.metrics is not None:
        check_writable(opts.metrics, "--metrics")
    if not opts.plain_deepspeed:
        check_fits(cfg, spec, str(opts.config))  # and the world it was tuned for, against the launcher's
    data = make_data(spec, opts.data, opts.tokenizer, opts.seed, opts.seq)
    return Prepared(cfg, spec, data)


def train(opts: TrainOptions, on_step: Optional[Callable[[StepRecord], None]] = None,
          prepared: Optional[Prepared] = None) -> TrainSummary:
    """Run ``opts``; ``prepared``: check_options(opts) already called (the CLI calls it before its progress bar)."""
    prepared = prepared or check_options(opts)
    cfg, spec, data = prepared.ds_config, prepared.spec, prepared.data
    if opts.deterministic:
        use_deterministic_kernels()
    if opts.plain_deepspeed:
        cfg = plain_deepspeed_config(cfg)
    if opts.activation_checkpointing:
        cfg = with_activation_checkpointing(cfg)
    # From before the build on: a signal while the engine is built stops the run before its first step.
    with StopSignals() as stop:
        engine = build_engine(spec, cfg, seed=opts.seed, use_dostune=True, rank_timeout_s=opts.rank_timeout)
        try:
            return _run(engine, opts, data, stop, on_step)
        finally:
            engine.destroy()
            del engine
            free_engine_memory()


def _run(engine, opts: TrainOptions, data, stop: StopSignals, on_step) -> TrainSummary:
    summary = TrainSummary(steps_run=0, first_step=0, last_step=0, optimizer=type(engine.optimizer).__name__)
    save_dir = Path(opts.save_dir) if opts.save_dir is not None else None
    start = load_latest(engine, save_dir) if opts.resume else 0
    if start >= opts.steps:
        raise DostuneError(f"the checkpoint is already at step {start}, not before --steps {opts.steps}")
    summary.first_step = summary.last_step = start
    rank, world = _rank(), int(os.environ.get("WORLD_SIZE", "1"))
    metrics_f = None

    def log_metrics(rec: StepRecord) -> None:
        """One line per step; the file is opened at the first step, so a run that never steps writes none."""
        nonlocal metrics_f
        if opts.metrics is None:
            return
        if metrics_f is None:
            # Every rank logs its own step times (and its own micro-batch's loss); rank 0 keeps the plain name.
            path = metrics_path(opts.metrics, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            metrics_f = open(path, "a" if opts.resume else "w")  # a resumed run continues its file
        metrics_f.write(json.dumps(rec.__dict__) + "\n")
        metrics_f.flush()

    def lost(what: str) -> str:
        return lost_rank_message(rank, what, read_latest(save_dir) if save_dir else None, opts.resume_command)

    watchdog = StepWatchdog(opts.rank_timeout or default_rank_timeout(), lost, enabled=world > 1)
    saved = start if opts.resume else None

    def checkpoint(step: int) -> None:
        nonlocal saved
        with watchdog.pause():
            summary.checkpoints.append(save(engine, save_dir, step, opts.seed))
        saved = step

    try:
        with watchdog:
            for step in range(start, opts.steps):
                # All ranks stop before the same step, whenever the signal reached each of them.
                summary.stop_signal = agree_stop(stop, engine.device)
                watchdog.beat()  # the step's last collective is behind: from here a hang is the next step's
                if summary.stop_signal:
                    break
                rec = _one_step(engine, data, step, opts.seq, rank, world)
                summary.losses.append(rec.loss)
                summary.steps_run += 1
                summary.last_step = step + 1
                log_metrics(rec)
                if on_step is not None:
                    on_step(rec)
                if save_dir is not None and opts.save_every and (step + 1) % opts.save_every == 0:
                    checkpoint(step + 1)
            if save_dir is not None and saved != summary.last_step and summary.steps_run:
                checkpoint(summary.last_step)
    except Exception as e:
        if world > 1 and is_lost_rank_error(e):
            raise RankLost(lost(f"a collective failed after step {summary.last_step} ({describe(e, 160)})")) from None
        raise
    finally:
        if metrics_f is not None:
            metrics_f.close()
    summary.interrupted = bool(summary.stop_signal)
    return summary


def metrics_path(metrics: Path, rank: int) -> Path:
    """Rank ``rank``'s metrics file: ``metrics`` itself on rank 0, ``NAME.rankN.jsonl`` on the others."""
    path = Path(metrics)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}") if rank else path


def _one_step(engine, data, step: int, seq: int, rank: int, world: int) -> StepRecord:
    """One optimizer step (with the config's gradient accumulation), timed."""
    gas = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    cuda = torch.cuda.is_available()
    f = b = s = 0.0
    losses = []
    swing = getattr(engine.optimizer, "dostune_swing", None)  # decided after the step before, for this one
    t_it = time.perf_counter()
    for micro in range(gas):
        batch = data.batch(step * gas + micro, mb, seq, engine.device, rank)
        loss, f1, b1, s1 = iteration_phases(engine, batch)
        f, b, s = f + f1, b + b1, s + s1
        losses.append(float(loss.detach().float()))
    it = time.perf_counter() - t_it
    norm = engine.get_global_grad_norm()
    return StepRecord(step=step + 1, loss=sum(losses) / len(losses), lr=float(engine.get_lr()[0]),
                      iter_s=it, fwd_s=f, bwd_s=b, step_s=s, tokens_per_s=mb * gas * seq * world / it,
                      gpu_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                      grad_norm=float(norm) if norm is not None else None, swing=swing)
