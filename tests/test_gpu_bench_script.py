"""scripts/gpu-bench.sh's steps, run here with a stand-in `dostune` that records its arguments: the commands each
step runs."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stubbed(tmp_path, then: str = ""):
    """A stand-in `dostune` that appends its arguments to calls.txt and then runs the shell lines ``then``, and the
    script's environment with it first on PATH: (calls file, OUT, environment)."""
    calls = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "dostune"
    stub.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n{then}')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT": str(out),
           "NODE": "n1", "VIRTUAL_ENV": os.environ.get("VIRTUAL_ENV", str(Path(sys.executable).parents[1])),
           "PYTHONPATH": str(ROOT)}
    return calls, out, env


def test_validate_steps_profile_then_tune(tmp_path):
    calls, out, env = _stubbed(tmp_path)
    cmd = ["bash", "scripts/gpu-bench.sh", "validate:gpt2-tiny"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "run the profile step first" in r.stderr  # no node profile yet: said, not run
    out.mkdir(exist_ok=True)
    (out / "node.json").write_text("{}")
    cmd = ["bash", "scripts/gpu-bench.sh", "validate:gpt2-tiny", "validate:hf=tests/data/tiny-llama.json:--micro-batch+2"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = calls.read_text().splitlines()
    v = out / "validate-gpt2-tiny"
    assert lines[0] == (f"profile --model gpt2-tiny --micro-batch 8 --seq 1024 --name n1 --output {v}/model-profile.json "
                        f"--plot {v}/model-profile.png --force")
    assert lines[1] == (f"tune --model gpt2-tiny --profile {out}/node.json --model-profile {v}/model-profile.json "
                        f"--validate 3 --output-dir {v} --storage sqlite:///{v}/study.db")
    h = out / "validate-tiny-llama"
    assert lines[2].startswith("profile --model hf:tests/data/tiny-llama.json ") and lines[2].endswith("--micro-batch 2")
    assert lines[3].startswith(f"tune --model hf:tests/data/tiny-llama.json --profile {out}/node.json "
                               f"--model-profile {h}/model-profile.json") and lines[3].endswith("--micro-batch 2")


def test_every_model_step_takes_a_factory_or_a_config_file(tmp_path):
    """model:, tune:, bench: and train: take hf=PATH and py=MODULE.FACTORY as validate: does, and name their files by
    the config's or the factory's name."""
    calls, out, env = _stubbed(tmp_path)
    shape = "py=examples.custom_model.factory"
    cmd = ["bash", "scripts/gpu-bench.sh", "model:hf=tests/data/tiny-llama.json", f"tune:{shape}",
           f"bench:{shape}:--rounds+2", f"train:{shape}"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == (f"profile --model hf:tests/data/tiny-llama.json --micro-batch 8 --seq 1024 --name n1 "
                        f"--output {out}/model-tiny-llama.json --plot {out}/model-tiny-llama.png --force")
    factory = "examples.custom_model:factory"
    assert lines[1] == (f"tune --model {factory} --profile {out}/node.json --model-profile {out}/model-factory.json "
                        f"--num-gpus 1 --output-dir {out}/tune-factory --storage sqlite:///{out}/study-factory.db")
    assert lines[2] == f"bench --model {factory} --output {out}/bench-factory.json --rounds 2"
    assert lines[3] == (f"train --config {out}/tune-factory/ds_config.json --model {factory} --steps 20 "
                        f"--metrics {out}/train-factory.jsonl")
