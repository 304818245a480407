"""GPU-only checks (marked gpu; on a GPU machine run them with scripts/gpu-tests.sh)."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _ds_reference(p, g, m, v, steps, lr, wd, adamw, bias_correction, inv_scale):
    from dostune.optim.kernels import load_cpu_adam_op

    op = load_cpu_adam_op()
    op.create_adam(424242, lr, 0.9, 0.95, 1e-8, wd, adamw, False)
    try:
        for t in range(1, steps + 1):
            gt = g.clone()
            gt.mul_(inv_scale)
            op.adam_update(424242, t, lr, 0.9, 0.95, 1e-8, wd, bias_correction, p, gt, m, v)
    finally:
        op.destroy_adam(424242)


def _mismatches(sqrt_in_double, adamw, wd, bias_correction, inv_scale, n=1_000_003, steps=6):
    from dostune.optim.kernels import AdamScalarShadow, triton_adam_

    gen = torch.Generator().manual_seed(1)
    p = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=gen)]
    g = torch.randn(n, generator=gen) * 1e-2
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-5
    ref = [t.clone() for t in (p, g, m, v)]
    _ds_reference(ref[0], ref[1], ref[2], ref[3], steps, 1e-3, wd, adamw, bias_correction, inv_scale)
    dp, dg, dm, dv = (t.cuda() for t in (p, g, m, v))
    half = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    AdamScalarShadow.SQRT_IN_DOUBLE, saved = sqrt_in_double, AdamScalarShadow.SQRT_IN_DOUBLE
    try:
        shadow = AdamScalarShadow(0.9, 0.95)
        for t in range(1, steps + 1):
            shadow.increment(t, 0.9, 0.95)
            s = shadow.scalars(1e-3, 1e-8, wd, bias_correction, adamw)
            g_t = dg.clone()
            triton_adam_(dp, g_t, dm, dv, half, inv_scale, s)
    finally:
        AdamScalarShadow.SQRT_IN_DOUBLE = saved
    torch.cuda.synchronize()
    assert torch.equal(half.cpu(), dp.cpu().to(torch.bfloat16))
    return {k: int((a.cpu() != b).sum()) for k, a, b in (("p", dp, ref[0]), ("m", dm, ref[2]), ("v", dv, ref[3]))}


@pytest.mark.parametrize("adamw,wd", [(True, 0.01), (False, 0.05), (True, 0.0)])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_triton_adam_is_bitwise_deepspeed_cpu_adam(adamw, wd, bias_correction):
    from dostune.optim.kernels import AdamScalarShadow

    inv = float(np.float32(1 / 3.7))
    configured = _mismatches(AdamScalarShadow.SQRT_IN_DOUBLE, adamw, wd, bias_correction, inv)
    other = _mismatches(not AdamScalarShadow.SQRT_IN_DOUBLE, adamw, wd, bias_correction, inv)
    print(f"mismatches: configured sqrt_in_double={AdamScalarShadow.SQRT_IN_DOUBLE}: {configured}; other: {other}")
    assert configured == {"p": 0, "m": 0, "v": 0}


def test_pinned_state_after_adopt():
    from dostune.optim.schedule import ScheduleConfig
    from parity_helpers import MODEL, SUB_GROUP_SIZE, base_settings
    from dostune.dsconfig import OffloadSettings, deepspeed_config
    from dostune.models.registry import resolve_model
    from dostune.train.engine import build_engine

    cfg = deepspeed_config(base_settings(), OffloadSettings(sub_group_size=SUB_GROUP_SIZE, pin_memory=True,
                                                            schedule=ScheduleConfig(gpu_fraction=0.5)))
    engine = build_engine(resolve_model(MODEL), cfg)
    opt = engine.optimizer
    for fp32 in opt.fp32_partitioned_groups_flat:
        st = opt.optimizer.state[fp32]
        assert fp32.data.is_pinned() and fp32.grad.is_pinned()
        assert st["exp_avg"].is_pinned() and st["exp_avg_sq"].is_pinned()
    engine.destroy()


def test_resident_state_lives_on_the_gpu_only():
    """The emitted config's offload ratio makes DeepSpeed build the resident subgroups' fp32 params and gradients on
    the GPU (its Twin-Flow placement) and dostune creates their Adam states beside them: no host copy of any; the
    other subgroups' state stays in host memory, page-locked."""
    from dostune.dsconfig import OffloadSettings, deepspeed_config
    from dostune.models.registry import resolve_model
    from dostune.optim.schedule import ScheduleConfig
    from dostune.train.engine import build_engine, train_steps
    from parity_helpers import MODEL, SEQ, SUB_GROUP_SIZE, base_settings

    sched = ScheduleConfig(gpu_fraction=0.6, resident_subgroups=2, expected_subgroups=5)  # 0-1 resident, 2 streamed
    cfg = deepspeed_config(base_settings(), OffloadSettings(sub_group_size=SUB_GROUP_SIZE, pin_memory=True,
                                                            schedule=sched))
    spec = resolve_model(MODEL)
    engine = build_engine(spec, cfg)
    opt = engine.optimizer
    try:
        train_steps(engine, spec, 2, seq=SEQ)
        for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
            st = opt.optimizer.state[fp32]
            tensors = (fp32.data, fp32.grad, st["exp_avg"], st["exp_avg_sq"])
            if i < 2:
                assert opt.subgroup_to_device[i] != "cpu" and all(t.is_cuda for t in tensors), i
            else:
                assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors), i
    finally:
        engine.destroy()


