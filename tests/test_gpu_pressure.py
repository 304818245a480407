"""GPU memory pressure (docs/faults.md): when the GPU lane cannot allocate its memory at a step, that step's GPU-lane
subgroups are updated by DeepSpeed's own update on the host instead, a warning says so once, and the next step
uses the GPU lane again. The allocation failures are injected into the CPU emulation of the GPU lane (as in
test_parity.py); the results must still be DeepSpeed's, bit for bit."""
import logging

import pytest
import torch

from dostune.optim.schedule import ScheduleConfig

from parity_helpers import base_settings, reference, run
from test_parity import check

STEPS = 12
FAIL_AT = (2, 5, 6, 9)  # two in a row: the step after a fallback may fall back again

SCHEDULES = {
    # subgroups 0-2 stream through two slots, their gradients kept on the lane's device
    "streamed": ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", staging_buffers=2, trace=True),
    # ... or streamed in from DeepSpeed's fp32 host buffer
    "streamed-host-grads": ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", staging_buffers=2,
                                          grads_on_gpu=False, trace=True),
    # the CPU lane (2-4) runs during backward; the fallen subgroups 0-1 are updated at the step
    "overlap": ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", overlap_backward=True, trace=True),
    # subgroup 0's states stay on the device: it keeps the GPU lane while 1 and 2 fall back
    "resident": ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", resident_subgroups=1, staging_buffers=1,
                               expected_subgroups=5, trace=True),
    # every subgroup on the GPU lane: a failed step leaves the lane's Adam (and DeepSpeed's) without a call
    "all-gpu-lane": ScheduleConfig(gpu_fraction=1.0, staging_buffers=3, trace=True),
}


class Pressure:
    """Makes the GPU lane's allocations fail at chosen steps, and keeps each step's trace."""

    def __init__(self, slots_at=(), grads_at=None):
        self.slots_at = set(slots_at)
        self.grads_at = grads_at or {}  # step -> subgroups whose kept-gradient buffer cannot be allocated
        self.step = 0
        self.traces: list[list] = []
        self.opt = None

    def install(self, opt):
        self.opt, dos = opt, opt._dos
        new_slot, device_buffer, step = dos.streamed._new_slot, dos.grads._device_buffer, dos.step

        def failing_slot():
            if self.step in self.slots_at:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return new_slot()

        def failing_buffer(i):
            if i in self.grads_at.get(self.step, ()):
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return device_buffer(i)

        def counted_step():
            step()
            self.traces.append(opt.dostune_last_trace)
            self.step += 1

        dos.streamed._new_slot, dos.grads._device_buffer, dos.step = failing_slot, failing_buffer, counted_step

    def lanes(self, step: int) -> dict[int, set]:
        """Subgroup -> the lanes that worked on it at ``step``."""
        out: dict[int, set] = {}
        for span in self.traces[step]:
            out.setdefault(span.subgroup, set()).add(span.lane)
        return out


def pressure_warnings(caplog) -> list:
    return [r for r in caplog.records if r.name == "dostune.optim.pressure" and r.levelno == logging.WARNING]


def run_under_pressure(caplog, sched: ScheduleConfig, pressure: Pressure, seams=None, **train_kw):
    train = base_settings(precision="bf16", **train_kw)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dostune.optim.pressure"):
        ours = run(train, sched, steps=STEPS, adjust=pressure.install, seams=seams)
    ref = reference(train, steps=STEPS)
    check(ours, ref)
    assert torch.equal(ours["weights"], ref["weights"])  # on the CPU the lanes are DeepSpeed's arithmetic exactly
    assert len(pressure.traces) == STEPS
    assert len(pressure_warnings(caplog)) == 1
    return ours


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_failed_staging_sends_the_steps_gpu_lane_to_the_cpu(caplog, name):
    sched = SCHEDULES[name]
    pressure = Pressure(slots_at=FAIL_AT)
    ours = run_under_pressure(caplog, sched, pressure)
    plan = pressure.opt.dostune_plan
    streamed = [s.subgroup for s in plan.gpu_slots]
    assert streamed and pressure.opt._dos.step_plan is plan  # the run's plan is back after the last fallback
    assert ours["pressure"] == {"fallback_steps": len(FAIL_AT), "fallback_subgroups": len(FAIL_AT) * len(streamed),
                                "upload_fallback_steps": 0}
    assert str(streamed) in pressure_warnings(caplog)[0].getMessage()
    for step in range(STEPS):
        lanes = pressure.lanes(step)
        for i in streamed:  # updated on the host when the slots failed, on the GPU lane at every other step
            assert lanes[i] == ({"cpu", "up"} if step in FAIL_AT else {"h2d", "gpu", "d2h"}), (step, i)
        for i in plan.resident:  # its states are on the device already: it needs no slot
            assert "gpu" in lanes[i] and "cpu" not in lanes[i], (step, i)
        for i in plan.cpu_order:
            assert "gpu" not in lanes.get(i, set()), (step, i)
    if sched.overlap_backward:  # the CPU lane's own subgroups still ran during backward, committed at each step
        assert ours["overlap"]["committed"] == STEPS * len(plan.cpu_order)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_failed_staging_sends_lent_subgroups_back_to_the_cpu(caplog, overlap):
    """CPU-lane subgroups that adaptive_swing lent to the GPU lane stream through its slots: a step whose slots
    fail updates them on the host with DeepSpeed's own update, from the gradients backward offloaded for them."""
    from test_parity import ScriptedLanes

    from dostune.optim.balance import LaneTimes

    # GPU lane 0-1, CPU lane 2-4; the CPU lane ends last at every step, so the GPU lane takes 2 and 3 after 3 steps
    sched = ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", staging_buffers=2, adaptive_swing=2,
                           overlap_backward=overlap, trace=True)
    script = ScriptedLanes(lambda step, plan: LaneTimes(cpu_end=1.0, gpu_end=0.010, cpu_sub=0.1, gpu_sub=0.010))
    fail_at = (4, 7, 8)
    pressure = Pressure(slots_at=fail_at)
    ours = run_under_pressure(caplog, sched, pressure, seams=script.seams())
    assert pressure.opt.dostune_plan.lent == (2, 3)
    assert ours["pressure"]["fallback_steps"] == len(fail_at) and ours["pressure"]["fallback_subgroups"] == 4 * 3
    for step in range(3, STEPS):
        lanes = pressure.lanes(step)
        for i in (0, 1, 2, 3):
            assert lanes[i] == ({"cpu", "up"} if step in fail_at else {"h2d", "gpu", "d2h"}), (step, i)
        assert "gpu" not in lanes[4], step
    # a step that fell back measures nothing, and the swing stays where it was
    assert len(script.steps) == STEPS - len(fail_at)
    assert pressure.opt.dostune_swing_stats == {"steps_by_swing": {-2: STEPS - 3, 0: 3}, "swing": -2}


