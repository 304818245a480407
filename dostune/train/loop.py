"""`dostune train`: training runs with a DeepSpeed config (and its dostune section), checkpoints and resume."""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from .._version import __version__
from ..dsconfig import activation_checkpointing, with_activation_checkpointing
from ..errors import ConfigError, DostuneError
from ..models.registry import ModelSpec, loss_of, resolve_model
from ..optim.schedule import ScheduleConfig
from ..deepspeed_support import check_deepspeed
from ..profile.record import check_writable, read_json_record
from ..tune.refit import check_fits
from .data import make_data
from .engine import build_engine, free_engine_memory


class Interrupted(DostuneError):
    exit_code = 130


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


@dataclass
class TrainSummary:
    steps_run: int
    first_step: int
    last_step: int
    losses: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    optimizer: str = ""
    interrupted: bool = False


def load_ds_config(path: Path) -> dict:
    cfg = read_json_record(path, "DeepSpeed config")
    ScheduleConfig.from_ds_config(cfg)  # a malformed dostune section fails here, before any work
    activation_checkpointing(cfg)  # ... and so does a malformed activation_checkpointing section
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
        raise ConfigError(f"{path}: dostune trains with ZeRO stage 3; set zero_optimization.stage to 3")
    return cfg


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _StopFlag:
    """Ctrl-C asks the loop to stop after the current step, so the checkpoint it saves is consistent."""

    def __init__(self):
        self.set = False
        self._prev = None

    def __enter__(self):
        def handler(signum, frame):
            if self.set:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.set = True

        try:
            self._prev = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not in the main thread
            self._prev = None
        return self

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)


def _save(engine, save_dir: Path, step: int, seed: int) -> str:
    tag = f"step{step}"
    engine.save_checkpoint(str(save_dir), tag=tag, client_state={"step": step, "seed": seed,
                                                                  "dostune_version": __version__})
    return str(save_dir / tag)


def _resume(engine, save_dir: Path) -> int:
    if not save_dir.exists() or not (save_dir / "latest").exists():
        raise DostuneError(f"--resume: no checkpoint in {save_dir} (DeepSpeed writes a 'latest' file there)")
    tag = (save_dir / "latest").read_text().strip()
    try:
        path, client = engine.load_checkpoint(str(save_dir), load_optimizer_states=True, load_lr_scheduler_states=True)
    except Exception as e:  # torch/DeepSpeed raise many kinds for truncated or foreign files
        raise DostuneError(f"--resume: checkpoint {save_dir / tag} could not be loaded ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); it was left as it is") from None
    if path is None or not client or "step" not in client:
        raise DostuneError(f"--resume: {save_dir / tag} is not a dostune checkpoint (no step recorded)")
    return int(client["step"])


def check_options(opts: TrainOptions) -> tuple[dict, ModelSpec]:
    """Everything train() can refuse before building the engine (which takes minutes for a large model),
    refused now: the config and its schedule against the model, the paths, the DeepSpeed release."""
    if opts.steps < 1:
        raise DostuneError(f"--steps must be at least 1, got {opts.steps}")
    if opts.resume and opts.save_dir is None:
        raise DostuneError("--resume needs --save-dir (where the checkpoints are)")
    if not opts.resume and opts.save_dir is not None and (Path(opts.save_dir) / "latest").exists():
        # A fresh run would overwrite the step tags of an earlier one and mix their histories.
        latest = (Path(opts.save_dir) / "latest").read_text().strip()
        raise DostuneError(f"{opts.save_dir} already holds checkpoints (latest: {latest}); they were left as they are",
                           hint="pass --resume to continue that run, or choose another --save-dir")
    cfg = load_ds_config(Path(opts.config))
    spec = resolve_model(opts.model)
    if spec.max_seq is not None and opts.seq > spec.max_seq:
        raise DostuneError(f"--seq {opts.seq} exceeds {opts.model}'s {spec.max_seq} positions")
    check_deepspeed("dostune train")
    if opts.save_dir is not None:
        check_writable(opts.save_dir, "--save-dir", directory=True)
    if opts.metrics is not None:
        check_writable(opts.metrics, "--metrics")
    if not opts.plain_deepspeed:
        check_fits(cfg, spec, str(opts.config))  # and the world it was tuned for, against the launcher's
    return cfg, spec


