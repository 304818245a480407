"""Tuning for N GPUs and M nodes without launching anything: the world and where it comes from, one rank's share of
the node in the performance model, the tuner's world checks, and the refusals before any engine is built."""
import json
import os
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dostune.bench.record import MethodResult
from dostune.bench.pool import combine_ranks
from dostune.cli.app import app
from dostune.errors import ConfigError, DostuneError, ProfileError
from dostune.models.registry import resolve_model
from dostune.perfmodel.inputs import NodeInputs
from dostune.perfmodel.subgroups import param_numels, subgroup_sizes
from dostune.perfmodel.world import (WORLD_KEY, World, check_local_gpus, check_world, rank_inputs, shared_link_group,
                                     world_of_hostfile)
from dostune.profile.model_record import load_model_profile
from dostune.profile.paths import shipped_profile
from dostune.profile.record import NODE_SCHEMA_VERSION, MultiGpuProfile, PinnedCopies, load_node_profile
from dostune.stats import Stat
from dostune.tune.search import TuneOptions, build_space, run_tune

# The H100 pair: the node profile (schema 1) is older than profiles that count the node's GPUs, so it bounds no
# --num-gpus (the default H200 profile counted one); the model profile is of one rank
NODE_PROFILE = shipped_profile("h100-pcie5.json")
MODEL_PROFILE = shipped_profile("h100-pcie5-gpt2-1.3b-b8-s1024.json")


def _resolve_only(known):
    def resolve(host, port):
        if host not in known:
            raise socket.gaierror(-2, "Name or service not known")
    return resolve