@pytest.mark.slow
def test_resident_checkpoint_round_trip_through_plain_deepspeed_gpt2_1_3b(tmp_path):
    """gpt2-1.3b with resident subgroups: dostune -> plain DeepSpeed ZeRO-Offload -> dostune trains the uninterrupted
    run (losses equal) and ends in the same fp32 params and Adam states, bit for bit: the checkpoints written from the
    GPU are DeepSpeed's own and load both ways. Each checkpoint is about 18 GB: only the latest of a folder is kept."""
    import hashlib
    import json
    import shutil

    from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
    from dostune.models.registry import resolve_model
    from dostune.optim.schedule import ScheduleConfig
    from dostune.train.loop import TrainOptions, train
    from dostune.tune.refit import model_subgroups
    from test_train import _optimizer_state

    spec, sgs = resolve_model("gpt2-1.3b"), 100_000_000
    n = model_subgroups(spec, sgs)
    sched = ScheduleConfig(gpu_fraction=0.3, resident_subgroups=2, overlap_backward=True, expected_subgroups=n)
    cfg = deepspeed_config(TrainSettings(micro_batch=2, lr=1e-4, betas=(0.9, 0.999)),
                           OffloadSettings(sub_group_size=sgs, pin_memory=False, schedule=sched))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))

    def run(folder, steps, **kw):
        out = train(TrainOptions(config=path, model=spec.name, steps=steps, seq=256, save_dir=folder, **kw))
        latest = (folder / "latest").read_text().strip()
        for old in folder.iterdir():
            if old.is_dir() and old.name != latest:
                shutil.rmtree(old)
        return out

    def digests(folder):
        return {k: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for k, t in _optimizer_state(folder).items()}

    full = run(tmp_path / "full", 8)
    ref = digests(tmp_path / "full")
    shutil.rmtree(tmp_path / "full")
    legs = [run(tmp_path / "ckpt", 4), run(tmp_path / "ckpt", 6, resume=True, plain_deepspeed=True),
            run(tmp_path / "ckpt", 8, resume=True)]
    assert [leg.optimizer for leg in legs] == ["InterleavedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
                                                "InterleavedZeroOptimizer"]
    assert sum((leg.losses for leg in legs), []) == full.losses
    ours = digests(tmp_path / "ckpt")
    assert ours.keys() == ref.keys() and len(ours) > 3
    assert [k for k in ours if ours[k] != ref[k]] == []
