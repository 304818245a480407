"""The memory limits `dostune tune` searches under by default: the GPU filled less a stated headroom, the host's pinned
memory under its budget with what costs host memory fitted to it, and --max-peak-increase's equal-memory search."""
import pytest
from typer.testing import CliRunner

from dostune.cli.app import app
from dostune.optim.footprint import gpu_step_bytes, pinned_host_bytes
from dostune.optim.schedule import ScheduleConfig, make_plan
from dostune.profile.model_record import load_model_profile
from dostune.profile.paths import shipped_profile
from dostune.tune.limits import GPU_HEADROOM_SHARE, HostTooSmall, fit_speculation
from dostune.tune.search import TuneOptions, build_space, run_tune
from dostune.tune.space import Candidate

GiB = 2**30
H200, H200_GPT2 = "h200-pcie5.json", "h200-pcie5-gpt2-1.3b-b8-s1024.json"


def _space(profile: str = H200, **kw):
    opts = TuneOptions(model="gpt2-1.3b", profile=shipped_profile(profile), **kw)
    return build_space(opts)[0], opts


def test_by_default_a_schedule_may_fill_the_gpu_less_the_headroom():
    space, opts = _space()
    step = load_model_profile(shipped_profile(H200_GPT2)).phases["step"]
    gpu = 139.801  # the H200's memory as the model profile measured it
    assert GPU_HEADROOM_SHARE == 0.10
    assert space.max_peak_gib == pytest.approx(gpu * 0.9)
    assert space.budget_gib == pytest.approx(step.free_gib - 0.1 * gpu)  # the step's measured free memory, less it
    assert ("memory limits: peak GPU memory at most 125.8 GiB, the GPU's 139.8 GiB less a 14.0 GiB headroom (10%), "
            "at most 123.2 GiB staged during the step; the node's ranks pin at most 116.4 GiB") in opts.details[-1]


def test_max_peak_increase_gives_the_equal_memory_search():
    space, opts = _space(max_peak_increase=0.10)
    peak = max(p.peak_allocated_gib for p in load_model_profile(shipped_profile(H200_GPT2)).phases.values())
    assert space.max_peak_gib == pytest.approx(1.1 * peak)
    assert "ZeRO-Offload's measured peak plus 10% (--max-peak-increase: equal memory)" in opts.details[-1]


def test_the_default_spends_the_gpu_on_resident_subgroups_where_equal_memory_cannot():
    c = Candidate(25_000_000, 9, 3, 16, "gpu_convert", True, True)
    # scored without clipping: with every GPU-lane subgroup resident, no streamed one is left for the lane balance
    # to lend CPU-lane subgroups to, which the clip regime counts against it
    full, _ = _space("h100-pcie5.json", regime="no-clip")
    equal, _ = _space("h100-pcie5.json", max_peak_increase=0.10, regime="no-clip")
    a, b = full.evaluate(c), equal.evaluate(c)
    assert a.schedule.resident_subgroups == 9 and 0 < b.schedule.resident_subgroups < 9
    assert a.memory.peak_gpu_gib <= full.max_peak_gib and b.memory.peak_gpu_gib <= equal.max_peak_gib
    assert b.memory.peak_gpu_gib < equal.max_peak_gib < a.memory.peak_gpu_gib  # above ZeRO-Offload's + 10%
    assert a.step_s < b.step_s and full.feasible(a) and not equal.feasible(a)


def test_tune_json_and_the_help_state_the_limits(tmp_path):
    res, _, _ = run_tune(TuneOptions(model="gpt2-1.3b", profile=shipped_profile(H200), trials=3, output_dir=tmp_path))
    assert res.max_peak_gib == pytest.approx(0.9 * 139.801)
    assert any(d.startswith("memory limits: peak GPU memory at most 125.8 GiB") for d in res.details)
    assert res.best.predicted.peak_gpu_gib <= res.max_peak_gib
    r = CliRunner().invoke(app, ["tune", "--help"])
    assert r.exit_code == 0 and "less a headroom of 10%" in " ".join(r.stdout.split())


def test_the_host_refusal_counts_the_least_host_memory_any_schedule_needs():
    # llama-13b on the shipped H100 node (125.9 GiB): refused before its model profile is asked for
    with pytest.raises(HostTooSmall, match="pin at least 148.0 GiB of host memory for llama-13b") as got:
        build_space(TuneOptions(model="llama-13b", profile=shipped_profile("h100-pcie5.json")))
    e = got.value
    assert "dostune plan --model llama-13b" in e.hint
    # the nearest schedule keeps on the GPU lane, resident, as many subgroups as the GPU less its headroom holds
    least, space = e.least, e.space
    sizes = space.sizes(least.sub_group_size)
    n, room = len(sizes), 0.9 * 79.18
    k = least.schedule.resident_subgroups
    plan = make_plan(n, least.schedule)
    assert k > 0 and len(plan.resident) == k and gpu_step_bytes(sizes, plan, least.schedule) / GiB <= room
    if k < n:
        more = least.schedule.model_copy(update={"gpu_fraction": min(1.0, (k + 1) / n), "resident_subgroups": k + 1})
        assert gpu_step_bytes(sizes, make_plan(n, more), more) / GiB > room
    # its host memory is footprint's: what pinned_host_bytes gives the node's one rank
    assert least.node_pinned_gib == pytest.approx(pinned_host_bytes(sizes, plan, least.schedule) / GiB)


def test_without_overlap_backward_nothing_is_fitted():
    space, _ = _space()
    sched = ScheduleConfig(gpu_fraction=0.25)
    space.host_budget_gib = 1.0  # less than any schedule pins: still nothing to fit without the CPU lane in backward
    assert fit_speculation(space, 100_000_000, sched) is sched


def test_the_search_lets_as_many_cpu_lane_subgroups_speculate_as_the_host_holds():
    sgs = 25_000_000
    roomy, _ = _space()
    c = Candidate(sgs, 9, 3, 16, "gpu_convert", True, True)
    assert roomy.evaluate(c).schedule.speculative_subgroups is None  # room for all of them

    def pinned(space, s):
        sizes = space.sizes(sgs)
        return pinned_host_bytes(sizes, make_plan(len(sizes), s), s) / GiB

    everything = roomy.evaluate(c).schedule
    none = everything.model_copy(update={"speculative_subgroups": 0})
    budget = (pinned(roomy, everything) + pinned(roomy, none)) / 2  # room for some, not for all
    tight, _ = _space(host_memory_budget=str(budget))
    p = tight.evaluate(c)
    k = p.schedule.speculative_subgroups
    assert k is not None and 0 < k and pinned(tight, p.schedule) <= budget and tight.feasible(p)
    assert pinned(tight, p.schedule.model_copy(update={"speculative_subgroups": k + 1})) > budget