def test_the_world_of_a_run_comes_from_the_launchers_environment():
    assert World.of_run({}) == World(1, 1)
    # DeepSpeed's launcher (launch.py) sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE
    assert World.of_run({"WORLD_SIZE": "4", "LOCAL_SIZE": "2"}) == World(nodes=2, gpus_per_node=2)
    assert World.of_run({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == World(1, 8)
    assert World.of_run({"WORLD_SIZE": "2"}) == World(1, 2)  # no local count: one node
    with pytest.raises(DostuneError, match="inconsistent"):
        World.of_run({"WORLD_SIZE": "3", "LOCAL_SIZE": "2"})
    assert World(2, 4).describe() == "2 nodes x 4 GPUs (8 ranks)" and World().describe() == "1 node x 1 GPU (1 rank)"


def test_a_config_tuned_for_another_world_is_refused_with_both_worlds_and_the_command():
    cfg = {WORLD_KEY: {"nodes": 1, "gpus_per_node": 1}}
    with pytest.raises(ConfigError) as e:
        check_world(cfg, "ds.json", "gpt2-1.3b", World(1, 2))
    assert str(e.value) == "ds.json was tuned for 1 node x 1 GPU (1 rank) but runs on 1 node x 2 GPUs (2 ranks)"
    assert "dostune tune --model gpt2-1.3b --num-gpus 2 --nodes 1" in e.value.hint
    assert check_world(cfg, "ds.json", "m", World(1, 1)) == World(1, 1)
    assert check_world({}, "ds.json", "m", World(3, 8)) is None  # a config that does not say is not judged here
    for bad in ({"nodes": 0, "gpus_per_node": 1}, {"nodes": 1}, [1, 2], {"nodes": True, "gpus_per_node": 1}):
        with pytest.raises(ConfigError, match=WORLD_KEY):
            World.from_config({WORLD_KEY: bad})


def test_more_ranks_than_gpus_is_refused_where_the_gpus_can_be_counted():
    env = {"WORLD_SIZE": "4", "LOCAL_SIZE": "4", "LOCAL_RANK": "3"}
    with pytest.raises(DostuneError, match="4 ranks were launched on this node but it has 2 GPU"):
        check_local_gpus(env=env, device_count=2)
    check_local_gpus(env=env, device_count=4)
    check_local_gpus(env=env)  # no CUDA here: not checkable, not refused


def test_a_hostfile_gives_the_world_and_every_node_must_resolve():
    text = "# two nodes\nworker-0 slots=4\nworker-1 slots=4\n"
    assert world_of_hostfile(text, resolve=_resolve_only({"worker-0", "worker-1"})) == World(2, 4)
    with pytest.raises(DostuneError, match="names node 'worker-1', which does not resolve"):
        world_of_hostfile(text, "hf", resolve=_resolve_only({"worker-0"}))
    with pytest.raises(DostuneError, match="same number of GPUs"):
        world_of_hostfile("a slots=4\nb slots=2\n", resolve=_resolve_only({"a", "b"}))
    with pytest.raises(DostuneError, match="line 1: expected 'HOST slots=N'"):
        world_of_hostfile("worker-0\n", resolve=_resolve_only(set()))


def test_one_rank_of_two_gets_half_the_node_from_a_one_gpu_profile():
    p = load_node_profile(shipped_profile())  # one GPU, no concurrent measurement
    alone = NodeInputs.from_profile(p)
    rank, notes = rank_inputs(p, World(1, 2))
    assert max(rank.cpu_adam) <= p.host.logical_cores // 2
    share = alone.cpu_adam[alone.best_threads].rate / 2
    assert all(c.rate <= min(alone.cpu_adam[t].rate, share) + 1e-6 for t, c in rank.cpu_adam.items())
    assert rank.contention_gbps == pytest.approx(alone.contention_gbps / 2)
    assert rank.h2d == alone.h2d  # no topology recorded: a link per GPU, said in a note
    assert any("derivation" in n for n in notes) and any("link of its own" in n for n in notes)
    assert rank_inputs(p, World(4, 1)) == (alone, [])  # one rank per node shares nothing


def _with_gpus(p, ancestors, copies=None):
    n = len(ancestors)
    c = p.copies
    copies = copies or PinnedCopies(h2d=c.h2d, d2h=c.d2h, duplex_h2d=c.duplex_h2d, duplex_d2h=c.duplex_d2h)
    return p.model_copy(update={"multi_gpu": MultiGpuProfile(gpus=list(range(n)), names=["H100"] * n,
                                                             numa_node=[0] * n, common_ancestor=ancestors,
                                                             copies=copies)})


def test_gpus_behind_one_pcie_switch_share_its_link():
    p = load_node_profile(shipped_profile())
    pairs = _with_gpus(p, [["self", "switch", "system", "system"], ["switch", "self", "system", "system"],
                           ["system", "system", "self", "switch"], ["system", "system", "switch", "self"]])
    assert shared_link_group(pairs, 4) == 2 and shared_link_group(pairs, 1) == 1
    assert shared_link_group(p, 4) == 1  # nothing recorded
    alone = NodeInputs.from_profile(p)
    # 3 of the 4 GPUs measured together: the topology rule applies
    rank, notes = rank_inputs(pairs, World(1, 3))
    assert rank.h2d.rate == pytest.approx(alone.h2d.rate / 2) and any("share a PCIe switch" in n for n in notes)
    # the measured rates of 4 GPUs copying at once win over the rule
    slow = p.copies.h2d.model_copy(update={"fit": p.copies.h2d.fit.model_copy(update={"rate_per_s": 1e9})})
    measured = _with_gpus(p, pairs.multi_gpu.common_ancestor, PinnedCopies(h2d=slow, d2h=p.copies.d2h,
                                                                          duplex_h2d=slow, duplex_d2h=p.copies.d2h))
    rank, notes = rank_inputs(measured, World(1, 4))
    assert rank.h2d.rate == pytest.approx(1e9) and rank.h2d_pageable.rate < alone.h2d_pageable.rate


def test_a_concurrent_cpu_adam_measurement_replaces_the_derivation():
    p = load_node_profile(shipped_profile())
    series = p.cpu_adam.by_threads[8]
    slow = series.model_copy(update={"fit": series.fit.model_copy(update={"rate_per_s": 1e9})})
    p = p.model_copy(update={"cpu_adam": p.cpu_adam.model_copy(update={"concurrent": {2: slow}})})
    details = []
    rank, notes = rank_inputs(p, World(1, 2), details)
    assert max(c.rate for c in rank.cpu_adam.values()) == pytest.approx(1e9)
    assert any("2 processes at once measured" in n for n in details) and not any("CPU Adam" in n for n in notes)


@pytest.mark.slow
def test_the_node_profile_measures_cpu_adam_in_n_processes_at_once_on_a_cpu(tmp_path):
    """`dostune profile --ranks-per-node 2` without a GPU still measures CPU Adam in 2 processes started together
    (what 2 ranks of one node do at the step), each with half the cores: the series the model prefers to its own
    derivation (test above)."""
    import subprocess
    import sys

    out = tmp_path / "node.json"
    r = subprocess.run([sys.executable, "-m", "dostune", "profile", "--quick", "--ranks-per-node", "2", "--name", "q",
                        "--output", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    p = load_node_profile(out)
    assert set(p.cpu_adam.concurrent) == {2}
    series = p.cpu_adam.concurrent[2]
    assert series.points and all(pt.seconds.median > 0 for pt in series.points) and series.fit.rate_per_s > 0
    assert all(pt.threads == max(1, p.host.logical_cores // 2) for pt in series.points)


def test_schema_1_profiles_still_load_and_new_ones_are_schema_6():
    # 3: the pageable device-to-host copies (the performance model's backward); 4: host-to-device copies under CPU Adam;
    # 5: steal; 6: the mode that measured it
    assert NODE_SCHEMA_VERSION == 6
    p = load_node_profile(NODE_PROFILE)
    assert p.schema_version == 1 and p.multi_gpu is None and p.cpu_adam.concurrent == {} and p.host.gpus is None
    m = load_model_profile(MODEL_PROFILE)
    assert (m.world.nodes, m.world.gpus_per_node, m.ranks) == (1, 1, [])


def test_gpu_topology_reads_nvmls_common_ancestors(monkeypatch):
    from dostune.profile import identity

    class FakeNvml:
        NVMLError = RuntimeError
        NVML_TOPOLOGY_INTERNAL, NVML_TOPOLOGY_SINGLE, NVML_TOPOLOGY_SYSTEM = 0, 10, 50

        def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
            if {a, b} == {0, 2}:
                raise RuntimeError("not supported")
            return 10 if {a, b} == {0, 1} else 50

        def nvmlDeviceGetNumaNodeId(self, h):
            return h // 2

    monkeypatch.setattr(identity, "nvml_handle", lambda nv, d: d)
    numa, ancestors = identity.gpu_topology([0, 1, 2], FakeNvml())
    assert numa == [0, 0, 1]
    assert ancestors == [["self", "switch", None], ["switch", "self", "system"], [None, "system", "self"]]
    # without NVML (this machine): the diagonal only
    assert identity.gpu_topology([0, 1]) == ([None, None], [["self", None], [None, "self"]])


def test_the_tuned_config_records_its_world_and_the_partitions_subgroups(tmp_path):
    res, cfg, space = run_tune(TuneOptions(model="gpt2-1.3b", profile=NODE_PROFILE, trials=3, num_gpus=2,
                                           gpu_memory_budget="20", output_dir=tmp_path))
    assert cfg[WORLD_KEY] == {"nodes": 1, "gpus_per_node": 2} and res.world == cfg[WORLD_KEY]
    assert "train_batch_size" not in cfg  # DeepSpeed derives it: micro-batch x accumulation x ranks
    numels = param_numels(resolve_model("gpt2-1.3b"))
    sgs = cfg["zero_optimization"]["sub_group_size"]
    assert cfg["dostune"]["expected_subgroups"] == len(subgroup_sizes(numels, sgs, 2))
    assert cfg["dostune"]["cpu_threads"] <= 8  # 16 cores, 2 ranks
    # the one-rank model profile beside the node profile belongs to another world: not used, and said so
    assert res.model_profile is None and any("another world" in n for n in res.notes)


def test_the_model_profile_must_come_from_the_same_world(tmp_path):
    with pytest.raises(ProfileError, match=r"measured on 1 node x 1 GPU \(1 rank\), the tune is for 1 node x 2 GPUs"):
        build_space(TuneOptions(model="gpt2-1.3b", profile=NODE_PROFILE, model_profile=MODEL_PROFILE,
                                num_gpus=2))
    # a profile measured under the launcher in that world is found beside the node profile by its name
    data = json.loads(MODEL_PROFILE.read_text()) | {"schema_version": 2, "world": {"nodes": 1, "gpus_per_node": 2}}
    (tmp_path / "h100-pcie5-gpt2-1.3b-b8-s1024-1x2.json").write_text(json.dumps(data))
    (tmp_path / "h100-pcie5.json").write_text(NODE_PROFILE.read_text())
    opts = TuneOptions(model="gpt2-1.3b", profile=tmp_path / "h100-pcie5.json", num_gpus=2)
    space, *_ , model_path, m = build_space(opts)
    assert model_path.name.endswith("-1x2.json") and space.world == World(1, 2) and m.fwd_s is not None


def test_a_profile_that_counted_its_gpus_bounds_num_gpus(tmp_path):
    data = json.loads(NODE_PROFILE.read_text()) | {"schema_version": 2}
    data["host"]["gpus"] = 1
    (tmp_path / "one.json").write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="--num-gpus 2 is more than the 1 GPU"):
        build_space(TuneOptions(model="gpt2-1.3b", profile=tmp_path / "one.json", num_gpus=2,
                                gpu_memory_budget="20"))


def test_pinned_host_memory_of_the_nodes_ranks_is_a_limit(tmp_path):
    opts = dict(model="gpt2-1.3b", profile=NODE_PROFILE, gpu_memory_budget="20", num_gpus=2)
    # the least any schedule pins: every subgroup resident on the GPU, the half-precision gradient buffer on the host
    with pytest.raises(DostuneError, match=r"the 2 rank\(s\) of a node pin at least 2\.4 GiB"):
        build_space(TuneOptions(**opts, host_memory_budget="1"))
    space = build_space(TuneOptions(**opts, host_memory_budget="30"))[0]
    res, _, _ = run_tune(TuneOptions(**opts, host_memory_budget="30", trials=8, output_dir=tmp_path))
    assert res.best.predicted.pinned_host_gib * 2 <= 30 and res.host_budget_gib == 30
    # overlap_backward's shadow states of every CPU-lane subgroup (12 bytes per element) no longer fit the node: the
    # search lets as many speculate as do (speculative_subgroups), and the node's pinned memory stays in its budget
    from dostune.tune.space import Candidate

    plain, shadows = (space.evaluate(Candidate(100_000_000, 0, 2, 8, "gpu_convert", True, o)) for o in (False, True))
    every = shadows.schedule.model_copy(update={"speculative_subgroups": None})
    assert space.node_pinned_gib(space.predict_schedule(100_000_000, every)) > 30
    assert space.feasible(plain) and space.feasible(shadows)
    assert 0 < shadows.schedule.speculative_subgroups < len(shadows.plan.cpu_order)
    assert space.node_pinned_gib(shadows) <= 30


def test_cli_bad_worlds_are_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (tmp_path / "hosts").write_text("localhost slots=2\nno-such-node.invalid slots=2\n")
    for args, says in (
            (["--hostfile", str(tmp_path / "hosts")], "names node 'no-such-node.invalid', which does not resolve"),
            (["--hostfile", str(tmp_path / "none")], "does not exist"),
            (["--num-gpus", "0"], "--num-gpus"),
    ):
        r = CliRunner().invoke(app, ["tune", "--profile", str(shipped_profile()), "--gpu-memory-budget", "20",
                                     "--output-dir", str(out), *args])
        assert r.exit_code == 2 and says in r.output, r.output
        assert len([x for x in r.output.splitlines() if x.startswith("error")]) == 1
        assert not out.exists()


def test_train_refuses_a_one_gpu_config_on_two_ranks_before_the_engine(tmp_path, monkeypatch):
    _, cfg, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(), trials=2, gpu_memory_budget="20",
                                     output_dir=tmp_path / "t"))
    (tmp_path / "one.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["refit", "--config", str(tmp_path / "one.json"), "--model", "gpt2-tiny",
                                 "--micro-batch", "2", "--output", str(tmp_path / "tiny.json")])
    assert r.exit_code == 0, r.output
    import dostune.tune.refit

    monkeypatch.setattr(dostune.tune.refit, "check_local_gpus", lambda run: None)  # a 1-GPU machine: another test's
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    save = tmp_path / "ckpt"
    r = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "tiny.json"), "--model", "gpt2-tiny",
                                 "--steps", "1", "--seq", "16", "--save-dir", str(save)])
    assert r.exit_code == 2
    assert "tiny.json was tuned for 1 node x 1 GPU (1 rank) but runs on 1 node x 2 GPUs (2 ranks)" in \
        " ".join(r.output.split())
    assert not save.exists()
    r = CliRunner().invoke(app, ["bench", "--config", str(tmp_path / "tiny.json"), "--model", "gpt2-tiny",
                                 "--seq", "16", "--output", str(tmp_path / "b.json")])
    assert r.exit_code == 2 and "was tuned for 1 node x 1 GPU" in r.output and not (tmp_path / "b.json").exists()


