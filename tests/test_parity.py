"""The interleaved optimizer against DeepSpeed's own ZeRO-3 CPU-offload path: same seed, same batches,
100 steps, fp32 master weights compared. On a CPU-only machine the "GPU" lane runs on the CPU device
through the same schedule, buffers and hand-offs. The lanes reproduce DeepSpeed's arithmetic, so the
result is expected to be bit-identical; the bound asked for is 1e-6 relative."""
import pytest
import torch

from dostune.optim.balance import LaneTimes
from dostune.optim.cpu_lane import CpuLaneSeams
from dostune.optim.schedule import ScheduleConfig

from parity_helpers import base_settings, reference, rel_diff, run, tiny_engine

TOL = 1e-6

SCHEDULES = {
    "all-cpu": ScheduleConfig(gpu_fraction=0.0),
    "every-2nd": ScheduleConfig(gpu_fraction=0.5, gpu_placement="spread"),
    "every-4th": ScheduleConfig(gpu_fraction=0.25, gpu_placement="spread", staging_buffers=1),
    "first-60pct": ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", staging_buffers=2),
    "all-gpu-lane": ScheduleConfig(gpu_fraction=1.0, staging_buffers=3),
    "overlap": ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", overlap_backward=True),
    # subgroup 0's states stay on the GPU lane's device; 1 and 2 stream through one slot
    "overlap-resident": ScheduleConfig(gpu_fraction=0.6, gpu_placement="first", overlap_backward=True,
                                       resident_subgroups=1, staging_buffers=1, expected_subgroups=5),
    "all-resident": ScheduleConfig(gpu_fraction=1.0, resident_subgroups=5, staging_buffers=1, expected_subgroups=5),
    "overlap-all-cpu": ScheduleConfig(gpu_fraction=0.0, overlap_backward=True, backward_cpu_threads=1),
    # CPU lane 2-4: only 4 (its gradients are final first) speculates; 2 and 3 are updated in place in the step
    "overlap-partial": ScheduleConfig(gpu_fraction=0.4, gpu_placement="first", overlap_backward=True,
                                      speculative_subgroups=1),
}


def check(ours, ref):
    assert ours["type"] == "InterleavedZeroOptimizer"
    assert ref["type"] == "DeepSpeedZeroOptimizer_Stage3"
    assert ours["subgroups"] == ref["subgroups"] >= 4
    d = rel_diff(ours["weights"], ref["weights"])
    assert d <= TOL, f"master weights differ from DeepSpeed's by {d:.3e} relative"
    assert ours["losses"] == pytest.approx(ref["losses"], rel=TOL)
    # the last step's global gradient norm, bit for bit: dostune records and sums the per-parameter norms its own
    # way (dostune.optim.norms); one ulp off would change every clipped update after it
    assert ours["grad_norm"] == ref["grad_norm"]
    return d


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_bf16_adamw_clipping(name):
    train = base_settings(precision="bf16", clip=1.0)
    check(run(train, SCHEDULES[name]), reference(train))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["every-2nd", "all-gpu-lane"])
def test_bf16_adamw_no_clipping(name):
    train = base_settings(precision="bf16", clip=0.0)
    check(run(train, SCHEDULES[name]), reference(train))


@pytest.mark.slow
@pytest.mark.parametrize("grads_on_gpu", [True, False])
def test_adam_l2_mode(grads_on_gpu):
    train = base_settings(precision="bf16", adamw=False, weight_decay=0.05)
    check(run(train, ScheduleConfig(gpu_fraction=0.5, grads_on_gpu=grads_on_gpu)), reference(train))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["every-2nd", "overlap"])
def test_fp32(name):
    # fp32 training: the "half" partitions are fp32 (the CPU lane during backward uploads its new params as they are)
    train = base_settings(precision="fp32")
    check(run(train, SCHEDULES[name]), reference(train))


@pytest.mark.slow
def test_grad_accumulation_and_lr_schedule():
    train = base_settings(precision="bf16", grad_accum=2, warmup_steps=20)
    check(run(train, SCHEDULES["every-2nd"], steps=50), reference(train, steps=50))


