"""Each bench method's measured host peak (RSS and pinned) in the record and its rows, and a method refused for host
memory as its row with the reason."""
import re

import pytest

from dostune.bench import run as bench_run
from dostune.errors import DostuneError
from dostune.bench.host_peak import peak_rss_bytes, reset_host_peaks
from dostune.bench.pool import combine_ranks, pool_rounds
from dostune.bench.record import MethodResult, load_bench
from dostune.bench.report import COLUMNS, markdown, rows
from dostune.models.registry import resolve_model
from dostune.optim.schedule import ScheduleConfig
from dostune.perfmodel.subgroups import param_numels
from dostune.records import save_record
from dostune.stats import Stat

GiB = 2**30


def _ran(name: str, rss: float, pinned, iter_s: float = 2.0) -> MethodResult:
    st = Stat.of([iter_s])
    return MethodResult(method=name, description=name, iter_s=iter_s, fwd_s=0.5, bwd_s=1.0, step_s=0.5, iter=st,
                        fwd=st, bwd=st, step=st, peak_gpu_gib=20.0, update_gelem_s=1.0, final_loss=2.5, losses=[2.5],
                        samples={"fwd": [0.5], "bwd": [1.0], "step": [0.5], "iter": [iter_s]}, round_iter_s=[iter_s],
                        round_step_s=[0.5], host_peak_rss_gib=rss, host_pinned_gib=pinned)


def test_a_method_refused_for_host_memory_is_its_row_with_the_reason_beside_the_measured_peaks(monkeypatch,
                                                                                               tmp_path):
    # llama-7b on 124 GiB: ZeRO-Offload runs without pin_memory (115 GiB), dostune's CPU lane during backward would
    # need its shadow states too (15x GiB): refused before anything is built (test_bench_host_memory.py)
    ran = []

    def fake_run(name, spec, opts, offload, progress):  # a stubbed runner: the figures as a measured method has them
        ran.append((name, offload.pin_memory))
        return _ran(name, rss=114.9, pinned=0.0)

    monkeypatch.setattr(bench_run, "run_method", fake_run)
    opts = bench_run.BenchOptions(model="llama-7b", methods=["zero-offload", "dostune"],
                                  schedule=ScheduleConfig(gpu_fraction=0.25, overlap_backward=True),
                                  host_available_bytes=124 * GiB)
    res = bench_run.run_bench(opts, command="pytest")
    assert ran == [("zero-offload", False)]  # dostune never started
    z, d = res.methods["zero-offload"], res.methods["dostune"]
    assert z.ran and z.host_peak_rss_gib == 114.9 and z.host_pinned_gib == 0.0
    assert "(pin_memory false: pinned it needs about 134 GiB" in z.description
    assert not d.ran and d.host_peak_rss_gib is None
    assert d.error.startswith("not run: its optimizer state needs about 15") and "124.0 GiB are available" in d.error
    table = {r[0]: r for r in rows(res)}
    assert len(table["dostune"]) == len(table["zero-offload"]) == len(COLUMNS)
    host, pinned = COLUMNS.index("host peak GiB"), COLUMNS.index("pinned GiB")
    assert table["zero-offload"][host] == "114.9" and table["zero-offload"][pinned] == "0.0"
    assert table["dostune"][1] == "did not run" and table["dostune"][-1] == d.error  # the reason whole, not cut
    md = markdown(res)
    assert "| host peak GiB | pinned GiB |" in md and "| dostune | did not run |" in md and d.error in md
    again = load_bench(save_record(res, tmp_path / "bench.json"))
    assert again.methods["zero-offload"].host_peak_rss_gib == 114.9 and again == res


def test_host_peaks_pool_to_the_highest_of_the_rounds_and_ranks():
    a, b = _ran("dostune", 30.0, 28.0, 1.0), _ran("dostune", 31.5, None, 2.0)
    p = pool_rounds([a, b])
    assert p.host_peak_rss_gib == 31.5 and p.host_pinned_gib == 28.0
    c = combine_ranks([a, b])
    assert c.host_peak_rss_gib == 31.5 and c.host_pinned_gib == 28.0
    assert [r.host_peak_rss_gib for r in c.ranks] == [30.0, 31.5]
    cpu = pool_rounds([_ran("zero-offload", 3.0, None), _ran("zero-offload", 2.0, None)])
    assert cpu.host_pinned_gib is None  # nothing page-locked without CUDA: unknown, not 0
    assert rows(bench_run.bench_record(bench_run.BenchOptions(), 1, {"zero-offload": cpu}))[0][
        COLUMNS.index("pinned GiB")] == "-"


