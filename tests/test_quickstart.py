"""README command 1 on a machine without a GPU: exactly examples/cli_flow.sh's CPU path (what
scripts/quickstart.sh runs after installing), with fewer trials and steps."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_quick_start_profiles_tunes_refits_and_trains(tmp_path):
    # `dostune` and `python` as this interpreter and this checkout, whatever PATH holds
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dostune").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dostune "$@"\n')
    (bin_dir / "dostune").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    work = tmp_path / "work"
    work.mkdir()
    # a fresh shell's environment: not the rendezvous of a world an earlier test made in this process (whose port
    # this process still holds)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env = dict(clean, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               CUDA_VISIBLE_DEVICES="",  # the CPU path, on any machine
               TRIALS="3", STEPS="3", PROFILE_ARGS="--quick")
    r = subprocess.run(["bash", str(ROOT / "examples" / "cli_flow.sh")], cwd=work, env=env, capture_output=True,
                       text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    runs = work / "runs"
    assert (work / "profiles" / "this-node.json").exists() and not (runs / "profiles").exists()
    assert (runs / "tune" / "gpt2-1.3b" / "ds_config.json").exists()
    assert (runs / "tune" / "cpu_demo_config.json").exists()
    assert (runs / "ckpt-demo" / "step3").is_dir()
    # it says why the H200 profile, not this machine's, drives the tuning
    flat = " ".join(out.split())
    assert "no GPU here" in flat and "shipped H200 profile" in flat and "no GPU or PCIe figures" in flat
    # the shipped profiles were measured by this dostune: nothing to profile again
    assert "profile again with this dostune" not in flat
    assert "trained steps 1-3 with dostune's interleaved CPU+GPU optimizer" in flat
