"""The CPU lane's worker under overlap_backward on its own (no DeepSpeed engine): which thread count each update
runs with, and how many subgroups it updates speculatively."""
import os
import threading
import time

import pytest
import torch

from dostune.optim import cpu_kernel
from dostune.optim.kernels import AdamScalars
from dostune.optim.overlap import BackwardOverlap, SubgroupIO

N = 1024
SUBGROUPS = [3, 2, 1, 0]  # backward order: the last layers' subgroup first
SCALARS = AdamScalars(beta1=0.9, beta2=0.999, beta1_minus1=0.1, beta2_minus1=0.001, bias_correction2=1.0, eps=1e-8,
                      step_size=-1e-3, decay=0.0, has_decay=False, adamw=True)


@pytest.fixture
def lane(monkeypatch):
    """A BackwardOverlap over four CPU subgroups whose kernel calls are recorded (subgroup, threads) and, while
    ``hold`` is clear, block, so the test decides where the step begins relative to the worker's progress."""
    gen = torch.Generator().manual_seed(0)
    ios = {i: SubgroupIO(param=torch.randn(N, generator=gen), grad=torch.randn(N, generator=gen),
                         exp_avg=torch.zeros(N), exp_avg_sq=torch.zeros(N), half=torch.zeros(N, dtype=torch.bfloat16))
           for i in SUBGROUPS}
    calls, hold = [], threading.Event()
    hold.set()
    real = cpu_kernel.adam_out_of_place

    def recorded(p, *args, threads=None, **kwargs):
        i = next(k for k, io in ios.items() if io.param is p)
        calls.append((i, threads))
        hold.wait()
        return real(p, *args, threads=threads, **kwargs)

    monkeypatch.setattr(cpu_kernel, "adam_out_of_place", recorded)
    ov = BackwardOverlap(SUBGROUPS, ios.__getitem__, lambda: {i: SCALARS for i in SUBGROUPS}, torch.device("cpu"),
                         lambda key, t: None, threads_backward=1, threads_step=2)
    yield ov, calls, hold
    hold.set()
    ov.close()


def wait_for(cond, timeout=30.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "the worker did not get there"
        time.sleep(0.005)


def test_updates_handed_over_in_backward_use_the_step_threads_once_the_step_begins(lane):
    ov, calls, hold = lane
    hold.clear()
    ov.open(BackwardOverlap.spec_factor(1.0), 1.0, 0.0)
    for i in SUBGROUPS[:3]:  # backward finalises three subgroups; the worker is still in the first one's kernel
        ov.ready(i, None, None)
    wait_for(lambda: len(calls) == 1)
    ov.submit(BackwardOverlap.spec_factor(1.0), True)  # the step begins (the fourth subgroup comes with it)
    hold.set()
    out = ov.finish(BackwardOverlap.spec_factor(1.0), True)
    assert calls == [(3, 1), (2, 2), (1, 2), (0, 2)]
    assert out.committed == sorted(SUBGROUPS) and out.speculative == 4 and out.redone == 0


def test_speculation_stops_at_the_cap_and_the_rest_waits_for_the_real_factor(lane):
    ov, calls, _ = lane
    ov.max_speculative = 2
    ov.open(BackwardOverlap.spec_factor(1.0), 1.0, 0.0)
    for i in SUBGROUPS:
        ov.ready(i, None, None)
    wait_for(lambda: ov._tasks.empty() and len(calls) == 2)
    time.sleep(0.05)
    assert calls == [(3, 1), (2, 1)]  # the others are deferred, not updated during backward
    out = ov.finish(BackwardOverlap.spec_factor(1.0), True)
    assert calls == [(3, 1), (2, 1), (1, 2), (0, 2)]
    assert out.committed == sorted(SUBGROUPS) and out.speculative == 2 and out.redone == 0


def _parse_cpu_list(text: str) -> frozenset:
    """The kernel's list format, e.g. "0-3,6"."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def _masks_of_threads() -> dict[int, frozenset]:
    """Every thread of this process and the CPUs it may run on."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            for line in open(f"/proc/self/task/{task}/status"):
                if line.startswith("Cpus_allowed_list:"):
                    out[int(task)] = _parse_cpu_list(line.split(":", 1)[1].strip())
        except OSError:  # the thread ended meanwhile
            pass
    return out


needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                                    or not os.path.isdir("/proc/self/task"), reason="needs Linux and two CPUs")


@needs_two_cpus
def test_pin_team_moves_the_pool_threads_too():
    cpus = sorted(os.sched_getaffinity(0))
    found = {}

    def lead():  # a fresh thread: its OpenMP pool is created by the first region below
        cpu_kernel.pin_team(2, cpus[:1])
        found["pinned"] = _masks_of_threads()
        found["self"] = threading.get_native_id()
        cpu_kernel.pin_team(2, cpus)
        found["back"] = _masks_of_threads()

    t = threading.Thread(target=lead)
    t.start()
    t.join()
    pinned = {tid for tid, m in found["pinned"].items() if m == frozenset(cpus[:1])}
    assert found["self"] in pinned and len(pinned) >= 2  # the leader and its pool thread
    assert all(found["back"].get(tid) == frozenset(cpus) for tid in pinned if tid in found["back"])


@needs_two_cpus
def test_pinned_lane_keeps_off_the_hook_threads_cpu_in_backward_only(lane):
    ov, calls, hold = lane
    cpus = sorted(os.sched_getaffinity(0))
    seen = []
    real = cpu_kernel.adam_out_of_place

    def affinity_recorded(*args, **kwargs):
        seen.append(sorted(os.sched_getaffinity(0)))
        return real(*args, **kwargs)

    cpu_kernel.adam_out_of_place = affinity_recorded  # the fixture's monkeypatch restores the original
    ov.pin_threads = True
    try:
        hold.clear()
        ov.open(BackwardOverlap.spec_factor(1.0), 1.0, 0.0)  # this thread plays backward's hook thread
        assert sorted(os.sched_getaffinity(0)) == cpus[-1:]
        ov.ready(SUBGROUPS[0], None, None)
        wait_for(lambda: len(calls) == 1)
        ov.submit(BackwardOverlap.spec_factor(1.0), True)
        hold.set()
        ov.finish(BackwardOverlap.spec_factor(1.0), True)
    finally:
        ov.pin_threads = False
        ov.pin_hook_thread()  # gives this thread every CPU back
    assert sorted(os.sched_getaffinity(0)) == cpus
    assert seen[0] == cpus[:-1] and all(s == cpus for s in seen[1:]) and len(seen) == len(SUBGROUPS)


@needs_two_cpus
def test_close_gives_a_pinned_hook_thread_every_cpu_back(lane):
    ov, _, _ = lane
    cpus = sorted(os.sched_getaffinity(0))
    ov.pin_threads = True
    opened, release, tid = threading.Event(), threading.Event(), []

    def hook_thread():  # outlives the lane, as backward's thread outlives the engine
        tid.append(threading.get_native_id())
        ov.open(BackwardOverlap.spec_factor(1.0), 1.0, 0.0)
        opened.set()
        release.wait(30)

    t = threading.Thread(target=hook_thread)
    t.start()
    try:
        assert opened.wait(30)
        assert sorted(os.sched_getaffinity(tid[0])) == cpus[-1:]
        ov.finish(BackwardOverlap.spec_factor(1.0), True)
        ov.close()
        assert sorted(os.sched_getaffinity(tid[0])) == cpus
    finally:
        release.set()
        t.join()