NO_CUTOFF = CpuLaneSeams(partial_norm_cutoff=False)  # speculate on every subgroup, so every rollback path runs


def cpu_lane_count(schedule: str) -> int:
    """CPU-lane subgroups of a test schedule on the 5 subgroups."""
    from dostune.optim.schedule import make_plan

    return len(make_plan(5, SCHEDULES[schedule]).cpu_order)


def overflow_case(precision: str, schedule: str, **run_kw):
    """Two overflows in a row: with DeepSpeed's default hysteresis of 2 the second one halves the fp16 scale.
    With overlap_backward the overflowing steps' speculative updates (and their uploads) must be undone."""
    # bf16 without clipping: the overlap keeps no running gradient norm then (nothing could use it), so the
    # overflowing steps are found only at the step, after every CPU-lane update has speculated
    train = base_settings(precision=precision, clip=0.0 if precision == "bf16" else 1.0)
    ref = reference(train, steps=30, overflow_steps=(5, 6))
    partial_norms = []

    def adjust(opt):
        norms = opt._dos.norms
        add = norms.add_partial
        norms.add_partial = lambda pids: partial_norms.append(pids) or add(pids)

    adjust = adjust if SCHEDULES[schedule].overlap_backward else None
    ours = run(train, SCHEDULES[schedule], steps=30, overflow_steps=(5, 6), adjust=adjust, seams=NO_CUTOFF, **run_kw)
    check(ours, ref)
    if adjust is not None:
        assert bool(partial_norms) == (precision == "fp16")
    assert ours["skipped"] == ref["skipped"] == 2
    assert ours["loss_scale"] == ref["loss_scale"]
    assert torch.isfinite(ours["weights"]).all()
    if precision == "fp16":
        assert ours["loss_scale"] < reference(train, steps=30)["loss_scale"]
    if adjust is not None:  # committed from shadows, or made in place in the step
        assert ours["overlap"]["committed"] + ours["overlap"]["in_step"] == (30 - 2) * cpu_lane_count(schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["every-2nd", "overlap", "overlap-resident", "overlap-partial"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_overflow_steps_are_skipped_and_nothing_corrupted(precision, schedule):
    if precision == "fp16" and not _cpu_fp16_supported():
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on this CPU (no oneDNN fp16 support); "
                    "the GPU suite runs the fp16 case")
    overflow_case(precision, schedule)


def _cpu_fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return acc.device_name() != "cpu" or bool(acc.is_fp16_supported())


@pytest.mark.slow
def test_overlap_commits_speculative_updates_when_clipping_does_not_trigger():
    train = base_settings(precision="bf16", clip=0.0)
    ours = run(train, SCHEDULES["overlap"], steps=30)
    check(ours, reference(train, steps=30))
    st = ours["overlap"]
    assert st["steps"] == 30 and st["speculative"] == st["committed"] == 30 * 3 and st["redone"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("cutoff", [True, False])
def test_overlap_recomputes_when_clipping_triggers(cutoff):
    train = base_settings(precision="bf16", clip=0.05)  # far below these gradient norms: clips every step
    ours = run(train, SCHEDULES["overlap"], steps=30, seams=None if cutoff else NO_CUTOFF)
    check(ours, reference(train, steps=30))
    st = ours["overlap"]
    assert st["committed"] == 30 * 3
    if cutoff:  # the first ready subgroup's norm already exceeds 0.05: nothing is wasted
        assert st["speculative"] == st["redone"] == 0
    else:
        assert st["speculative"] == st["redone"] == 30 * 3


@pytest.mark.slow
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_partial_speculation_updates_the_others_in_place_in_the_step(clip):
    """speculative_subgroups 1: subgroup 4 speculates into its shadows (committed when clipping does not trigger,
    recomputed when it does: 0.05 clips every step); 2 and 3 have no shadows and are updated in place in the step,
    with the real factor. Either way the values are DeepSpeed's."""
    train = base_settings(precision="bf16", clip=clip)

    def adjust(opt):
        worker = opt._dos.cpu.worker
        assert worker.shadow(4).p.numel() == opt.fp16_partitioned_groups_flat_numel[4]
        for i in (2, 3):
            with pytest.raises(KeyError):
                worker.shadow(i)

    ours = run(train, SCHEDULES["overlap-partial"], steps=30, adjust=adjust, seams=NO_CUTOFF)
    check(ours, reference(train, steps=30))
    st = ours["overlap"]
    assert st["steps"] == 30 and st["speculative"] == st["committed"] == 30 and st["in_step"] == 60
    assert st["redone"] == (0 if clip == 0.0 else 30)


@pytest.mark.slow
def test_partial_speculation_with_subgroups_moving_between_lanes():
    """adaptive_swing's candidates (3, 2, 1) lie below the CPU lane's own subgroup 4: with speculative_subgroups 2
    only 4 and 3 have shadows; 2 and 1 are updated in place in the steps that move them to the CPU lane, and 4 on the
    GPU lane in the steps that lend it there."""
    train = base_settings(precision="bf16")
    sched = ScheduleConfig(gpu_fraction=0.8, gpu_placement="first", overlap_backward=True, resident_subgroups=1,
                           staging_buffers=2, adaptive_swing=3, speculative_subgroups=2, expected_subgroups=5)
    script = ScriptedLanes(jumping_host(base_cpu_lane=1))

    def adjust(opt):
        worker = opt._dos.cpu.worker
        assert all(worker.shadow(i).p.numel() == opt.fp16_partitioned_groups_flat_numel[i] for i in (3, 4))
        for i in (1, 2):
            with pytest.raises(KeyError):
                worker.shadow(i)

    ours = run(train, sched, steps=20, adjust=adjust, seams=script.seams(partial_norm_cutoff=False))
    check_bitwise(ours, reference(train, steps=20))
    lanes = [tuple(plan.cpu_order) for plan, _, _ in script.steps]
    assert set(lanes) == {(4,), (1, 2, 3, 4), ()}
    script.check_lanes()
    assert ours["overlap"]["committed"] == sum(len({3, 4} & set(c)) for c in lanes)
    assert ours["overlap"]["in_step"] == sum(len(set(c) - {3, 4}) for c in lanes)


def test_cpu_lane_reads_gradients_from_deepspeeds_pinned_buffer():
    """The saving is real only if the fast path is taken: every subgroup maps onto DeepSpeed's gradient-partition
    buffer, and the CPU lane during backward reads its gradients there (no fp32 copy)."""
    _, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap"])
    opt = engine.optimizer
    try:
        assert sorted(opt._dos.grads.slices) == list(range(len(opt.fp16_groups)))
        flat = opt.grad_partitions_flat_buffer
        for i in opt.dostune_plan.cpu_order:
            g = opt._dos.cpu.subgroup_io(i).grad
            assert g.dtype == torch.bfloat16 and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    finally:
        engine.destroy()


@pytest.mark.slow
def test_loading_a_checkpoint_into_a_running_engine_replaces_resident_states(tmp_path):
    checkpoint_into_running_engine(tmp_path)


def checkpoint_into_running_engine(tmp_path, pin_memory: bool = False):
    """Resident subgroups hold their only copy of their state on the GPU lane's device; a checkpoint loaded into the
    same engine must replace it there (torch's Optimizer.load_state_dict moves each saved state to its param's
    device), and the run continue from it."""
    from dostune.train.engine import master_weights, train_steps
    from parity_helpers import SEQ

    spec, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap-resident"], pin_memory=pin_memory)
    try:
        train_steps(engine, spec, 3, seq=SEQ, seed=1)
        engine.save_checkpoint(str(tmp_path), tag="s3")
        first = train_steps(engine, spec, 2, seq=SEQ, seed=2)
        after_first = master_weights(engine)
        engine.load_checkpoint(str(tmp_path), tag="s3")
        again = train_steps(engine, spec, 2, seq=SEQ, seed=2)
        assert again == first
        assert torch.equal(master_weights(engine), after_first)
    finally:
        engine.destroy()


@pytest.mark.slow
def test_every_parameter_is_released_after_a_step_and_a_skipped_step():
    # The step computes the gradient norm before DeepSpeed's release of the gathered parameters, so the lanes run
    # while the host releases them; the release must still happen on every path, the skipped step's too.
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dostune.models.registry import loss_of
    from parity_helpers import SEQ

    # persistence threshold 0: else every parameter of this small model is persistent, never gathered or released
    spec, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap-resident"],
                               zero_overrides={"stage3_param_persistence_threshold": 0})
    gen = torch.Generator().manual_seed(1)
    try:
        for step, scale in enumerate((1.0, float("inf"), 1.0)):
            loss = loss_of(engine(**spec.batch(2, SEQ, gen, engine.device))) * scale
            engine.backward(loss)
            # Backward's hooks have released what they gathered in this small model; a parameter gathered by hand
            # stands for what a big model's prefetch leaves gathered at the step.
            gathered = [p for p in engine.module.parameters() if not p.ds_persist][step]
            assert gathered.ds_status == ZeroParamStatus.NOT_AVAILABLE
            gathered.all_gather()
            assert gathered.ds_status == ZeroParamStatus.AVAILABLE
            engine.step()
            left = [p.ds_id for p in engine.module.parameters()
                    if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist]
            assert left == [], f"step {step}: parameters still gathered: {left}"
        assert engine.skipped_steps == 1
    finally:
        engine.destroy()


def test_step_phases_time_the_steps_parts_and_leave_out_skipped_steps():
    import time

    from dostune.models.registry import loss_of
    from parity_helpers import SEQ

    spec, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap-resident"],
                               zero_overrides={"stage3_param_persistence_threshold": 0})
    opt = engine.optimizer
    assert opt.dostune_step_phases == {}
    release = opt._partition_all_parameters

    def slow_release():  # the release runs beside the lanes: its time is queue_and_host_work's
        time.sleep(0.05)
        release()
    gen = torch.Generator().manual_seed(1)
    try:
        walls = []
        for scale in (1.0, float("inf"), 1.0):
            engine.backward(loss_of(engine(**spec.batch(2, SEQ, gen, engine.device))) * scale)
            opt._partition_all_parameters = slow_release
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
            opt._partition_all_parameters = release
        assert engine.skipped_steps == 1 and len(opt._dos.clock.phases) == 2  # the skipped step is not a row
        for row, wall in zip(opt._dos.clock.phases, (walls[0], walls[2])):
            assert set(row) == {"before_lanes", "queue_and_host_work", "wait_for_lanes", "after_lanes"}
            assert min(row.values()) >= 0 and row["queue_and_host_work"] >= 0.05
            assert sum(row.values()) <= wall
        phases = opt.dostune_step_phases
        assert phases["queue_and_host_work"] >= 50.0 and set(phases) == set(opt._dos.clock.phases[0])
    finally:
        engine.destroy()


