"""DeepSpeed configs for ZeRO-3 with the optimizer offloaded to the CPU, with an optional ``dostune`` section.

One builder serves the tuner (emitted ``ds_config.json``), the trainer, the benchmark's baselines and the
tests, so every method compared by ``dostune bench`` differs only where it is meant to.

Activation checkpointing is carried by DeepSpeed's standard top-level ``activation_checkpointing`` section:
when it is present, dostune's model builder checkpoints every transformer block. DeepSpeed's engine itself
never reads that section (only its ``deepspeed.checkpointing`` API does, which the models here do not call),
so its contents only have to stay valid for DeepSpeed.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from .errors import ConfigError, DostuneError
from .optim.schedule import SECTION, ScheduleConfig, resident_offload_ratio, resident_placement_problem

Precision = Literal["bf16", "fp16", "fp32"]
PRECISIONS = get_args(Precision)
# the ZeRO-3 sub_group_size a run takes where none is given (the baselines in bench and check, the model profile,
# --validate's ZeRO-Offload, dostune where its config names none): on the reference node faster than DeepSpeed's own
# default of 1e9
DEFAULT_SUB_GROUP_SIZE = 100_000_000
# Who reads the emitted config: DeepSpeed itself (every value concrete), the Hugging Face Trainer, or Accelerate
# in the user's own loop (each with "auto" where it fills the value in; see hf_config).
Target = Literal["deepspeed", "trainer", "accelerate"]

# fp16's dynamic loss scaling, in every config that may run in fp16
FP16_LOSS_SCALING = {"loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}


def check_precision(value: Optional[str], hint: str) -> None:
    """--precision names one of PRECISIONS (None: the command's default); ``hint``: what the command does without it."""
    if value is not None and value not in PRECISIONS:
        raise DostuneError(f"--precision must be bf16, fp16 or fp32, got {value!r}", hint=hint)


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
    activation_checkpointing: bool = False  # recompute each transformer block's activations in backward

    def validate(self) -> None:
        if self.micro_batch < 1 or self.grad_accum < 1:
            raise ConfigError("micro-batch and gradient accumulation must be at least 1")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be bf16, fp16 or fp32, got {self.precision!r}")
        if self.clip < 0:
            raise ConfigError(f"gradient clipping must be >= 0 (0 disables it), got {self.clip}")


@dataclass
class OffloadSettings:
    """How the optimizer state is placed: ``ratio`` 1.0 is ZeRO-Offload (all state on the CPU), below 1 is
    Twin-Flow (that share on the CPU), 0 keeps everything on the GPU (no offload)."""

    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    ratio: float = 1.0
    pin_memory: bool = True
    super_offload: bool = False
    cpu_threads: Optional[int] = None
    schedule: Optional[ScheduleConfig] = None
    extra_zero: dict = field(default_factory=dict)


CHECKPOINTING_SECTION = "activation_checkpointing"
# DeepSpeed's own keys at values that leave its deepspeed.checkpointing API (were a model to call it) as plain as
# torch.utils.checkpoint: nothing partitioned across ranks, no contiguous buffers, nothing moved to the CPU.
CHECKPOINTING_CONTENTS = {"partition_activations": False, "contiguous_memory_optimization": False,
                          "cpu_checkpointing": False}


def activation_checkpointing(ds_config: dict) -> bool:
    """Whether a run with this DeepSpeed config checkpoints every transformer block: the one place that reads
    the switch."""
    section = ds_config.get(CHECKPOINTING_SECTION)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"the DeepSpeed config's '{CHECKPOINTING_SECTION}' section must be an object, got "
                          f"{type(section).__name__}")
    return section is not None


def with_activation_checkpointing(ds_config: dict) -> dict:
    """A copy of ``ds_config`` that checkpoints every block (a section it already has is kept as it is)."""
    out = copy.deepcopy(ds_config)
    out.setdefault(CHECKPOINTING_SECTION, dict(CHECKPOINTING_CONTENTS))
    return out


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
        cfg["fp16"] = {"enabled": True, **FP16_LOSS_SCALING, "initial_scale_power": train.initial_loss_scale_power}
    if train.warmup_steps:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": train.lr,
                                                           "warmup_num_steps": train.warmup_steps}}
    if train.activation_checkpointing:
        cfg[CHECKPOINTING_SECTION] = dict(CHECKPOINTING_CONTENTS)
    if offload.schedule is not None:
        if offload.ratio != 1.0:
            raise ConfigError("a dostune schedule sets the offload ratio itself, from its resident_subgroups: leave "
                              "the offload ratio at 1.0")
        cfg = with_schedule(cfg, offload.schedule)
    return cfg


