"""The CPU lane's worker under overlap_backward on its own (no DeepSpeed engine): which thread count each update
runs with."""
import threading
import time

import pytest
import torch

from dostune.optim import cpu_kernel
from dostune.optim.device import CpuDevice
from dostune.optim.kernels import AdamScalars
from dostune.optim.overlap import BackwardOverlap, SubgroupIO

N = 1024
SUBGROUPS = [3, 2, 1, 0]  # backward order: the last layers' subgroup first
SCALARS = AdamScalars(beta1=0.9, beta2=0.999, beta1_minus1=0.1, beta2_minus1=0.001, bias_correction2=1.0, eps=1e-8,
                      step_size=-1e-3, decay=0.0, has_decay=False, adamw=True)


@pytest.fixture(params=[SUBGROUPS], ids=["all-speculative"])
def lane(monkeypatch, request):
    """A BackwardOverlap over four CPU subgroups (those in ``request.param`` speculative) whose kernel calls are
    recorded (subgroup, threads) and, while ``hold`` is clear, block, so the test decides where the step begins
    relative to the worker's progress."""
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
    ov = BackwardOverlap(SUBGROUPS, ios.__getitem__, lambda: {i: SCALARS for i in SUBGROUPS},
                         CpuDevice(torch.device("cpu")), lambda key, t: None, threads_backward=1, threads_step=2,
                         ring=len(SUBGROUPS), speculative=request.param)
    yield ov, calls, hold, ios
    hold.set()
    ov.close()


def wait_for(cond, timeout=30.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "the worker did not get there"
        time.sleep(0.005)


def test_updates_handed_over_in_backward_use_the_step_threads_once_the_step_begins(lane):
    ov, calls, hold, _ = lane
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


@pytest.mark.parametrize("lane", [[3]], indirect=True, ids=["one-speculative"])
def test_subgroups_beyond_the_speculative_count_are_updated_in_place_once_the_step_begins(lane):
    """Only subgroup 3 speculates (into its shadows, during backward); 2, 1 and 0 wait for the step's factor and are
    updated in place, with the step's threads, in the order backward finalised them."""
    ov, calls, hold, ios = lane
    live = {i: (ios[i].param.data_ptr(), ios[i].param.clone()) for i in SUBGROUPS}
    ov.open(BackwardOverlap.spec_factor(1.0), 1.0, 0.0)
    for i in SUBGROUPS:
        ov.ready(i, None, None)
    wait_for(lambda: len(calls) == 1)
    time.sleep(0.05)
    assert calls == [(3, 1)]  # the others wait for the real factor
    with pytest.raises(KeyError):
        ov.shadow(2)
    out = ov.finish(BackwardOverlap.spec_factor(1.0), True)
    assert calls == [(3, 1), (2, 2), (1, 2), (0, 2)]
    assert out.committed == [3] and out.in_place == [0, 1, 2] and out.speculative == 1 and out.redone == 0
    assert torch.equal(ios[3].param, live[3][1])  # its update is in the shadow, to be swapped in
    assert not torch.equal(ov.shadow(3).p, live[3][1])
    for i in (0, 1, 2):  # updated where they live
        assert ios[i].param.data_ptr() == live[i][0] and not torch.equal(ios[i].param, live[i][1])