@pytest.mark.slow
def test_gil_switch_interval_is_short_only_while_the_cpu_lane_works():
    import sys

    from dostune.optim.overlap import LANE_SWITCH_INTERVAL_S
    from dostune.models.registry import loss_of
    from parity_helpers import SEQ

    before = sys.getswitchinterval()
    assert before > LANE_SWITCH_INTERVAL_S
    spec, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap"])
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(2):
            engine.backward(loss_of(engine(**spec.batch(2, SEQ, gen, engine.device))))
            assert sys.getswitchinterval() == LANE_SWITCH_INTERVAL_S  # the CPU lane took subgroups in backward
            engine.step()
            assert sys.getswitchinterval() == before
    finally:
        engine.destroy()
    assert sys.getswitchinterval() == before


def test_gpu_lane_gradients_skip_the_host_copy_in_bf16():
    # In bf16 nothing reads the pinned host copy of a GPU-lane subgroup's gradients (only fp16's overflow check
    # would): backward leaves those slices of DeepSpeed's buffer alone and fills the CPU lane's.
    from dostune.models.registry import loss_of
    from parity_helpers import SEQ

    spec, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap"])
    opt = engine.optimizer
    gen = torch.Generator().manual_seed(1)
    try:
        buf = opt.grad_partitions_flat_buffer
        buf.fill_(7.0)
        engine.backward(loss_of(engine(**spec.batch(2, SEQ, gen, engine.device))))
        gpu_set = set(opt.dostune_plan.gpu_subgroups)
        assert gpu_set and set(opt.dostune_plan.cpu_order)
        for i, (start, n) in opt._dos.grads.slices.items():
            untouched = bool((buf.narrow(0, start, n) == 7.0).all())
            assert untouched == (i in gpu_set), f"subgroup {i}"
        engine.step()
    finally:
        engine.destroy()