def schedule_offload_ratio(schedule: ScheduleConfig) -> float:
    """The ``offload_optimizer.ratio`` of a config with this schedule: DeepSpeed's Twin-Flow placement of exactly its
    resident subgroups on the GPU (1.0, everything offloaded, without any)."""
    r, n = schedule.resident_subgroups, schedule.expected_subgroups
    if not r:
        return 1.0
    if n is None:
        raise ConfigError("resident_subgroups needs expected_subgroups in the dostune section: the offload ratio that "
                          "keeps them on the GPU depends on the model's subgroup count",
                          hint="let `dostune tune` or `dostune refit` write the section, or set expected_subgroups")
    if r > n:
        raise ConfigError(f"resident_subgroups is {r} but the schedule expects only {n} subgroups")
    return resident_offload_ratio(r, n)


def with_schedule(ds_config: dict, schedule: ScheduleConfig) -> dict:
    """A copy of ``ds_config`` (ZeRO-3 with the optimizer offloaded to the CPU) that runs ``schedule``: its
    ``dostune`` section, and the offload ratio that keeps its resident subgroups on the GPU (schedule_offload_ratio)."""
    cfg = copy.deepcopy(ds_config)
    ratio = schedule_offload_ratio(schedule)
    offload = cfg.get("zero_optimization", {}).get("offload_optimizer")
    if offload is None:
        raise ConfigError("a dostune schedule needs zero_optimization.offload_optimizer (device 'cpu')")
    offload["ratio"] = ratio
    cfg[SECTION] = schedule.model_dump(exclude_none=True)
    return cfg


def plain_deepspeed_config(ds_config: dict) -> dict:
    """A copy of ``ds_config`` that DeepSpeed runs with its own update: without the ``dostune`` section, and, where
    the section's resident subgroups had set a lower offload ratio, with the whole optimizer state offloaded again
    (ZeRO-Offload, ratio 1.0, whose update the schedule's equals bit for bit, rather than DeepSpeed's Twin-Flow at
    that ratio). A config without the section is returned unchanged."""
    cfg = copy.deepcopy(ds_config)
    if cfg.pop(SECTION, None) is None:
        return cfg
    offload = (cfg.get("zero_optimization") or {}).get("offload_optimizer")
    if isinstance(offload, dict) and "ratio" in offload:
        offload["ratio"] = 1.0
    return cfg


# Keys the Hugging Face Trainer fills from TrainingArguments when they are "auto" (transformers'
# HfTrainerDeepSpeedConfig.trainer_config_process and trainer_config_finalize). A concrete value that differs from
# TrainingArguments (its defaults included: betas 0.9/0.999, weight decay 0) stops the Trainer with its
# config-mismatch ValueError, so everything it fills is left to it.
TRAINER_AUTO = (
    "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "bf16.enabled", "fp16.enabled",
)
# Keys Accelerate fills in Accelerator.prepare when they are "auto": the batch sizes from the prepared DataLoader
# and Accelerator(gradient_accumulation_steps=...), lr and weight decay from accelerate.utils.DummyOptim, the
# precision from --mixed_precision. Accelerate refuses any other "auto" (betas, eps: it has no value for them) and
# fills an "auto" gradient_clipping with 1.0 whatever the script asks, so those stay concrete.
ACCELERATE_AUTO = (
    "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
    "optimizer.params.lr", "optimizer.params.weight_decay", "bf16.enabled", "fp16.enabled",
)


def check_target(target: str) -> Target:
    if target not in get_args(Target):
        raise ConfigError(f"unknown config target {target!r}; choose one of {', '.join(get_args(Target))}")
    return target  # type: ignore[return-value]


