"""The CPU parity tests again on the GPU: the GPU lane now streams over PCIe and runs the Triton kernel."""
import pytest

from dostune.optim.cpu_lane import CpuLaneSeams
from dostune.optim.schedule import ScheduleConfig

from parity_helpers import base_settings, reference, run
from test_parity import NO_CUTOFF, SCHEDULES, both_ways_case, check, checkpoint_into_running_engine, overflow_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_bf16_adamw_clipping_gpu(name):
    train = base_settings(precision="bf16", clip=1.0)
    check(run(train, SCHEDULES[name], pin_memory=True), reference(train))


@pytest.mark.parametrize("upload", ["gpu_convert", "cpu_convert"])
@pytest.mark.parametrize("grads_on_gpu", [True, False])
def test_lane_variants_gpu(upload, grads_on_gpu):
    train = base_settings(precision="bf16", clip=0.0, adamw=False, weight_decay=0.05)
    sched = ScheduleConfig(gpu_fraction=0.5, upload=upload, grads_on_gpu=grads_on_gpu)
    check(run(train, sched, pin_memory=True), reference(train))


@pytest.mark.parametrize("schedule", ["every-2nd", "overlap", "overlap-resident", "overlap-partial"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_overflow_gpu(precision, schedule):
    overflow_case(precision, schedule, pin_memory=True)


def test_checkpoint_into_running_engine_gpu(tmp_path):
    # the resident states are saved from the GPU and a load replaces them there, beside the lanes' streams
    checkpoint_into_running_engine(tmp_path, pin_memory=True)


def test_grad_accumulation_gpu():
    train = base_settings(precision="bf16", grad_accum=2, warmup_steps=20)
    check(run(train, SCHEDULES["every-4th"], steps=50, pin_memory=True), reference(train, steps=50))


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_overlap_gpu(clip):
    # 0.0: every speculative update is committed; 0.05: every one is recomputed (cutoff off so that all run).
    train = base_settings(precision="bf16", clip=clip)
    ours = run(train, SCHEDULES["overlap"], steps=30, pin_memory=True, seams=NO_CUTOFF)
    check(ours, reference(train, steps=30))
    st = ours["overlap"]
    assert st["speculative"] == st["committed"] == 90
    assert st["redone"] == (0 if clip == 0.0 else 90)



@pytest.mark.parametrize("overlap", [True, False])
def test_adaptive_swing_gpu(overlap):
    """adaptive_swing with its real decision: lane ends measured with CUDA events every step. The swings it
    chooses on this tiny model are whatever its timings say; the values must be DeepSpeed's regardless, and
    the measurement must have fed every step after the first (whose CPU-lane cost may be unknown)."""
    train = base_settings(precision="bf16", clip=0.0)
    sched = ScheduleConfig(gpu_fraction=0.8, gpu_placement="first", overlap_backward=overlap, staging_buffers=2,
                           adaptive_swing=3)
    seen = []

    def watch(measured):
        def lane_times(trace, plan):
            seen.append(measured(trace, plan))
            return seen[-1]
        return lane_times

    ours = run(train, sched, steps=30, pin_memory=True, seams=CpuLaneSeams(wrap_lane_times=watch))
    check(ours, reference(train, steps=30))
    assert len(seen) == 30 and all(t is not None for t in seen[1:])
    assert all(t.gpu_end > 0 and t.cpu_sub > 0 and t.gpu_sub > 0 for t in seen[1:])


@pytest.mark.parametrize("overlap", [True, False])
def test_lane_balance_both_ways_gpu(overlap):
    # the lent CPU-lane subgroups' states and gradients now cross PCIe into the staging slots and back
    both_ways_case(overlap, exact=False, pin_memory=True)