def test_cpu_lane_subgroups_hold_no_fp32_gradient_buffer():
    """With the CPU lane in backward, its subgroups' gradients stay in DeepSpeed's half-precision buffer: their fp32
    host buffers are freed at start-up (a zero-stride view of one zero is left, which refuses writes), a gradient
    setter is refused with the reason, and training runs (parity: test_matches_deepspeed)."""
    from deepspeed.utils import safe_set_full_grad

    from dostune.errors import ConfigError
    from dostune.models.registry import loss_of
    from dostune.optim.schedule import host_half_gradients
    from parity_helpers import SEQ

    spec, engine = tiny_engine(base_settings(precision="bf16"), SCHEDULES["overlap"])
    opt = engine.optimizer
    gen = torch.Generator().manual_seed(1)
    try:
        released = opt._dos.grads.released
        assert released and released == host_half_gradients(len(opt.fp16_groups), opt._dos.schedule)
        assert released == set(opt.dostune_plan.cpu_order)
        for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
            assert (fp32.grad.stride() == (0,)) == (i in released), f"subgroup {i}"
        param = next(p for p in engine.module.parameters() if opt.grad_position[opt.get_param_id(p)][0] in released)
        with pytest.raises(ConfigError, match="cannot be changed between backward and step"):
            safe_set_full_grad(param, torch.zeros(param.ds_shape))
        for _ in range(2):
            engine.backward(loss_of(engine(**spec.batch(2, SEQ, gen, engine.device))))
            engine.step()
    finally:
        engine.destroy()


