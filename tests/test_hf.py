"""dostune under the Hugging Face Trainer, Accelerate and `--model hf:config.json`, run for real on the CPU: tiny
LLaMA models built from a config (random weights, nothing downloaded). Without a GPU the schedule's "GPU" lane runs
on the CPU device through the same buffers and hand-offs, as in test_parity."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typer.testing import CliRunner  # noqa: E402

import dostune  # noqa: E402
from dostune.cli.app import app  # noqa: E402
from dostune.dsconfig import (ACCELERATE_AUTO, TRAINER_AUTO, OffloadSettings, TrainSettings,  # noqa: E402
                              check_dostune_config, deepspeed_config, hf_config)
from dostune.errors import ConfigError, DostuneError  # noqa: E402
from dostune.models.registry import loss_of, resolve_model  # noqa: E402
from dostune.optim.schedule import ScheduleConfig  # noqa: E402
from examples import hf_trainer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "tests" / "data" / "tiny-llama.json"


@pytest.fixture(autouse=True)
def _forget_hf_deepspeed_state():
    # TrainingArguments(deepspeed=...) registers its config globally (later models would be built under zero.Init),
    # and an Accelerator with DeepSpeed sets ACCELERATE_USE_DEEPSPEED for good (later TrainingArguments would use it);
    # Accelerate may also set torch's thread count
    had, threads = os.environ.get("ACCELERATE_USE_DEEPSPEED"), torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    if had is None:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


def tuned_config(schedule: dict, **train) -> dict:
    return deepspeed_config(TrainSettings(**train), OffloadSettings(sub_group_size=20_000, pin_memory=False,
                                                                    schedule=ScheduleConfig.model_validate(schedule)))


def value(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg.get(part, {}) if isinstance(cfg, dict) else {}
    return cfg


def autos(cfg: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in cfg.items():
        if isinstance(v, dict):
            out |= autos(v, f"{prefix}{k}.")
        elif v == "auto":
            out.add(prefix + k)
    return out


# ----------------------------------------------------------------------------------------- config emission
def test_trainer_fills_every_auto_and_its_mismatch_check_passes(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    tuned = tuned_config({"gpu_fraction": 0.5})
    cfg = hf_config(tuned, "trainer")
    assert autos(cfg) == set(TRAINER_AUTO) - {k for k in TRAINER_AUTO if k.startswith("scheduler.")}
    assert cfg["dostune"] == tuned["dostune"] and cfg["zero_optimization"]["offload_optimizer"] == \
        tuned["zero_optimization"]["offload_optimizer"]
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, learning_rate=3e-4, adam_beta2=0.98, adam_epsilon=1e-6,
                             weight_decay=0.1, max_grad_norm=0.5)
    hf = HfTrainerDeepSpeedConfig(cfg)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model=torch.nn.Linear(1, 1), num_training_steps=10)
    assert autos(hf.config) == set()
    assert [value(hf.config, k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                          "train_batch_size", "gradient_clipping", "optimizer.params.lr",
                                          "optimizer.params.betas", "optimizer.params.eps",
                                          "optimizer.params.weight_decay", "bf16.enabled", "fp16.enabled")] == \
        [3, 2, 6, 0.5, 3e-4, [0.9, 0.98], 1e-6, 0.1, False, False]
    assert DeepSpeedConfig(hf.config).zero_config.offload_optimizer.device == "cpu"
    assert check_dostune_config(hf.config) == ScheduleConfig.from_ds_config(tuned)
    # the plain emission, with TrainSettings' own betas and weight decay, is what the Trainer refuses
    with pytest.raises(ValueError, match="mismatch TrainingArguments"):
        plain = HfTrainerDeepSpeedConfig(tuned)
        plain.trainer_config_process(args)
        plain.trainer_config_finalize(args, model=torch.nn.Linear(1, 1), num_training_steps=10)


def test_accelerate_config_has_auto_only_where_accelerate_fills_it():
    from accelerate.utils import DeepSpeedPlugin

    tuned = tuned_config({"gpu_fraction": 0.5}, warmup_steps=5)
    cfg = hf_config(tuned, "accelerate")
    assert autos(cfg) == set(ACCELERATE_AUTO)
    for key in ("optimizer.params.betas", "optimizer.params.eps", "gradient_clipping", "scheduler.params"):
        assert value(cfg, key) == value(tuned, key)
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)  # accelerate's own checks of a deepspeed_config_file
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"]["enabled"] is True and plugin.deepspeed_config["fp16"]["enabled"] is False
    assert hf_config(tuned, "deepspeed") == tuned


def test_tune_for_trainer_writes_the_auto_config(tmp_path):
    r = CliRunner().invoke(app, ["tune", "--trials", "3", "--for", "trainer", "--output-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "ds_config.json").read_text())
    assert value(cfg, "optimizer.params.betas") == "auto" and cfg["train_micro_batch_size_per_gpu"] == "auto"
    assert check_dostune_config(cfg).expected_subgroups > 0
    r = CliRunner().invoke(app, ["tune", "--trials", "3", "--for", "keras", "--output-dir", str(tmp_path / "x")])
    assert r.exit_code == 2 and "unknown config target 'keras'" in r.output and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("change, message", [
    ({"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}, "optimizer.type must be Adam or AdamW, got 'SGD'"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage must be 3, got 2"),
    ({"zero_optimization": {"offload_optimizer": {"device": "none"}}},
     "zero_optimization.offload_optimizer.device must be 'cpu', got 'none'"),
    ({"optimizer": None}, "an 'optimizer' section of type Adam or AdamW is needed"),
])
def test_a_config_conflicting_with_the_dostune_section_stops_the_trainer_in_one_line(tmp_path, capsys, change,
                                                                                    message):
    cfg = hf_trainer.tiny_ds_config()
    for section, new in change.items():
        if new is None:
            del cfg[section]
        else:
            cfg[section].update(new)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    assert hf_trainer.main(["--tiny", "--deepspeed", str(path), "--output-dir", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and message in out.err and "hint:" in out.err
    assert "optimizer:" not in out.out  # stopped while the Trainer was built: no engine, no step


def test_the_callback_needs_a_deepspeed_trainer(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(TINY)))
    with pytest.raises(ConfigError, match="does not run DeepSpeed"):
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none"),
                callbacks=[dostune.HFTrainerCallback()])


# --------------------------------------------------------------------------------------------- hf: models
def test_hf_model_spec_builds_from_a_config_file():
    spec = resolve_model(f"hf:{TINY}")
    model = spec.build()
    batch = spec.batch(2, 16, torch.Generator().manual_seed(0), torch.device("cpu"))
    loss = loss_of(model(**batch))
    assert loss.dim() == 0 and 5.0 < float(loss.detach()) < 8.0  # about ln(512) from random weights
    assert spec.max_seq == 128 and spec.config["hf_config"]["model_type"] == "llama"
    assert spec.num_params == sum(p.numel() for p in model.parameters()) > 100_000
    with pytest.raises(DostuneError, match="config file not found"):
        resolve_model("hf:tests/data/no-such-model.json")


def test_hf_model_spec_refuses_a_config_transformers_cannot_read(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "no-such-architecture", "vocab_size": 10}))
    with pytest.raises(DostuneError, match="not a Hugging Face model config") as e:
        resolve_model(f"hf:{bad}")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_dostune_train_hf_model_matches_plain_deepspeed(tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(tuned_config({"gpu_fraction": 0.5, "gpu_placement": "spread"}, micro_batch=2)))
    runs = {}
    for name, extra in (("dostune", []), ("plain", ["--plain-deepspeed"])):
        r = CliRunner().invoke(app, ["train", "--config", str(cfg), "--model", f"hf:{TINY}", "--steps", "3",
                                     "--seq", "32", "--metrics", str(tmp_path / f"{name}.jsonl"), "--json", *extra])
        assert r.exit_code == 0, r.output
        # the summary, after whatever DeepSpeed printed to stdout when it first built its communication op
        runs[name] = json.loads(r.stdout[r.stdout.find("{"):])
    assert runs["dostune"]["optimizer"] == "InterleavedZeroOptimizer"
    assert runs["plain"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert len(runs["dostune"]["losses"]) == 3 and runs["dostune"]["losses"] == runs["plain"]["losses"]


# ---------------------------------------------------------------------------------- the Trainer, for real
def check_interleaved_every_step(run: dict, steps: int) -> None:
    """Each optimizer step left its own trace of the interleaved update, with every subgroup in exactly one of the
    two lanes (a step DeepSpeed updated on its own would leave the previous step's trace in place)."""
    assert run["optimizer"] == "InterleavedZeroOptimizer"
    assert len(run["traces"]) == steps
    for trace in run["traces"]:
        cpu = {i for lane, i, *_ in trace if lane == "cpu"}
        gpu = {i for lane, i, *_ in trace if lane == "gpu"}
        assert cpu and gpu and not cpu & gpu and cpu | gpu == set(range(len(cpu) + len(gpu)))
    assert all(a != b for a, b in zip(run["traces"], run["traces"][1:]))


@pytest.mark.slow
def test_trainer_runs_the_interleaved_optimizer_bit_for_bit_like_plain_deepspeed(tmp_path):
    # examples/hf_trainer.py as is: fp32 (the Trainer allows bf16 without a GPU only with use_cpu, which turns
    # DeepSpeed off), gradient accumulation 2, the Trainer's own linear lr decay, its default clipping at 1.0
    common = ["--tiny", "--grad-accum", "2", "--lr", "1e-3"]
    assert hf_trainer.main([*common, "--output-dir", str(tmp_path / "a"), "--json-out", str(tmp_path / "a.json")]) == 0
    assert hf_trainer.main([*common, "--deepspeed", str(tmp_path / "a" / "ds_config.json"), "--plain-deepspeed",
                            "--output-dir", str(tmp_path / "b"), "--json-out", str(tmp_path / "b.json")]) == 0
    ours, plain = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    check_interleaved_every_step(ours, 3)
    assert plain["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" and plain["traces"] == []
    assert len(ours["losses"]) == 3 and ours["losses"] == plain["losses"]
    assert ours["grad_norms"] == plain["grad_norms"]
    assert ours["weights_sha256"] == plain["weights_sha256"]


# ------------------------------------------------------------------------------------ Accelerate, for real
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(tmp_path: Path, configs: dict[str, dict]) -> dict[str, dict]:
    """examples/accelerate_train.py under `accelerate launch`, with examples/accelerate_config.yaml pointed at each of
    ``configs`` (name -> DeepSpeed config), the runs side by side; returns what the script wrote in each."""
    import yaml

    procs = {}
    for name, ds_config in configs.items():
        cfg_path = tmp_path / f"{name}.json"
        cfg_path.write_text(json.dumps(ds_config))
        launch = yaml.safe_load((REPO / "examples" / "accelerate_config.yaml").read_text())
        launch["deepspeed_config"]["deepspeed_config_file"] = str(cfg_path)
        launch["main_process_port"] = _free_port()
        yaml_path = tmp_path / f"{name}.yaml"
        yaml_path.write_text(yaml.safe_dump(launch))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_path), "--mixed_precision",
             "bf16", str(REPO / "examples" / "accelerate_train.py"), "--tiny", "--json-out", str(tmp_path / f"{name}.out")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
    return {name: json.loads((tmp_path / f"{name}.out").read_text()) for name in configs}


@pytest.mark.slow
def test_accelerate_launch_runs_the_interleaved_optimizer_bit_for_bit_like_plain_deepspeed(tmp_path):
    # bf16 (Accelerate allows it on the CPU), CPU-lane updates during backward
    cfg = hf_config(tuned_config({"gpu_fraction": 0.5, "gpu_placement": "spread", "overlap_backward": True,
                                  "trace": True}), "accelerate")
    runs = accelerate_launch(tmp_path, {"dostune": cfg, "plain": {k: v for k, v in cfg.items() if k != "dostune"}})
    ours, plain = runs["dostune"], runs["plain"]
    check_interleaved_every_step(ours, 3)
    assert plain["optimizer"] == "DeepSpeedZeroOptimizer_Stage3" and plain["traces"] == []
    assert ours["global_steps"] == plain["global_steps"] == 3
    assert len(ours["losses"]) == 3 and ours["losses"] == plain["losses"]
    assert ours["weights_sha256"] == plain["weights_sha256"]
