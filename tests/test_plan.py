"""`dostune plan`: every method's host RAM, pinned memory and GPU peak as the optimizer's footprints count them, on a
shipped profile, and the verdicts against the node's memory."""
import json

import pytest
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.models.registry import resolve_model
from dostune.optim.footprint import (HOST_BASE_BYTES, deepspeed_gpu_state_bytes, deepspeed_offload_host_bytes,
                                     deepspeed_offload_pinned_bytes, gpu_step_bytes, pinned_host_bytes)
from dostune.optim.schedule import ScheduleConfig, make_plan, twin_flow_gpu_subgroups
from dostune.perfmodel.inputs import ModelInputs
from dostune.perfmodel.subgroups import param_numels, subgroup_sizes
from dostune.plan import GPU, HOST, MemoryPlan, memory_plan
from dostune.profile.model_record import load_model_profile
from dostune.profile.paths import shipped_profile
from dostune.tune.search import TuneOptions

GiB = 2**30
BASE = HOST_BASE_BYTES / GiB
H200 = "h200-pcie5.json"


def _sizes(model: str, sub_group_size: int = 100_000_000, world: int = 1) -> list[int]:
    return subgroup_sizes(param_numels(resolve_model(model)), sub_group_size, world)


@pytest.fixture(scope="module")
def gpt2_on_h200():
    """gpt2-1.3b on the shipped H200 node, with its shipped model profile."""
    return memory_plan(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(H200), trials=12))


def test_the_plan_counts_every_method_with_the_optimizers_footprints(gpt2_on_h200):
    plan, config = gpt2_on_h200
    m = ModelInputs.from_profile(load_model_profile(shipped_profile("h200-pcie5-gpt2-1.3b-b8-s1024.json")))
    sizes = _sizes("gpt2-1.3b")  # the model profile's sub_group_size, 1e8
    zo, pageable, twin, dos = plan.methods
    assert [r.method for r in plan.methods] == ["zero-offload", "zero-offload-pageable", "twin-flow", "dostune"]
    # the node: 95% of the 124.6 GiB the H200 host had available; the GPU's 139.8 GiB less 10%
    assert plan.host_usable_gib == pytest.approx(0.95 * 124.6) and plan.gpu_usable_gib == pytest.approx(0.9 * 139.801)
    assert zo.host_gib == pytest.approx(deepspeed_offload_host_bytes(sizes, True, 2) / GiB + BASE)
    assert zo.pinned_gib == pytest.approx(deepspeed_offload_pinned_bytes(sizes, 2) / GiB)
    assert pageable.host_gib == pytest.approx(18 * sum(sizes) / GiB + BASE) and pageable.pinned_gib == 0.0
    assert zo.gpu_peak_gib == pageable.gpu_peak_gib == m.offload_peak_gib and not zo.gpu_peak_floor
    # Twin-Flow keeps as many subgroups on the GPU as its peak holds: here all of them (ratio 0)
    k = twin_flow_gpu_subgroups(twin.ratio, len(sizes))
    assert twin.gpu_peak_gib == pytest.approx(m.offload_peak_gib + deepspeed_gpu_state_bytes(sizes, twin.ratio) / GiB)
    assert twin.gpu_peak_gib <= plan.gpu_usable_gib and (k == len(sizes) or twin.gpu_peak_gib + 16 * sizes[k] / GiB
                                                         > plan.gpu_usable_gib)
    assert twin.host_gib == pytest.approx(deepspeed_offload_host_bytes(sizes, twin.pin_memory, 2, twin.ratio) / GiB
                                          + BASE)
    assert plan.twin_flow_ratios[0] == twin.ratio <= plan.twin_flow_ratios[1]
    # dostune's pick: every byte of its optimizer's host memory pinned in place, its peak the search's prediction
    sched = ScheduleConfig.model_validate(dos.schedule)
    dsizes = _sizes("gpt2-1.3b", dos.sub_group_size)
    pinned = pinned_host_bytes(dsizes, make_plan(len(dsizes), sched), sched, 2)
    assert dos.pinned_gib == pytest.approx(pinned / GiB) and dos.host_gib == pytest.approx(pinned / GiB + BASE)
    assert dos.gpu_peak_gib <= plan.gpu_usable_gib and dos.predicted_iter_s > 0
    assert all(r.fits and not r.short_of for r in plan.methods)
    assert config["dostune"]["gpu_fraction"] == dos.schedule["gpu_fraction"] and "zero_optimization" in config
    assert plan.estimated and "measured" in plan.estimated[1]  # the GPU peaks: what comes from the model profile