def _grads_after_backward(schedule, edit=None):
    """(full grads, local grads, master weights after the step) of the second step; ``edit(engine)`` runs between
    that step's backward and its step."""
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad

    from dostune.models.registry import loss_of
    from dostune.train.engine import master_weights
    from parity_helpers import SEQ

    spec, engine = tiny_engine(base_settings(precision="bf16"), schedule)
    gen = torch.Generator().manual_seed(1)
    try:
        for k in range(2):
            engine.backward(loss_of(engine(**spec.batch(2, SEQ, gen, engine.device))))
            if k == 1:
                params = list(engine.module.parameters())
                full = [safe_get_full_grad(p).clone() for p in params]
                local = [safe_get_local_grad(p).clone() for p in params]
                if edit is not None:
                    edit(engine)
            engine.step()
        return full, local, master_weights(engine)
    finally:
        engine.destroy()


def _subgroup_of(engine, p) -> int:
    opt = engine.optimizer
    return opt.grad_position[opt.get_param_id(p)][0]


def test_deepspeed_gradient_accessors_read_where_dostune_keeps_gradients():
    # safe_get_full_grad / safe_get_local_grad read DeepSpeed's fp32 gradient buffers, which dostune leaves unfilled
    # for GPU-lane subgroups and for CPU-lane ones updated during backward: they must still return DeepSpeed's values.
    ref_full, ref_local, _ = _grads_after_backward(None)
    for name in ("first-60pct", "overlap"):
        full, local, _ = _grads_after_backward(SCHEDULES[name])
        assert all(torch.equal(a, b) for a, b in zip(ref_full, full)), name
        assert all(torch.equal(a, b) for a, b in zip(ref_local, local)), name


