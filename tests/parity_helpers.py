"""Run the same seeded training under DeepSpeed's own ZeRO-3 offload and under dostune's schedule."""
from __future__ import annotations

import functools
from dataclasses import replace

import torch

from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
from dostune.models.registry import resolve_model
from dostune.optim.schedule import ScheduleConfig
from dostune.train.engine import build_engine, master_weights, train_steps

MODEL = "gpt2-tiny"
SEQ = 16
STEPS = 40  # the bf16 reference clips on every one of 100 steps (gradient norm 1.38-3.81): 40 take the same paths
SUB_GROUP_SIZE = 20_000  # gpt2-tiny (141K params) -> 5 subgroups of unequal size


def base_settings(**kw) -> TrainSettings:
    return replace(TrainSettings(micro_batch=2, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, clip=1.0), **kw)


def overflow_at(steps: tuple[int, ...]):
    def hook(step, loss):
        return loss * float("inf") if step in steps else loss
    return hook


def tiny_engine(train: TrainSettings, schedule: ScheduleConfig | None, pin_memory: bool = True,
                zero_overrides: dict | None = None, seams=None):
    """(spec, engine) of the test model in ZeRO-3 with CPU offload: dostune's optimizer under ``schedule`` (built
    with the CPU lane's test ``seams`` if given), or DeepSpeed's own when it is None. ``zero_overrides`` go into the
    zero_optimization section."""
    spec = resolve_model(MODEL)
    cfg = deepspeed_config(train, OffloadSettings(sub_group_size=SUB_GROUP_SIZE, pin_memory=pin_memory,
                                                  schedule=schedule))
    cfg["zero_optimization"].update(zero_overrides or {})
    return spec, build_engine(spec, cfg, seed=0, use_dostune=schedule is not None, seams=seams)


def run(train: TrainSettings, schedule: ScheduleConfig | None, steps: int = STEPS, overflow_steps: tuple[int, ...] = (),
        pin_memory: bool = False, adjust=None, seams=None):
    spec, engine = tiny_engine(train, schedule, pin_memory=pin_memory, seams=seams)
    if adjust is not None:
        adjust(engine.optimizer)
    losses = train_steps(engine, spec, steps, seq=SEQ, seed=1,
                         before_backward=overflow_at(overflow_steps) if overflow_steps else None)
    out = {"weights": master_weights(engine), "losses": losses, "loss_scale": engine.optimizer.loss_scale,
           "grad_norm": float(engine.optimizer._global_grad_norm),
           "type": type(engine.optimizer).__name__, "subgroups": len(engine.optimizer.fp16_groups),
           "global_steps": engine.global_steps, "skipped": engine.skipped_steps,
           "overlap": getattr(engine.optimizer, "dostune_overlap_stats", None),
           "pressure": getattr(engine.optimizer, "dostune_pressure_stats", None)}
    engine.destroy()
    return out


@functools.lru_cache(maxsize=None)
def reference(train: TrainSettings, steps: int = STEPS, overflow_steps: tuple[int, ...] = ()):
    return run(train, None, steps, overflow_steps)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