def test_the_peak_rss_is_the_methods_own_from_its_reset():
    if peak_rss_bytes() is None:
        pytest.skip("no /proc/self/status here")
    big = bytearray(256 * 2**20)  # touched: resident
    for i in range(0, len(big), 4096):
        big[i] = 1
    high = peak_rss_bytes()
    del big
    reset_host_peaks()
    assert peak_rss_bytes() < high - 200 * 2**20  # the earlier method's peak is gone


def test_twin_flow_at_the_largest_ratio_the_host_holds_when_zero_offload_did_not_run(monkeypatch):
    # llama-13b on 124 GiB: ZeRO-Offload's state does not fit the host, so there is no measured peak to match
    # Twin-Flow's ratio to; it runs at the largest ratio the host holds instead (it used to run at ratio 1.0, i.e. as
    # ZeRO-Offload, refused with ZeRO-Offload's figures)
    ran = []
    monkeypatch.setattr(bench_run, "run_method", lambda name, spec, opts, offload, progress:
                        ran.append((name, offload.ratio)) or _ran(name, rss=100.0, pinned=90.0))
    schedule = ScheduleConfig(gpu_fraction=0.9, resident_subgroups=70)  # fits the host
    opts = bench_run.BenchOptions(model="llama-13b", methods=["zero-offload", "twin-flow-mem", "dostune"],
                                  schedule=schedule, host_available_bytes=124 * GiB)
    res = bench_run.run_bench(opts, command="pytest")
    z, t = res.methods["zero-offload"], res.methods["twin-flow-mem"]
    assert not z.ran and t.ran and ("zero-offload" not in {name for name, _ in ran})
    ratio = dict(ran)["twin-flow-mem"]
    numels = param_numels(resolve_model("llama-13b"))
    fits = lambda r: bench_run.twin_flow_host_ratio(r, 100_000_000, numels, "bf16", 124 * GiB)[0] == r  # noqa: E731
    assert 0.3 < ratio < 0.6 and fits(ratio) and not fits(round(ratio + 0.01, 2))
    assert t.description.endswith(f"(ratio {ratio}: the largest this host's memory holds; ZeRO-Offload did not run "
                                  "to match dostune's GPU memory against)")
    # a matched ratio the host holds is kept as it is, one it does not hold comes down to the largest it does
    assert bench_run.twin_flow_host_ratio(0.2, 100_000_000, numels, "bf16", 124 * GiB) == (0.2, "")
    assert bench_run.twin_flow_host_ratio(0.9, 100_000_000, numels, "bf16", 124 * GiB) == (
        ratio, "the largest this host's memory holds; dostune's GPU memory would need ratio 0.9")
    with pytest.raises(DostuneError, match="add dostune and zero-offload"):
        bench_run.BenchOptions(methods=["dostune", "twin-flow-mem"]).resolved_methods()


def test_a_twin_flow_row_that_failed_says_the_ratio_it_ran_at(monkeypatch):
    # llama-13b on one H200: at the largest ratio the host holds, the rest of the state overflows the GPU
    def run(name, spec, opts, offload, progress):
        if name == "twin-flow-mem":
            return MethodResult(method=name, description=opts.describe(name), ran=False,
                                error="OutOfMemoryError: CUDA out of memory")
        return _ran(name, rss=100.0, pinned=90.0)

    monkeypatch.setattr(bench_run, "run_method", run)
    opts = bench_run.BenchOptions(model="llama-13b", methods=["zero-offload", "twin-flow-mem", "dostune"],
                                  schedule=ScheduleConfig(gpu_fraction=0.9, resident_subgroups=70),
                                  host_available_bytes=124 * GiB)
    t = bench_run.run_bench(opts, command="pytest").methods["twin-flow-mem"]
    assert not t.ran and t.error.startswith("OutOfMemoryError")
    assert re.search(r"\(ratio 0\.\d+: the largest this host's memory holds; ", t.description)