def test_setting_a_gradient_reaches_the_gpu_lane_and_is_refused_once_its_update_started():
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    from dostune.errors import ConfigError

    def double_first(engine):  # parameter 0 (the embedding) lies in subgroup 0: on the GPU lane in first-60pct
        p = next(engine.module.parameters())
        if hasattr(engine.optimizer, "_dos"):
            assert _subgroup_of(engine, p) in engine.optimizer.dostune_plan.gpu_subgroups
        safe_set_full_grad(p, safe_get_full_grad(p) * 2)

    _, _, ref = _grads_after_backward(None, double_first)
    _, _, ours = _grads_after_backward(SCHEDULES["first-60pct"], double_first)
    _, _, plain = _grads_after_backward(SCHEDULES["first-60pct"])
    assert torch.equal(ref, ours) and not torch.equal(ours, plain)

    def set_cpu_lane(engine):
        p = next(p for p in engine.module.parameters()
                 if _subgroup_of(engine, p) not in engine.optimizer.dostune_plan.gpu_subgroups)
        with pytest.raises(ConfigError, match="overlap_backward"):
            safe_set_full_grad(p, safe_get_full_grad(p))

    _grads_after_backward(SCHEDULES["overlap"], set_cpu_lane)


class ScriptedLanes:
    """Stands in for adaptive_swing's measurement of each step's lane ends (a CPU device measures none), through the
    seam cpu_lane.CpuLaneSeams.wrap_lane_times: each step's LaneTimes are ``times_of(step, plan)``. Keeps what each
    step ran: its plan, and the subgroups its trace shows the CPU lane and the GPU lane updating."""

    def __init__(self, times_of):
        self.times_of = times_of
        self.steps: list[tuple] = []  # (plan, subgroups the CPU lane updated, subgroups the GPU lane updated)

    def wrap(self, measured):
        def lane_times(trace, plan):
            lanes = ({i for lane, i, *_ in trace if lane == name} for name in ("cpu", "gpu"))
            self.steps.append((plan, *lanes))
            return self.times_of(len(self.steps) - 1, plan)
        return lane_times

    def seams(self, partial_norm_cutoff: bool = True) -> CpuLaneSeams:
        return CpuLaneSeams(partial_norm_cutoff=partial_norm_cutoff, wrap_lane_times=self.wrap)

    def swings(self, base_cpu_lane: int) -> list[int]:
        """The swing each step ran, from its plan (``base_cpu_lane``: the CPU lane's size at swing 0)."""
        return [len(plan.cpu_order) - base_cpu_lane if not plan.lent else -len(plan.lent) for plan, _, _ in self.steps]

    def check_lanes(self) -> None:
        """Every step's lanes updated exactly its plan's subgroups: none lent to the GPU lane was updated (or
        speculated on during backward) by the CPU lane."""
        for k, (plan, cpu, gpu) in enumerate(self.steps):
            assert cpu == set(plan.cpu_order) and gpu == set(plan.gpu_subgroups), k
            assert not cpu & set(plan.lent), k


def check_bitwise(ours, ref) -> None:
    check(ours, ref)
    assert ours["losses"] == ref["losses"]
    assert torch.equal(ours["weights"], ref["weights"])  # on the CPU the lanes are DeepSpeed's arithmetic exactly


# GPU lane 0-1 (streamed), CPU lane 2-4: the CPU lane may take 1 and 0, the GPU lane 2 and 3
BOTH_WAYS = dict(gpu_fraction=0.4, gpu_placement="first", staging_buffers=2, adaptive_swing=2)
SLOW_STEPS = 8  # the host that makes the CPU lane end last runs the first 8 steps, then the GPU lane ends last


