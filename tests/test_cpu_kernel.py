"""dostune's out-of-place CPU Adam against DeepSpeed's in-place CPU Adam, bit for bit."""
import pytest
import torch

from dostune.optim import cpu_kernel
from dostune.optim.kernels import AdamScalarShadow, _next_opt_id, load_cpu_adam_op


@pytest.fixture(scope="module")
def ds_op():
    return load_cpu_adam_op()


@pytest.mark.parametrize("n", [5, 16 * 4096, 1_000_003])
@pytest.mark.parametrize("adamw,wd,bias_correction", [(True, 0.1, True), (False, 0.01, True), (True, 0.0, False)])
# streaming stores: into aligned outputs (the vector path), and into outputs one element off alignment (the fallback)
@pytest.mark.parametrize("offset", [0, 1])
def test_matches_deepspeed_bitwise(ds_op, n, adamw, wd, bias_correction, offset):
    lr, b1, b2, eps = 3e-4, 0.9, 0.999, 1e-8
    opt_id = _next_opt_id()
    ds_op.create_adam(opt_id, lr, b1, b2, eps, wd, adamw, False)
    shadow = AdamScalarShadow(b1, b2)
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    ours = [t.clone() for t in (p, m, v)]
    try:
        for step, inv in ((1, 1.0), (2, 0.37), (3, 1.0)):  # consecutive steps: the running beta powers
            g = torch.randn(n, generator=gen)
            shadow.increment(step, b1, b2)
            s = shadow.scalars(lr, eps, wd, bias_correction, adamw)
            out = [torch.empty(n + offset)[offset:] for _ in range(3)]
            half = torch.empty(n + offset, dtype=torch.bfloat16)[offset:]
            cpu_kernel.adam_out_of_place(*ours[:1], g, *ours[1:], *out, s, inv_scale=inv, half_out=half)
            before = [t.clone() for t in ours]
            g_ds = g.clone().mul_(inv)  # DeepSpeed's unscale_and_clip_grads, then its kernel in place
            ds_op.adam_update(opt_id, step, lr, b1, b2, eps, wd, bias_correction, p, g_ds, m, v)
            for name, a, b in zip("pmv", out, (p, m, v)):
                assert torch.equal(a, b), f"step {step}: {name} differs in {(a != b).sum()} of {n} elements"
            assert torch.equal(half, p.to(torch.bfloat16))
            assert all(torch.equal(a, b) for a, b in zip(ours, before)), "inputs must stay untouched"
            ours = out
    finally:
        ds_op.destroy_adam(opt_id)


@pytest.mark.parametrize("n", [5, 1_000_003])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_in_place_equals_deepspeed_in_place(ds_op, n, grad_dtype):
    """The outputs may be the inputs (the CPU lane's subgroups that never speculate are updated so): the same bits as
    DeepSpeed's in-place update, over the threads' blocks and the scalar tail."""
    lr, b1, b2, eps, wd = 3e-4, 0.9, 0.95, 1e-8, 0.01
    opt_id = _next_opt_id()
    ds_op.create_adam(opt_id, lr, b1, b2, eps, wd, True, False)
    shadow = AdamScalarShadow(b1, b2)
    gen = torch.Generator().manual_seed(n)
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    ours = [t.clone() for t in (p, m, v)]
    try:
        for step, inv in ((1, 1.0), (2, 0.37)):
            g = torch.randn(n, generator=gen).to(grad_dtype)
            shadow.increment(step, b1, b2)
            half = torch.empty(n, dtype=torch.bfloat16)
            cpu_kernel.adam_out_of_place(ours[0], g, ours[1], ours[2], *ours, shadow.scalars(lr, eps, wd, True, True),
                                         inv_scale=inv, half_out=half, threads=2)
            ds_op.adam_update(opt_id, step, lr, b1, b2, eps, wd, True, p, g.float().mul_(inv), m, v)
            for name, a, b in zip("pmv", ours, (p, m, v)):
                assert torch.equal(a, b), f"step {step}: {name} differs in {(a != b).sum()} of {n} elements"
            assert torch.equal(half, p.to(torch.bfloat16))
    finally:
        ds_op.destroy_adam(opt_id)


def test_fp16_output_and_nan_rounding():
    n = 37
    s = AdamScalarShadow(0.9, 0.999)
    s.increment(1, 0.9, 0.999)
    sc = s.scalars(1e-3, 1e-8, 0.0, True, True)
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    g[3] = float("nan")
    out = [torch.empty(n) for _ in range(3)]
    for dtype in (torch.float16, torch.bfloat16):
        half = torch.empty(n, dtype=dtype)
        cpu_kernel.adam_out_of_place(p, g, m, v, *out, sc, half_out=half)
        ref = out[0].to(dtype)
        assert torch.equal(half.isnan(), ref.isnan()) and bool(half.isnan()[3])
        assert torch.equal(half[~half.isnan()], ref[~ref.isnan()])


def test_rejects_mismatched_buffers():
    shadow = AdamScalarShadow(0.9, 0.999)
    shadow.increment(1, 0.9, 0.999)
    s = shadow.scalars(1e-3, 1e-8, 0.0, True, True)
    t = torch.zeros(8)
    with pytest.raises(ValueError, match="m_out"):
        cpu_kernel.adam_out_of_place(t, t, t, t, torch.zeros(8), torch.zeros(7), torch.zeros(8), s)
    with pytest.raises(ValueError, match="half_out"):
        cpu_kernel.adam_out_of_place(t, t, t, t, t.clone(), t.clone(), t.clone(), s, half_out=torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [5, 1_000_003])
def test_half_precision_gradients_equal_their_fp32_widening(dtype, n):
    """A bf16/fp16 gradient read directly gives the same update as DeepSpeed's fp32 copy of it (``.to(fp32)``),
    including inf and nan (an overflow step)."""
    shadow = AdamScalarShadow(0.9, 0.95)
    shadow.increment(1, 0.9, 0.95)
    s = shadow.scalars(1e-3, 1e-8, 0.1, True, True)
    gen = torch.Generator().manual_seed(n)
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    g = (torch.randn(n, generator=gen) * 3).to(dtype)
    g[1], g[2] = float("inf"), float("nan")
    ref, ours = [torch.empty(n) for _ in range(3)], [torch.empty(n) for _ in range(3)]
    cpu_kernel.adam_out_of_place(p, g.float(), m, v, *ref, s, inv_scale=0.25)
    cpu_kernel.adam_out_of_place(p, g, m, v, *ours, s, inv_scale=0.25)
    for a, b in zip(ours, ref):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