def train(opts: TrainOptions, on_step: Optional[Callable[[StepRecord], None]] = None) -> TrainSummary:
    cfg, spec = check_options(opts)
    data = make_data(spec, opts.data, opts.tokenizer, opts.seed)
    if opts.deterministic:
        use_deterministic_kernels()
    if opts.plain_deepspeed:
        cfg = {k: v for k, v in cfg.items() if k != "dostune"}
    if opts.activation_checkpointing:
        cfg = with_activation_checkpointing(cfg)
    engine = build_engine(spec, cfg, seed=opts.seed, use_dostune=True)
    summary = TrainSummary(steps_run=0, first_step=0, last_step=0, optimizer=type(engine.optimizer).__name__)
    metrics_f = None
    try:
        start = _resume(engine, Path(opts.save_dir)) if opts.resume else 0
        if start >= opts.steps:
            raise DostuneError(f"the checkpoint is already at step {start}, not before --steps {opts.steps}")
        summary.first_step = start
        rank = _rank()
        if opts.metrics is not None:
            # Every rank logs its own step times (and its own micro-batch's loss); rank 0 keeps the plain name.
            path = Path(opts.metrics)
            if rank:
                path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
            path.parent.mkdir(parents=True, exist_ok=True)
            metrics_f = open(path, "a" if opts.resume else "w")  # a resumed run continues its file
        gas = engine.gradient_accumulation_steps()
        mb = engine.train_micro_batch_size_per_gpu()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cuda = torch.cuda.is_available()

        def sync():
            if cuda:
                torch.cuda.synchronize()

        with _StopFlag() as stop:
            for step in range(start, opts.steps):
                f = b = s = 0.0
                losses = []
                t_it = time.perf_counter()
                for micro in range(gas):
                    batch = data.batch(step * gas + micro, mb, opts.seq, engine.device, rank)
                    sync()
                    t0 = time.perf_counter()
                    loss = loss_of(engine(**batch))
                    sync()
                    t1 = time.perf_counter()
                    engine.backward(loss)
                    sync()
                    t2 = time.perf_counter()
                    engine.step()
                    sync()
                    t3 = time.perf_counter()
                    f, b, s = f + t1 - t0, b + t2 - t1, s + t3 - t2
                    losses.append(float(loss.detach().float()))
                it = time.perf_counter() - t_it
                norm = engine.get_global_grad_norm()
                rec = StepRecord(step=step + 1, loss=sum(losses) / len(losses), lr=float(engine.get_lr()[0]),
                                 iter_s=it, fwd_s=f, bwd_s=b, step_s=s, tokens_per_s=mb * gas * opts.seq * world / it,
                                 gpu_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                                 grad_norm=float(norm) if norm is not None else None)
                summary.losses.append(rec.loss)
                summary.steps_run += 1
                summary.last_step = step + 1
                if metrics_f is not None:
                    metrics_f.write(json.dumps(rec.__dict__) + "\n")
                    metrics_f.flush()
                if on_step is not None:
                    on_step(rec)
                due = opts.save_every and (step + 1) % opts.save_every == 0
                if opts.save_dir is not None and (due or stop.set):
                    summary.checkpoints.append(_save(engine, Path(opts.save_dir), step + 1, opts.seed))
                if stop.set:
                    summary.interrupted = True
                    break
        if opts.save_dir is not None and not summary.interrupted and (
                not summary.checkpoints or not summary.checkpoints[-1].endswith(f"step{summary.last_step}")):
            summary.checkpoints.append(_save(engine, Path(opts.save_dir), summary.last_step, opts.seed))
    finally:
        if metrics_f is not None:
            metrics_f.close()
        engine.destroy()
        del engine
        free_engine_memory()
    return summary
