"""Several ranks on the CPU (gloo over 127.0.0.1): DeepSpeed's own partitions against dostune's subgroup sizes, a
config tuned for 2 GPUs run unedited under DeepSpeed's launcher, two "nodes" launched the way a cluster without ssh
launches them, and the bench under the launcher. Losses equal plain DeepSpeed ZeRO-3 offload's step for step.

The ranks run with OMP_NUM_THREADS=1: four ranks of two OpenMP threads each on a 2-core machine run ten times
slower, and a rank's thread count changes no result here (ours and the reference use the same). They are CPU ranks on
a GPU machine too (no CUDA device visible, DeepSpeed's CPU accelerator)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.models.registry import resolve_model
from dostune.perfmodel.subgroups import param_numels, subgroup_sizes
from dostune.perfmodel.world import WORLD_KEY
from dostune.profile.paths import shipped_profile
from dostune.tune.refit import model_subgroups

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                            "LOCAL_SIZE", "LOCAL_WORLD_SIZE")}
    # the ranks import the tests' own models (multi_helpers) as `--model multi_helpers:...`
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return env | {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONPATH": path}


def _launch(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(*procs: subprocess.Popen) -> list[str]:
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _tiny_config(tmp_path: Path, *world: str, name: str = "tiny") -> Path:
    """`dostune tune` for gpt2-1.3b in that world from the shipped H100 profile, carried over to gpt2-tiny with
    `dostune refit` (as examples/cli_flow.sh does on a CPU): the file the ranks run, unedited. The H100 profile is
    older than profiles that count the node's GPUs, so it bounds no --num-gpus (the H200 profile counted one)."""
    r = CliRunner().invoke(app, ["tune", "--model", "gpt2-1.3b", "--profile", str(shipped_profile("h100-pcie5.json")),
                                 "--trials", "3",
                                 "--gpu-memory-budget", "20",
                                 "--output-dir", str(tmp_path / f"tune-{name}"), *world])
    assert r.exit_code == 0, r.output
    out = tmp_path / f"{name}.json"
    r = CliRunner().invoke(app, ["refit", "--config", str(tmp_path / f"tune-{name}" / "ds_config.json"), "--model",
                                 "gpt2-tiny", "--micro-batch", "2", "--output", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_model_profile_under_the_launcher_is_one_file_with_deepspeeds_partitions_of_every_rank(tmp_path):
    """`deepspeed --num_gpus 2 --module dostune.profile --model M` (the launcher's entry point itself): both ranks
    measure their partition and rank 0 alone writes one model profile, named for the world it ran in (the name
    `dostune tune --num-gpus 2` looks for), with both ranks' phases and the slowest rank's as the profile's.
    The model's parameters all have odd sizes: DeepSpeed pads every parameter's partition to ceil(numel / world)
    (partition_parameters._aligned_size) and closes a subgroup once it holds sub_group_size elements
    (stage3._create_fp16_sub_groups), and the sizes dostune predicts for a rank are the sizes the engine built
    (the profile reads them off DeepSpeed's optimizer)."""
    from dostune.profile.model_record import load_model_profile

    spec = resolve_model("multi_helpers:odd_factory")
    numels = param_numels(spec)
    assert all(n % 2 for n in numels)
    sgs = 2_000
    out, = _finish(_launch("--num_gpus", "2", "--master_port", str(_port()), "--module", "dostune.profile", "--model",
                           "multi_helpers:odd_factory", "--micro-batch", "2", "--seq", "8", "--iters", "2",
                           "--sub-group-size", str(sgs), "--name", "cpu", cwd=tmp_path))
    files = sorted(tmp_path.rglob("*.json"))
    assert len(files) == 1 and files[0].parent.relative_to(tmp_path).as_posix() == "profiles" and \
        files[0].name.endswith("-b2-s8-1x2.json"), out[-3000:]
    assert out.count("model profile written to") == 1
    prof = load_model_profile(files[0])
    assert (prof.world.nodes, prof.world.gpus_per_node) == (1, 2) and [r.rank for r in prof.ranks] == [0, 1]
    for ph in ("fwd", "bwd", "step"):
        assert prof.phases[ph].time_s.median == max(r.phases[ph].time_s.median for r in prof.ranks)
    expected = subgroup_sizes(numels, sgs, world_size=2)
    assert expected != subgroup_sizes(numels, sgs, world_size=1) and len(expected) > 2
    assert [s.numel for s in prof.subgroups] == expected
    assert model_subgroups(spec, sgs, 2) == len(expected)


def _metrics(tmp_path: Path, name: str, ranks: int) -> list[list[float]]:
    files = [tmp_path / f"{name}.jsonl"] + [tmp_path / f"{name}.rank{k}.jsonl" for k in range(1, ranks)]
    return [[json.loads(line)["loss"] for line in f.read_text().splitlines()] for f in files]


def test_a_config_tuned_for_two_gpus_runs_unedited_under_the_launcher(tmp_path):
    """`dostune tune --num-gpus 2` -> refit -> `deepspeed --num_gpus 2 --module dostune.train`: both ranks run the
    interleaved optimizer, and every rank's losses equal plain DeepSpeed ZeRO-3 offload's step for step. The config
    tuned for one GPU, launched the same way, stops on its ranks before any engine: one line, exit 2, no metrics."""
    cfg = _tiny_config(tmp_path, "--num-gpus", "2")
    one = _tiny_config(tmp_path, name="one-gpu")
    assert json.loads(cfg.read_text())[WORLD_KEY] == {"nodes": 1, "gpus_per_node": 2}
    common = ["--module", "dostune.train", "--model", "gpt2-tiny", "--steps", "3", "--seq", "16"]
    refused = _launch("--num_gpus", "2", "--master_port", str(_port()), *common, "--config", str(one), "--metrics",
                      "refused.jsonl", cwd=tmp_path)
    ours, ref = _finish(
        _launch("--num_gpus", "2", "--master_port", str(_port()), *common, "--config", str(cfg), "--metrics",
                "ours.jsonl", cwd=tmp_path),
        _launch("--num_gpus", "2", "--master_port", str(_port()), *common, "--config", str(cfg), "--metrics",
                "ref.jsonl", "--plain-deepspeed", cwd=tmp_path))
    out = refused.communicate(timeout=300)[0]
    assert refused.returncode == 2, out[-3000:]
    errors = {line for line in out.splitlines() if line.startswith("error:")}  # each rank says the same line
    assert errors == {f"error: {one} was tuned for 1 node x 1 GPU (1 rank) but runs on 1 node x 2 GPUs (2 ranks)"}
    assert not list(tmp_path.glob("refused*"))
    assert "trained steps 1-3 with dostune's interleaved CPU+GPU optimizer" in ours
    assert "trained steps 1-3 with DeepSpeed's own ZeRO-3 optimizer" in ref
    assert "slowest rank" in ours  # rank 0's summary of both ranks
    a, b = _metrics(tmp_path, "ours", 2), _metrics(tmp_path, "ref", 2)
    assert [len(x) for x in a] == [3, 3] and a == b and a[0] != a[1]


def test_two_nodes_on_one_machine_run_the_tuned_config_unchanged(tmp_path):
    """Multi-node the way a cluster without ssh runs it: a hostfile naming two nodes (localhost and 127.0.0.1, two
    names for this machine), `deepspeed --hostfile H --no_ssh --node_rank K --master_addr 127.0.0.1` once per node,
    2 ranks each, gloo. The config comes from `dostune tune --hostfile H`. Each rank trains it unedited with dostune
    and then with plain DeepSpeed ZeRO-3 offload in the same process (tests/multi_helpers.py, through `dostune
    train`'s library entry point: a second pair of launches would double the test's time); the losses are equal
    step for step."""
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    cfg = _tiny_config(tmp_path, "--hostfile", str(hosts))
    assert json.loads(cfg.read_text())[WORLD_KEY] == {"nodes": 2, "gpus_per_node": 2}
    port = _port()
    _finish(*(_launch("--hostfile", str(hosts), "--no_ssh", "--node_rank", str(k), "--master_addr", "127.0.0.1",
                      "--master_port", str(port), str(HERE / "multi_helpers.py"), str(cfg), "gpt2-tiny", "3", "16",
                      str(tmp_path / "losses"), cwd=tmp_path) for k in (0, 1)))
    runs = [json.loads((tmp_path / f"losses.rank{k}.json").read_text()) for k in range(4)]
    for r in runs:
        assert r["optimizer"] == "InterleavedZeroOptimizer" and r["optimizer_plain"] != r["optimizer"]
        assert len(r["dostune"]) == 3 and r["dostune"] == r["plain"]
    assert len({tuple(r["dostune"]) for r in runs}) == 4  # four ranks, four different micro-batches


def test_bench_under_the_launcher_reports_every_rank(tmp_path):
    cfg = _tiny_config(tmp_path, "--num-gpus", "2")
    out, = _finish(_launch("--num_gpus", "2", "--master_port", str(_port()), "--module", "dostune.bench", "--model",
                           "gpt2-tiny", "--micro-batch", "2", "--seq", "16", "--iters", "2", "--warmup", "1",
                           "--methods", "zero-offload,dostune", "--config", str(cfg), "--output", "b/bench.json",
                           cwd=tmp_path))
    res = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert res["world_size"] == 2 and res["nodes"] == 1
    for name in ("zero-offload", "dostune"):
        m = res["methods"][name]
        assert m["ran"] and [r["rank"] for r in m["ranks"]] == [0, 1]
        assert m["iter_s"] == max(r["iter_s"] for r in m["ranks"]) == m["ranks"][m["slowest_rank"]]["iter_s"]
    assert res["methods"]["dostune"]["final_loss"] == res["methods"]["zero-offload"]["final_loss"]
    assert out.count("results written to") == 1 and "dostune: slowest rank" in out
