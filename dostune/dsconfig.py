"""DeepSpeed configs for ZeRO-3 with the optimizer offloaded to the CPU, with an optional ``dostune`` section.

One builder serves the tuner (emitted ``ds_config.json``), the trainer, the benchmark's baselines and the
tests, so every method compared by ``dostune bench`` differs only where it is meant to.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal, Optional

from .errors import ConfigError
from .optim.schedule import SECTION, ScheduleConfig

Precision = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class TrainSettings:
    """What a training run fixes independently of the offload method."""

    micro_batch: int = 8
    grad_accum: int = 1
    precision: Precision = "bf16"
    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    adamw: bool = True
    clip: float = 1.0
    warmup_steps: int = 0
    initial_loss_scale_power: int = 16  # fp16 only

    def validate(self) -> None:
        if self.micro_batch < 1 or self.grad_accum < 1:
            raise ConfigError("micro-batch and gradient accumulation must be at least 1")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"precision must be bf16, fp16 or fp32, got {self.precision!r}")
        if self.clip < 0:
            raise ConfigError(f"gradient clipping must be >= 0 (0 disables it), got {self.clip}")


@dataclass
class OffloadSettings:
    """How the optimizer state is placed: ``ratio`` 1.0 is ZeRO-Offload (all state on the CPU), below 1 is
    Twin-Flow (that share on the CPU), 0 keeps everything on the GPU (no offload)."""

    sub_group_size: int = 100_000_000
    ratio: float = 1.0
    pin_memory: bool = True
    super_offload: bool = False
    cpu_threads: Optional[int] = None
    schedule: Optional[ScheduleConfig] = None
    extra_zero: dict = field(default_factory=dict)


def deepspeed_config(train: TrainSettings, offload: OffloadSettings) -> dict:
    train.validate()
    if not 0.0 <= offload.ratio <= 1.0:
        raise ConfigError(f"offload ratio must be in [0, 1], got {offload.ratio}")
    if offload.sub_group_size < 1:
        raise ConfigError(f"sub_group_size must be positive, got {offload.sub_group_size}")
    zero: dict = {
        "stage": 3,
        "sub_group_size": int(offload.sub_group_size),
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 50_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
    }
    if offload.ratio > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": offload.pin_memory, "ratio": offload.ratio}
        if offload.super_offload:
            zero["offload_optimizer"]["super_offload"] = True
            if offload.cpu_threads:
                zero["offload_optimizer"]["cpuadam_cores_perc"] = 1.0
    zero.update(copy.deepcopy(offload.extra_zero))
    optimizer = {"type": "AdamW" if train.adamw else "Adam",
                 "params": {"lr": train.lr, "betas": list(train.betas), "eps": train.eps,
                            "weight_decay": train.weight_decay}}
    if not train.adamw:
        optimizer["params"]["adam_w_mode"] = False
    if offload.ratio == 0:
        # torch's AdamW on the GPU: DeepSpeed's FusedAdam would need a CUDA build first
        optimizer["params"]["torch_adam"] = True
    cfg: dict = {
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.clip,
        "optimizer": optimizer,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif train.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": train.initial_loss_scale_power,
                       "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if train.warmup_steps:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": train.lr,
                                                           "warmup_num_steps": train.warmup_steps}}
    if offload.schedule is not None:
        if offload.ratio != 1.0:
            raise ConfigError("a dostune schedule needs the whole optimizer state offloaded (ratio 1.0)")
        cfg[SECTION] = offload.schedule.model_dump(exclude_none=True)
    return cfg