def slow_then_fast_host(step: int, plan) -> LaneTimes:
    """First clipping (speculation stopped, so the CPU lane carries each of its subgroups in the step, 40 ms each,
    the GPU lane 10 ms a subgroup); then the CPU lane's own subgroups end during backward, only those moved over
    from the GPU lane running in the step (14 ms each), while the GPU lane takes 30 ms a subgroup."""
    streamed = len(plan.gpu_slots)
    if step < SLOW_STEPS:
        return LaneTimes(cpu_end=0.040 * len(plan.cpu_order), gpu_end=0.010 * streamed, cpu_sub=0.040, gpu_sub=0.010)
    moved_over = len([i for i in plan.cpu_order if i < 2])
    return LaneTimes(cpu_end=0.014 * moved_over if moved_over else -0.010, gpu_end=0.030 * streamed,
                     cpu_sub=0.014, gpu_sub=0.030)


def both_ways_case(overlap: bool, steps: int = 20, exact: bool = True, **run_kw) -> None:
    """The both-way balance moves CPU-lane subgroups to the GPU lane while the CPU lane ends last, and subgroups to
    the CPU lane once the GPU lane does; the losses and weights stay DeepSpeed's (``exact``: bit for bit)."""
    train = base_settings(precision="bf16")  # clips every step
    sched = ScheduleConfig(overlap_backward=overlap, **BOTH_WAYS)
    script = ScriptedLanes(slow_then_fast_host)
    holder = []
    # without the partial-norm cutoff every subgroup of the CPU lane speculates during backward (and is recomputed
    # at the step): so that one lent to the GPU lane would be seen if the CPU lane touched it
    ours = run(train, sched, steps=steps, adjust=holder.append, seams=script.seams(partial_norm_cutoff=False),
               **run_kw)
    (check_bitwise if exact else check)(ours, reference(train, steps=steps))
    swings = script.swings(base_cpu_lane=3)
    # the first decision (a window of 3 steps) takes both the GPU lane may (the lanes then end together, at 40 ms);
    # once the fast host's steps are the window's median (2 steps after the change) both go back, then one of the
    # GPU lane's moves over, and the swing settles 5 steps after the change
    assert swings == [0] * 3 + [-2] * (SLOW_STEPS - 3 + 2) + [0] * 3 + [1] * (steps - SLOW_STEPS - 5)
    assert holder[0].dostune_swing_stats == {"steps_by_swing": {-2: 7, 0: 6, 1: steps - 13}, "swing": 1}
    assert holder[0].dostune_swing == 1  # what dostune train records for the next step
    script.check_lanes()
    assert {tuple(plan.lent) for plan, _, _ in script.steps} == {(), (2, 3)}
    if overlap:  # speculated on (recomputed, and committed) only the subgroups each step's CPU lane had
        st = ours["overlap"]
        assert st["speculative"] == st["redone"] == st["committed"] == sum(len(p.cpu_order) for p, _, _ in script.steps)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_lane_balance_moves_subgroups_both_ways_and_changes_nothing(overlap):
    both_ways_case(overlap)


def jumping_host(base_cpu_lane: int):
    """Lane times in which whichever lane has the subgroups moved over ends far last (``base_cpu_lane``: the CPU
    lane's size at swing 0), so that every decision moves the whole swing range."""
    def times_of(step: int, plan) -> LaneTimes:
        if len(plan.cpu_order) > base_cpu_lane:  # the CPU lane took GPU-lane subgroups
            return LaneTimes(cpu_end=1.0, gpu_end=0.010, cpu_sub=0.010, gpu_sub=0.010)
        return LaneTimes(cpu_end=-0.010, gpu_end=1.0, cpu_sub=0.010, gpu_sub=0.010)
    return times_of


