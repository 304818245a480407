import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

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
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5  # Twin-Flow would keep 2 of the 5 on the GPU
    with pytest.raises(ConfigError, match=r"ratio 0.5 keeps 2 of the 5 subgroups on the GPU, but resident_subgroups "
                                          r"is 0 .*set the ratio to 1.0\)"):
        build_engine(spec, cfg)


def test_the_emitted_config_keeps_the_resident_subgroups_on_the_gpu_and_plain_deepspeed_offloads_all():
    from dostune.dsconfig import check_dostune_config, plain_deepspeed_config

    sched = ScheduleConfig(gpu_fraction=0.5, resident_subgroups=2, expected_subgroups=5)
    cfg = _cfg(sched)
    assert cfg["zero_optimization"]["offload_optimizer"]["ratio"] == 0.6  # int((1 - 0.6) * 5) = 2
    assert check_dostune_config(cfg) == sched
    assert _cfg(ScheduleConfig(gpu_fraction=0.5))["zero_optimization"]["offload_optimizer"]["ratio"] == 1.0
    plain = plain_deepspeed_config(cfg)
    assert "dostune" not in plain and plain["zero_optimization"]["offload_optimizer"]["ratio"] == 1.0
    assert "dostune" in cfg  # a copy
    with pytest.raises(ConfigError, match="resident_subgroups needs expected_subgroups"):
        _cfg(ScheduleConfig(gpu_fraction=0.5, resident_subgroups=2))
    # a hand-written config whose ratio keeps other subgroups on the GPU is refused before any engine is built
    for ratio in (1.0, 0.3):  # 0 and 3 subgroups on the GPU (0.5 would keep the same 2)
        bad = _cfg(sched)
        bad["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
        with pytest.raises(ConfigError, match=r"conflicts with its 'dostune' section: offload_optimizer.ratio .* keeps "
                                              r"\d of the 5 subgroups on the GPU, but resident_subgroups is 2"):
            check_dostune_config(bad)
    bad["zero_optimization"]["offload_optimizer"]["ratio"] = "half"
    with pytest.raises(ConfigError, match="ratio must be a number in"):
        check_dostune_config(bad)
    # the section removed by hand, the rest runs DeepSpeed's own Twin-Flow at that ratio
    spec = resolve_model("gpt2-tiny")
    engine = build_engine(spec, {k: v for k, v in cfg.items() if k != "dostune"})
    try:
        assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3"
        assert engine.optimizer.partial_offload == 0.6
        assert len(train_steps(engine, spec, 1, seq=16)) == 1
    finally:
        engine.destroy()


def test_resident_subgroups_are_updated_in_deepspeeds_own_tensors():
    """DeepSpeed builds the resident subgroups' state (its Twin-Flow placement: on the CPU device, in the one memory
    there is) and the resident lane updates exactly those tensors, the ones its checkpoints read: no copy of them is
    made anywhere. The other subgroups stay DeepSpeed's offloaded state."""
    spec = resolve_model("gpt2-tiny")
    sched = ScheduleConfig(gpu_fraction=0.6, resident_subgroups=2, expected_subgroups=5)  # 0-1 resident, 2 streamed
    engine = build_engine(spec, _cfg(sched))
    opt = engine.optimizer
    try:
        assert type(opt).__name__ == "InterleavedZeroOptimizer" and opt.dostune_plan.resident == (0, 1)
        assert opt.partial_offload == 0.6 and hasattr(opt, "backup_optimizer")  # DeepSpeed's Twin-Flow at work
        before = {i: (opt.fp32_partitioned_groups_flat[i].data_ptr(), opt.fp32_partitioned_groups_flat[i].clone())
                  for i in (0, 1)}
        train_steps(engine, spec, 2, seq=16)
        for i, (ptr, old) in before.items():
            fp32 = opt.fp32_partitioned_groups_flat[i]
            state = opt.optimizer.state[fp32]
            assert fp32.data_ptr() == ptr and not torch.equal(fp32, old)  # updated where DeepSpeed built it
            assert state["step"] == 2 and bool(state["exp_avg"].abs().sum() > 0)
            assert opt.subgroup_to_device[i] == fp32.device.type == state["exp_avg"].device.type == "cpu"
            assert fp32.grad.device == fp32.device
    finally:
        engine.destroy()


def test_launcher_entry_point_parses_like_the_cli():
    out = subprocess.run([sys.executable, "-m", "dostune.train", "--help", "--local_rank=0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--config" in out.stdout