@pytest.mark.slow
def test_failed_gradient_buffers_send_those_subgroups_to_the_cpu(caplog):
    """The kept gradients are allocated during backward, one buffer per streamed GPU-lane subgroup: a subgroup that
    cannot get one is offloaded by DeepSpeed and updated on the host; the other GPU-lane subgroups stay on the GPU
    lane. A resident subgroup's gradients go to DeepSpeed's own buffer on the device, allocated at start-up: no
    failure at the step can take it off the GPU lane (subgroup 0 is asked to fail too)."""
    sched = ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", overlap_backward=True, resident_subgroups=1,
                           staging_buffers=1, expected_subgroups=5, trace=True)  # 0 resident, 1-2 streamed, 3-4 CPU
    lost = {1: (0, 1), 3: (2,), 4: (0, 1, 2), 8: (0,)}
    pressure = Pressure(grads_at=lost)
    ours = run_under_pressure(caplog, sched, pressure)
    assert ours["pressure"] == {"fallback_steps": 3, "fallback_subgroups": 4, "upload_fallback_steps": 0}
    for step in range(STEPS):
        lanes = pressure.lanes(step)
        for i in (1, 2):
            on_cpu = i in lost.get(step, ())
            assert ("cpu" in lanes[i]) == on_cpu and ("gpu" in lanes[i]) != on_cpu, (step, i)
        assert lanes[0] == {"gpu"}, step  # nothing copied in or out, never on the host


def test_cpu_lane_uploads_with_deepspeeds_copy_when_its_buffer_cannot_be_allocated(caplog, monkeypatch):
    """gpu_convert's device buffer, allocated at each step: without it, DeepSpeed's own blocking copy (converted on
    the host) writes the same half-precision values. The fake streams stand in for a CUDA device's."""
    import contextlib

    from dostune.optim.pressure import MemoryPressure
    from dostune.optim.uploads import Fp32Upload

    class NoRoomQueues:
        def on(self, name):
            return contextlib.nullcontext()

        def sync(self, name):
            pass

    real_empty = torch.empty

    def no_device_memory(*args, device=None, **kw):
        if device is not None:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_empty(*args, **kw)

    pressure = MemoryPressure()
    up = Fp32Upload(NoRoomQueues(), torch.device("cpu"), pressure)
    src = torch.randn(100, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="dostune.optim.pressure"):
        for step in range(2):
            monkeypatch.setattr(torch, "empty", no_device_memory)
            up.begin(100, torch.bfloat16)
            monkeypatch.undo()
            dst, trace = torch.zeros(100, dtype=torch.bfloat16), []
            up.send(0, 3, src, dst, trace)
            up.end()
            assert torch.equal(dst, src.to(torch.bfloat16)) and [s[:2] for s in trace] == [("up", 3)]
        pressure.gpu_lane_fell_back((0, 1), "staging slots")
    assert pressure.stats == {"fallback_steps": 1, "fallback_subgroups": 2, "upload_fallback_steps": 2}
    assert len(pressure_warnings(caplog)) == 1 and "upload buffer" in pressure_warnings(caplog)[0].getMessage()
