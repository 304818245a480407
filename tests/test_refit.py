"""`dostune refit` says the refitted model's subgroup count once, and says it right."""
import json
import re

from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
from dostune.models.registry import resolve_model
from dostune.optim.schedule import ScheduleConfig
from dostune.tune.refit import model_subgroups


def test_a_small_model_gets_its_real_subgroup_count_said_once(tmp_path):
    """A schedule tuned for 74 subgroups, carried to gpt2-tiny, whose tensors (never split) make fewer: no note
    promises "about 74" beside the count the model really has."""
    cfg = deepspeed_config(TrainSettings(micro_batch=2), OffloadSettings(
        sub_group_size=20_000_000, pin_memory=False, schedule=ScheduleConfig(gpu_fraction=0.25, expected_subgroups=74)))
    (tmp_path / "big.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["refit", "--config", str(tmp_path / "big.json"), "--model", "gpt2-tiny",
                                 "--output", str(tmp_path / "tiny.json")])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    sgs = json.loads((tmp_path / "tiny.json").read_text())["zero_optimization"]["sub_group_size"]
    n = model_subgroups(resolve_model("gpt2-tiny"), sgs)
    assert n < 74
    assert "about" not in out
    assert re.findall(r"(\d+) subgroups", out) == ["74", "74", str(n)], out  # the tuned count, and the real one
    assert f"refitted to gpt2-tiny: {n} subgroups" in out and "never split" in out


def test_the_tuners_swing_is_carried_over_as_the_new_models_full_range():
    """adaptive_swing set by the tuner's rule (every subgroup that can move may, either way) becomes that rule on the
    new subgroup count; one set by hand keeps its value where the new model allows it."""
    from dostune.tune.refit import refit_schedule

    # 20 subgroups, 5 on the GPU lane (1 resident): 4 may go to the CPU lane, 15 to the GPU lane
    tuned = ScheduleConfig(gpu_fraction=0.25, gpu_placement="first", resident_subgroups=1, overlap_backward=True,
                           adaptive_swing=15, expected_subgroups=20)
    new, notes = refit_schedule(tuned, 8)  # 2 on the GPU lane, the resident one kept: 1 to the CPU lane, 6 back
    assert (new.resident_subgroups, new.adaptive_swing) == (1, 6) and "adaptive_swing 15 -> 6" in notes
    by_hand, _ = refit_schedule(tuned.model_copy(update={"adaptive_swing": 3}), 8)
    assert by_hand.adaptive_swing == 3


def test_refit_writes_the_offload_ratio_of_the_scaled_resident_count(tmp_path):
    """The resident subgroups are the ones DeepSpeed keeps on the GPU at the config's offload ratio: a refit that
    scales their count rewrites the ratio with it, and the result runs (the ratio agrees with the new count)."""
    from dostune.dsconfig import check_dostune_config
    from dostune.optim.schedule import twin_flow_gpu_subgroups
    from dostune.tune.refit import refit

    tuned = ScheduleConfig(gpu_fraction=0.5, resident_subgroups=10, expected_subgroups=40)
    cfg = deepspeed_config(TrainSettings(micro_batch=2), OffloadSettings(sub_group_size=20_000_000, pin_memory=False,
                                                                         schedule=tuned))
    assert twin_flow_gpu_subgroups(cfg["zero_optimization"]["offload_optimizer"]["ratio"], 40) == 10
    out = refit(cfg, resolve_model("gpt2-tiny"), "tuned.json", sub_group_size=20_000)
    sched = check_dostune_config(out.ds_config)
    ratio = out.ds_config["zero_optimization"]["offload_optimizer"]["ratio"]
    assert 0 < sched.resident_subgroups < 10 and sched.expected_subgroups == out.subgroups
    assert twin_flow_gpu_subgroups(ratio, out.subgroups) == sched.resident_subgroups
