"""Entry points: ``dostune.initialize`` (a drop-in for ``deepspeed.initialize``) and ``dostune.attach``
(for engines built elsewhere, e.g. by Hugging Face Accelerate / Trainer)."""
from __future__ import annotations

import logging
from typing import Any, Optional

from ..errors import ConfigError
from ..leaf_blocks import mark_leaf_blocks
from .schedule import SECTION, ScheduleConfig

log = logging.getLogger(__name__)


def engine_config_dict(engine) -> dict:
    """The DeepSpeed config an engine was built from, as a dict (it may have been given as a path)."""
    cfg = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(cfg, dict):
        return cfg
    cfg = getattr(engine, "config", None)
    return cfg if isinstance(cfg, dict) else {}


def attach(engine, schedule: Optional[ScheduleConfig | dict] = None, seams=None):
    """Switch a DeepSpeed engine's ZeRO-3 optimizer to the interleaved update.

    ``schedule`` defaults to the ``dostune`` section of the engine's config. Without one, the engine is
    left exactly as DeepSpeed built it. Returns the (possibly re-classed) ZeRO-3 optimizer, or None.
    This is the hook for engines built elsewhere: with Accelerate, ``dostune.attach(model)`` on the model
    ``accelerator.prepare`` returned (a DeepSpeed engine). ``seams`` is for tests (cpu_lane.CpuLaneSeams).
    """
    from ..dsconfig import check_dostune_config
    from .cpu_lane import CpuLaneSeams
    from .zero3 import InterleavedZeroOptimizer

    config = engine_config_dict(engine)
    if schedule is None:
        schedule = check_dostune_config(config)
    elif isinstance(schedule, dict):
        schedule = ScheduleConfig.from_ds_config({"dostune": schedule})
    if schedule is None:
        return None
    opt = getattr(engine, "optimizer", None)
    if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat"):
        raise ConfigError("the DeepSpeed config has a 'dostune' section, but the engine has no ZeRO stage 3 "
                          "optimizer: set zero_optimization.stage to 3 with offload_optimizer.device 'cpu'")
    return InterleavedZeroOptimizer.adopt(opt, schedule, seams or CpuLaneSeams())


def initialize(*args: Any, **kwargs: Any):
    """Same arguments and return value as ``deepspeed.initialize``. The model's transformer blocks become ZeRO-3
    leaf modules first (leaf_blocks.py), as in every engine dostune profiles and trains. When the config has a
    ``dostune`` section, the engine's ZeRO-3 optimizer runs the interleaved CPU+GPU update it describes; without
    one, the engine is DeepSpeed's own."""
    import deepspeed

    from ..ops import load_deepspeed_ops

    model = kwargs.get("model", args[1] if len(args) > 1 else None)  # deepspeed.initialize(args, model, ...)
    if model is not None:
        mark_leaf_blocks(model)
    load_deepspeed_ops()  # from the environment's build, not built just in time under torch's ownerless lock
    out = deepspeed.initialize(*args, **kwargs)
    attach(out[0])
    return out


def trainer_ds_config(args) -> Optional[dict]:
    """The DeepSpeed config of a Hugging Face Trainer run, from its TrainingArguments: given as
    ``TrainingArguments(deepspeed=...)``, or as ``deepspeed_config_file`` under ``accelerate launch`` (then only
    the Accelerate plugin the arguments carry has it). None when the run does not use DeepSpeed."""
    plugin = getattr(args, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    if config is None:
        config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    return config if isinstance(config, dict) else None


class HFTrainerCallback:
    """Turns the interleaved optimizer on inside a Hugging Face ``Trainer`` run with DeepSpeed::

        trainer = Trainer(..., args=TrainingArguments(..., deepspeed="ds_config.json"),
                          callbacks=[dostune.HFTrainerCallback()])

    Passed to the Trainer's constructor, it checks the DeepSpeed config against its ``dostune`` section when the
    Trainer is built (``on_init_end``): a conflict (another optimizer, ZeRO stage 2, no CPU offload) stops there
    with one ConfigError, before any model is partitioned or any step runs; otherwise the model's transformer blocks
    become ZeRO-3 leaf modules there, as in the engines dostune profiles (leaf_blocks.py). The Trainer (through
    Accelerate) builds the DeepSpeed engine before ``on_train_begin``; there the engine's ZeRO-3 optimizer (inside
    Accelerate's optimizer wrapper) is switched to the schedule in the config's ``dostune`` section, or to
    ``schedule`` if given. Duck-typed, so transformers stays an optional dependency.
    """

    def __init__(self, schedule: Optional[ScheduleConfig | dict] = None):
        self.schedule = schedule
        self.optimizer = None

    def _schedule(self, args) -> ScheduleConfig:
        """The schedule to run, after checking the Trainer's DeepSpeed config can run it."""
        from ..dsconfig import check_dostune_config

        ds_config = trainer_ds_config(args)
        if ds_config is None:
            raise ConfigError("HFTrainerCallback: the Trainer does not run DeepSpeed",
                              hint="pass TrainingArguments(deepspeed='ds_config.json') with a ZeRO-3 CPU-offload "
                                   "config (dostune tune --for trainer writes one)")
        if self.schedule is not None:  # the given schedule replaces the config's section
            section = self.schedule.model_dump(exclude_none=True) if isinstance(self.schedule, ScheduleConfig) \
                else self.schedule
            ds_config = {**ds_config, SECTION: section}
        schedule = check_dostune_config(ds_config)
        if schedule is None:
            raise ConfigError("HFTrainerCallback: the DeepSpeed config has no 'dostune' section and no schedule "
                              "was given", hint="use the ds_config.json `dostune tune --for trainer` wrote, or pass "
                                                "HFTrainerCallback(schedule={...})")
        return schedule

    def on_init_end(self, args, state, control, model=None, **kwargs):
        from ..ops import load_deepspeed_ops

        self._schedule(args)
        load_deepspeed_ops()  # before the Trainer builds the engine, whose CPU Adam then finds it loaded
        if model is not None:  # before the Trainer builds the engine, so that it runs as dostune profiles it
            mark_leaf_blocks(model)
        return control

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        from .zero3 import InterleavedZeroOptimizer

        schedule = self._schedule(args)  # again: a callback added after the Trainer was built missed on_init_end
        zero3 = getattr(optimizer, "optimizer", optimizer)  # accelerate's DeepSpeedOptimizerWrapper
        if zero3 is None or not hasattr(zero3, "fp32_partitioned_groups_flat"):
            raise ConfigError("HFTrainerCallback: the Trainer has no DeepSpeed ZeRO-3 optimizer (pass "
                              "TrainingArguments(deepspeed=...) with zero_optimization.stage 3)")
        self.optimizer = InterleavedZeroOptimizer.adopt(zero3, schedule)
        return control

    def __getattr__(self, name):
        # transformers calls every on_* event on each callback; the others change nothing here.
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)