def _result(iter_s, peak, ran=True):
    return MethodResult(method="dostune", description="d", ran=ran, error=None if ran else "boom", iter_s=iter_s,
                        fwd_s=0.1, bwd_s=0.2, step_s=iter_s - 0.3, iter=Stat.of([iter_s]), peak_gpu_gib=peak,
                        phase_peak_gib={"fwd": peak, "bwd": peak, "step": peak})


def test_a_methods_result_over_ranks_is_the_slowest_ranks_with_every_ranks_memory():
    out = combine_ranks([_result(0.5, 10.0), _result(0.6, 9.0)])
    assert out.slowest_rank == 1 and out.iter_s == 0.6 and out.peak_gpu_gib == 10.0
    assert [(r.rank, r.iter_s, r.peak_gpu_gib) for r in out.ranks] == [(0, 0.5, 10.0), (1, 0.6, 9.0)]
    failed = combine_ranks([_result(0.5, 10.0), _result(0.6, 9.0, ran=False)])
    assert not failed.ran and failed.error == "on rank 1: boom"


@pytest.mark.gpu
def test_a_node_with_two_gpus_is_measured_together():
    """On a machine with at least 2 GPUs (scripts/gpu-tests.sh): the quick profile measures them together."""
    import torch

    from dostune.profile.node import NodeProfileOptions, measure_node

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    opts = NodeProfileOptions.tiny()
    opts.ranks_per_node = 2
    p = measure_node(opts)
    assert p.schema_version == NODE_SCHEMA_VERSION and p.host.gpus == torch.cuda.device_count()
    mg = p.multi_gpu
    assert mg.gpus == [0, 1] and len(mg.common_ancestor) == 2 and mg.common_ancestor[0][0] == "self"
    assert all(s.fit.rate_per_s > 0 for s in (mg.copies.h2d, mg.copies.d2h, mg.copies.duplex_h2d))
    assert set(p.cpu_adam.concurrent) == {2} and p.contention.gpus == 2
    rank, _ = rank_inputs(p, World(1, 2))
    assert rank.h2d.rate == pytest.approx(mg.copies.h2d.fit.rate_per_s)


def test_the_auto_host_budget_leaves_the_optimizers_margin_and_each_processes_own():
    from dostune.optim.footprint import HOST_USABLE_SHARE
    from dostune.perfmodel.world import host_memory_gib
    from dostune.tune.world import host_budget

    p = load_node_profile(shipped_profile())
    assert host_budget("auto", p, 2) == pytest.approx(HOST_USABLE_SHARE * host_memory_gib(p) - 4.0)
    assert host_budget("auto", p, 1) > host_budget("auto", p, 2)
    assert host_budget("100", p, 2) == 100.0  # a budget given in GiB is taken as it is