@pytest.mark.slow
@pytest.mark.parametrize("overlap,grad_accum", [(True, 1), (False, 2)])
def test_subgroups_jumping_between_lanes_change_nothing(overlap, grad_accum):
    """adaptive_swing re-plans between steps, several subgroups at once either way (here from all three streamed
    GPU-lane subgroups on the CPU lane to the CPU lane's one on the GPU lane); whichever lane updates a subgroup,
    the values are DeepSpeed's."""
    train = base_settings(precision="bf16", grad_accum=grad_accum)
    # GPU lane 0-3, 0 resident; 3, 2, 1 may move
    sched = ScheduleConfig(gpu_fraction=0.8, gpu_placement="first", overlap_backward=overlap, resident_subgroups=1,
                           staging_buffers=2, adaptive_swing=3, expected_subgroups=5)  # and 4 may come
    script = ScriptedLanes(jumping_host(base_cpu_lane=1))
    opts = []

    def adjust(opt):
        if overlap:
            for i in (3, 2, 1):  # their shadows exist before any step moves them (not allocated mid-step)
                assert opt._dos.cpu.worker.shadow(i).p.numel() == opt.fp16_partitioned_groups_flat_numel[i]
        opts.append(opt)

    ours = run(train, sched, steps=20, adjust=adjust, seams=script.seams(partial_norm_cutoff=False))
    check_bitwise(ours, reference(train, steps=20))
    assert script.swings(base_cpu_lane=1) == [0] * 3 + ([3] * 3 + [-1] * 3) * 2 + [3] * 3 + [-1] * 2
    assert opts[0].dostune_swing_stats["steps_by_swing"] == {-1: 8, 0: 3, 3: 9} and opts[0].dostune_swing == -1
    script.check_lanes()
    if overlap:  # the moved subgroups were updated during backward too, and committed
        assert ours["overlap"]["committed"] == sum(len(plan.cpu_order) for plan, _, _ in script.steps)
        # the worker's own list (it updates in the step those no gradient reached in backward) follows the plan
        assert opts[0]._dos.cpu.worker.subgroups == opts[0]._dos.plan.cpu_order == []


@pytest.mark.slow
def test_no_swing_allocates_more_gpu_memory_than_the_schedule_allows():
    """What the step holds on the GPU lane's device at each swing (its staging slots, with room for a lent
    subgroup's gradients, and the gradients kept for its own), measured on the lanes' tensors while the CPU lane
    runs, is what footprint counts for that split, and never above the allowance start-up checked
    (footprint.gpu_step_bytes: the most over the swing range)."""
    from dostune.optim.footprint import gpu_step_bytes, plan_step_bytes
    from dostune.optim.schedule import make_plan

    sched = ScheduleConfig(upload="cpu_convert", **BOTH_WAYS)  # the CPU device uploads without a device buffer
    held: list[int] = []

    def watch(update):
        def watched(opt, host, i, inv, trace):
            dos = opt._dos
            held.append(dos.streamed.staged_bytes + sum(4 * t.numel() for t in dos.grads.device.values()))
            return update(opt, host, i, inv, trace)
        return watched

    script = ScriptedLanes(jumping_host(base_cpu_lane=3))  # swing 0, then 2, -2 (3 steps each)
    seams = CpuLaneSeams(wrap_update=watch, wrap_lane_times=script.wrap)
    opts = []
    run(base_settings(precision="bf16"), sched, steps=9, adjust=opts.append, seams=seams)
    assert script.swings(base_cpu_lane=3) == [0] * 3 + [2] * 3 + [-2] * 3
    sizes = [int(n) for n in opts[0].fp16_partitioned_groups_flat_numel]
    allowance = gpu_step_bytes(sizes, make_plan(len(sizes), sched), sched)
    per_update = iter(held)
    for plan, cpu, _ in script.steps:  # one sample per CPU-lane update: all of a step's are the same
        samples = {next(per_update) for _ in cpu}
        assert samples == {plan_step_bytes(sizes, plan, sched, cpu_in_backward=False)}, plan
        assert samples.pop() <= allowance
    assert next(per_update, None) is None
    # the allowance is that of the swing needing the most: here -2, whose slots hold the lent subgroups' gradients
    assert allowance == plan_step_bytes(sizes, script.steps[-1][0], sched, cpu_in_backward=False) > \
        plan_step_bytes(sizes, script.steps[0][0], sched, cpu_in_backward=False)