def test_a_model_without_a_model_profile_is_planned_from_estimates_that_say_so():
    # llama-13b with activation checkpointing on the H200 node (125 GiB of host memory): ZeRO-Offload's state alone
    # is 18 bytes a parameter; no model profile, so the GPU peaks are floors
    plan, _ = memory_plan(TuneOptions(model="llama-13b", profile=shipped_profile(H200), activation_checkpointing=True,
                                      trials=4))
    sizes = _sizes("llama-13b")
    zo, pageable, twin, dos = plan.methods
    assert plan.model_profile is None and all(r.gpu_peak_floor for r in plan.methods)
    assert pageable.host_gib == pytest.approx(18 * sum(sizes) / GiB + BASE) and pageable.short_of == [HOST]
    assert zo.short_of == [HOST] and zo.gpu_peak_gib == pytest.approx(2 * sum(sizes) / GiB)  # the bf16 partition
    # Twin-Flow: as much on the GPU as its floor leaves room for; the host holds the rest, or says it does not
    assert twin.gpu_peak_gib <= plan.gpu_usable_gib and twin.ratio < 1
    assert twin.fits == (twin.host_gib <= plan.host_usable_gib) and (twin.fits or twin.short_of == [HOST])
    sched = ScheduleConfig.model_validate(dos.schedule)
    dsizes = _sizes("llama-13b", dos.sub_group_size)
    plan_d = make_plan(len(dsizes), sched)
    assert dos.host_gib == pytest.approx(pinned_host_bytes(dsizes, plan_d, sched, 2) / GiB + BASE)
    assert dos.gpu_peak_gib == pytest.approx((2 * sum(dsizes) + gpu_step_bytes(dsizes, plan_d, sched)) / GiB)
    if dos.fits:  # the host holds what the GPU cannot keep
        assert dos.host_gib <= plan.host_usable_gib and dos.gpu_peak_gib <= plan.gpu_usable_gib
    elif dos.label == "dostune, least host memory":  # no schedule's host memory fits: the nearest, and what to do
        assert HOST in dos.short_of and GPU not in dos.short_of
        assert any("no schedule fits the node's host memory" in n for n in plan.notes)
    else:  # some schedule's host memory fits, but none the search met fits every limit: the nearest, said so
        assert dos.label == "dostune's pick" and dos.short_of
        assert any("none of the 4 schedules searched met the memory limits" in n for n in plan.notes)
    said = " ".join(plan.estimated)
    assert "no model profile of llama-13b on h200-pcie5" in said and "activations" in said
    # a model profile measures ZeRO-Offload, which this host cannot hold: the plan does not send the user to make one
    assert "cannot run on this node" in said and "where ZeRO-Offload's state fits" in said
    assert "dostune profile --model" not in said
    small, _ = memory_plan(TuneOptions(model="llama-1.1b", profile=shipped_profile(H200), activation_checkpointing=True,
                                       trials=4))
    assert "Measure them on the GPU node: dostune profile --model llama-1.1b --activation-checkpointing" in " ".join(
        small.estimated)


def test_the_node_holds_every_ranks_host_memory():
    # two ranks of the shipped H100 node: each holds half the state, the node's host memory both halves
    plan, _ = memory_plan(TuneOptions(model="llama-13b", profile=shipped_profile("h100-pcie5.json"), num_gpus=2, trials=4))
    sizes = _sizes("llama-13b", world=2)
    pageable = plan.methods[1]
    assert plan.ranks == 2 and pageable.host_gib == pytest.approx(18 * sum(sizes) / GiB + BASE)
    assert not pageable.fits and 2 * pageable.host_gib > plan.host_usable_gib >= pageable.host_gib
    assert plan.host_usable_gib == pytest.approx(0.95 * 125.9)  # the node's, not a rank's


def test_cli_plan_prints_one_table_and_writes_only_what_is_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pick.json"
    r = CliRunner().invoke(app, ["plan", "--profile", str(shipped_profile(H200)), "--trials", "4", "--json",
                                 "--config-out", str(out)])
    assert r.exit_code == 0, r.output
    plan = MemoryPlan.model_validate_json(r.stdout)
    assert plan.kind == "dostune.memory-plan" and len(plan.methods) == 4
    assert "memory each method needs" in r.stderr and "ZeRO-Offload, pageable" in r.stderr and "fits" in r.stderr
    section = json.loads(out.read_text())["dostune"]  # the pick, as `dostune tune` would write it
    assert {k: section.get(k) for k in plan.methods[3].schedule} == plan.methods[3].schedule
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pick.json"]  # no study, no runs/ folder
    r = CliRunner().invoke(app, ["plan", "--help"])
    assert r.exit_code == 0
    assert "dostune plan --model llama-13b --activation-checkpointing --profile profiles/h200-pcie5.json" in r.stdout
