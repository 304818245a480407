"""Entry points: ``dostune.initialize`` (a drop-in for ``deepspeed.initialize``) and ``dostune.attach``
(for engines built elsewhere, e.g. by Hugging Face Accelerate / Trainer)."""
from __future__ import annotations

import logging
from typing import Any, Optional

from ..errors import ConfigError
from .schedule import ScheduleConfig

log = logging.getLogger(__name__)


def engine_config_dict(engine) -> dict:
    """The DeepSpeed config an engine was built from, as a dict (it may have been given as a path)."""
    cfg = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(cfg, dict):
        return cfg
    cfg = getattr(engine, "config", None)
    return cfg if isinstance(cfg, dict) else {}


def attach(engine, schedule: Optional[ScheduleConfig | dict] = None):
    """Switch a DeepSpeed engine's ZeRO-3 optimizer to the interleaved update.

    ``schedule`` defaults to the ``dostune`` section of the engine's config. Without one, the engine is
    left exactly as DeepSpeed built it. Returns the (possibly re-classed) ZeRO-3 optimizer, or None.
    """
    from .zero3 import InterleavedZeroOptimizer

    if schedule is None:
        schedule = ScheduleConfig.from_ds_config(engine_config_dict(engine))
    elif isinstance(schedule, dict):
        schedule = ScheduleConfig.from_ds_config({"dostune": schedule})
    if schedule is None:
        return None
    opt = getattr(engine, "optimizer", None)
    if opt is None or not hasattr(opt, "fp32_partitioned_groups_flat"):
        raise ConfigError("the DeepSpeed config has a 'dostune' section, but the engine has no ZeRO stage 3 "
                          "optimizer: set zero_optimization.stage to 3 with offload_optimizer.device 'cpu'")
    return InterleavedZeroOptimizer.adopt(opt, schedule)


def initialize(*args: Any, **kwargs: Any):
    """Same arguments and return value as ``deepspeed.initialize``. When the config has a ``dostune``
    section, the engine's ZeRO-3 optimizer runs the interleaved CPU+GPU update it describes; without
    one, this is exactly ``deepspeed.initialize``."""
    import deepspeed

    out = deepspeed.initialize(*args, **kwargs)
    attach(out[0])
    return out


class HFTrainerCallback:
    """Turns the interleaved optimizer on inside a Hugging Face ``Trainer`` run with DeepSpeed::

        trainer = Trainer(..., args=TrainingArguments(..., deepspeed="ds_config.json"))
        trainer.add_callback(dostune.HFTrainerCallback())

    The Trainer (through Accelerate) builds the DeepSpeed engine before ``on_train_begin``; there the engine's
    ZeRO-3 optimizer (inside Accelerate's optimizer wrapper) is switched to the schedule in the config's
    ``dostune`` section, or to ``schedule`` if given. Duck-typed, so transformers stays an optional dependency.
    """

    def __init__(self, schedule: Optional[ScheduleConfig | dict] = None):
        self.schedule = schedule
        self.optimizer = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        from .zero3 import InterleavedZeroOptimizer

        zero3 = getattr(optimizer, "optimizer", optimizer)  # accelerate's DeepSpeedOptimizerWrapper
        schedule = self.schedule
        if isinstance(schedule, dict):
            schedule = ScheduleConfig.from_ds_config({"dostune": schedule})
        if schedule is None:
            ds_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}
            schedule = ScheduleConfig.from_ds_config(ds_config)
        if schedule is None:
            raise ConfigError("HFTrainerCallback: the DeepSpeed config has no 'dostune' section and no schedule "
                              "was given")
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