def hf_config(ds_config: dict, target: Target = "trainer") -> dict:
    """A copy of ``ds_config`` that the Hugging Face Trainer (``target`` "trainer") or Accelerate ("accelerate")
    accepts unchanged: "auto" wherever they fill a value in (TRAINER_AUTO, ACCELERATE_AUTO), both precision sections
    present so the run's precision follows TrainingArguments' bf16/fp16 (or --mixed_precision), and no scheduler
    section for the Trainer unless the config had one (the Trainer's own lr_scheduler_type then applies). The
    ZeRO-3 offload settings and the top-level ``dostune`` section are kept as they are; "deepspeed" returns an
    unchanged copy."""
    cfg = copy.deepcopy(ds_config)
    if check_target(target) == "deepspeed":
        return cfg
    cfg.setdefault("fp16", {"enabled": False, **FP16_LOSS_SCALING,
                            "initial_scale_power": TrainSettings.initial_loss_scale_power}).setdefault("enabled", False)
    cfg.setdefault("bf16", {"enabled": False}).setdefault("enabled", False)
    cfg.setdefault("train_batch_size", "auto")  # both fill it in (from the micro-batch, accumulation and world size)
    if target == "trainer":
        # What Trainer.save_model needs under ZeRO-3 to write the model's weights rather than only the checkpoint.
        cfg.get("zero_optimization", {}).setdefault("stage3_gather_16bit_weights_on_model_save", True)
    for key in TRAINER_AUTO if target == "trainer" else ACCELERATE_AUTO:
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = "auto"
    return cfg


def _dostune_conflicts(ds_config: dict, schedule: ScheduleConfig) -> list[str]:
    """The settings of a DeepSpeed config under which the interleaved optimizer cannot run ``schedule``: it replaces
    ZeRO-3's update of an optimizer state offloaded to the CPU (all of it but the schedule's resident subgroups, which
    DeepSpeed keeps on the GPU at the config's offload ratio), done by DeepSpeedCPUAdam (Adam or AdamW). "auto" values
    are not judged (the Trainer or Accelerate fill them with numbers, never with another optimizer or stage)."""
    problems = []
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (3, "auto"):
        problems.append(f"zero_optimization.stage must be 3, got {stage}")
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device", "none")
    if device != "cpu":
        problems.append(f"zero_optimization.offload_optimizer.device must be 'cpu', got {device!r}")
    ratio = offload.get("ratio", 1.0)
    if ratio != "auto":
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio <= 1:
            problems.append(f"offload_optimizer.ratio must be a number in [0, 1], got {ratio!r}")
        elif schedule.expected_subgroups is not None:  # else checked once the model's subgroups are known
            problem = resident_placement_problem(ratio, schedule.expected_subgroups, schedule)
            if problem is not None:
                problems.append(problem)
    if offload.get("super_offload"):
        problems.append("offload_optimizer.super_offload must be off (SuperOffload is its own ZeRO-3 optimizer)")
    optimizer = ds_config.get("optimizer")
    if not isinstance(optimizer, dict):
        problems.append("an 'optimizer' section of type Adam or AdamW is needed (without one the Trainer or "
                        "Accelerate hands DeepSpeed a torch optimizer)")
    else:
        kind = str(optimizer.get("type", ""))
        params = optimizer.get("params") or {}
        if kind.lower() not in ("adam", "adamw"):
            problems.append(f"optimizer.type must be Adam or AdamW, got {kind!r}")
        if params.get("torch_adam") is True:
            problems.append("optimizer.params.torch_adam must be false (the offloaded update is DeepSpeedCPUAdam)")
        if params.get("amsgrad") is True:
            problems.append("optimizer.params.amsgrad is not supported")
    return problems


def check_dostune_config(ds_config: dict) -> Optional[ScheduleConfig]:
    """The config's ``dostune`` schedule (None without that section), after checking that the rest of the config
    lets it run; a conflict stops here with one ConfigError naming every offending key, before any engine is
    built."""
    schedule = ScheduleConfig.from_ds_config(ds_config)
    if schedule is None:
        return None
    problems = _dostune_conflicts(ds_config, schedule)
    if problems:
        raise ConfigError(f"the DeepSpeed config conflicts with its '{SECTION}' section: " + "; ".join(problems),
                          hint="dostune's interleaved optimizer runs ZeRO-3 with the Adam/AdamW state offloaded to the "
                               "CPU: fix those keys (`dostune tune --for trainer` writes a config that fits), or "
                               f"remove the '{SECTION}' section to run plain DeepSpeed")
    return schedule
