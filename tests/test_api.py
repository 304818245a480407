import subprocess
import sys
from types import SimpleNamespace

import pytest

import dostune
from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
from dostune.errors import ConfigError
from dostune.models.registry import resolve_model
from dostune.optim.schedule import ScheduleConfig
from dostune.train.engine import build_engine, train_steps


def _cfg(schedule=None, **zero):
    cfg = deepspeed_config(TrainSettings(micro_batch=2), OffloadSettings(sub_group_size=20_000, pin_memory=False,
                                                                         schedule=schedule))
    cfg["zero_optimization"].update(zero)
    return cfg


def test_without_dostune_section_it_is_plain_deepspeed():
    engine = build_engine(resolve_model("gpt2-tiny"), _cfg())
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3"
    assert dostune.attach(engine) is None
    engine.destroy()


def test_attach_with_an_explicit_schedule():
    spec = resolve_model("gpt2-tiny")
    engine = build_engine(spec, _cfg(), use_dostune=False)
    opt = dostune.attach(engine, {"gpu_fraction": 0.4})
    assert type(opt).__name__ == "InterleavedZeroOptimizer" and engine.optimizer is opt
    assert opt.dostune_schedule.gpu_fraction == 0.4
    train_steps(engine, spec, 2, seq=16)
    engine.destroy()


def test_hf_trainer_callback_switches_the_optimizer():
    spec = resolve_model("gpt2-tiny")
    cfg = _cfg(ScheduleConfig(gpu_fraction=0.5))
    engine = build_engine(spec, cfg, use_dostune=False)
    cb = dostune.HFTrainerCallback()
    wrapper = SimpleNamespace(optimizer=engine.optimizer)  # accelerate's DeepSpeedOptimizerWrapper
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=cfg))
    control = object()
    assert cb.on_train_begin(args, None, control, optimizer=wrapper) is control
    assert type(engine.optimizer).__name__ == "InterleavedZeroOptimizer"
    assert cb.on_step_end(args, None, control) is None  # other events are no-ops
    train_steps(engine, spec, 2, seq=16)
    engine.destroy()


def test_hf_callback_without_schedule_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not run DeepSpeed"):
        dostune.HFTrainerCallback().on_train_begin(SimpleNamespace(), None, None, optimizer=None)
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=_cfg()))
    with pytest.raises(ConfigError, match="no 'dostune' section"):
        dostune.HFTrainerCallback().on_init_end(args, None, None)


def test_hf_callback_checks_the_config_when_the_trainer_is_built():
    # an explicit schedule is checked against the Trainer's config too; the Accelerate plugin's copy is preferred
    # (under `accelerate launch` only it has the config)
    cfg = _cfg(stage=2)
    args = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=cfg), hf_deepspeed_config=None)
    with pytest.raises(ConfigError, match="zero_optimization.stage must be 3, got 2") as e:
        dostune.HFTrainerCallback({"gpu_fraction": 0.5}).on_init_end(args, None, None)
    assert "remove the 'dostune' section" in e.value.hint
    control = object()
    ok = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=_cfg()))
    assert dostune.HFTrainerCallback({"gpu_fraction": 0.5}).on_init_end(ok, None, control) is control


def test_unsupported_deepspeed_settings_are_refused():
    spec = resolve_model("gpt2-tiny")
    cfg = _cfg(ScheduleConfig(gpu_fraction=0.5))
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    with pytest.raises(ConfigError, match="ratio must be 1.0"):
        build_engine(spec, cfg)


def test_launcher_entry_point_parses_like_the_cli():
    out = subprocess.run([sys.executable, "-m", "dostune.train", "--help", "--local_rank=0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--config" in out.stdout
