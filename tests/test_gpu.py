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
