"""The GPU lane's Adam kernel, bit-identical to DeepSpeed's CPU Adam.

Parity with DeepSpeed has to be exact, not approximate: a last-bit difference in an fp32 master weight
flips the rounding of its bf16 copy now and then, which changes the next forward pass, and training runs
apart within a few steps. So the GPU lane repeats DeepSpeedCPUAdam's arithmetic operation for operation
(``csrc/includes/cpu_adam.h``, ``Step_AVX``: the same multiplies, the same fused multiply-adds, a
correctly rounded square root and division) with the scalars computed on the host the way DeepSpeed's
C++ ``Adam_Optimizer`` computes them in float (``IncrementStep`` / ``update_state``).

DeepSpeed's SIMD loop (AVX512/AVX2) covers all but the last ``numel % SIMD_WIDTH`` elements of each
call; those go through a scalar loop that the compiler contracts differently (``m = fma(m, beta1,
g * (1 - beta1))`` instead of ``fma(g, 1 - beta1, m * beta1)``, likewise for the variance). The kernel
reproduces both, switching at the same index. Measured on an H100 VM (16 vCPUs): zero mismatching elements.

On a CUDA device the kernel is written in Triton (FMA contraction off, explicit ``fma``, ``div_rn``,
``sqrt_rn``); it also applies the unscale/clip factor first, exactly as DeepSpeed's separate
``grad.mul_(1/scale)`` does, and writes the half-precision partition from the new fp32 params in the same
pass. On a CPU device (tests) the lane calls DeepSpeed's own C++ kernel through its own optimizer id.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

_f32 = np.float32
_build_lock = threading.Lock()


def load_cpu_adam_op():
    """DeepSpeed's CPU Adam extension, from the environment's ops folder (dostune/ops.py: built there once)."""
    with _build_lock:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        from ..ops import load_deepspeed_op

        load_deepspeed_op("CPUAdamBuilder")
        return CPUAdamBuilder().load(verbose=False)


@dataclass(frozen=True)
class AdamScalars:
    """Per-step float32 constants of DeepSpeed's Adam_Optimizer::Step_AVX."""

    beta1: float
    beta2: float
    beta1_minus1: float  # 1 - beta1
    beta2_minus1: float
    bias_correction2: float  # 1 / sqrt(1 - beta2^t)
    eps: float
    step_size: float  # -lr / (1 - beta1^t)
    decay: float  # adamw: -lr * weight_decay; adam (L2): weight_decay
    has_decay: bool
    adamw: bool


class AdamScalarShadow:
    """Mirrors the float state of one DeepSpeed C++ ``Adam_Optimizer`` (beta powers and step), so that the
    GPU lane can use exactly the constants DeepSpeed would use for the same call sequence."""

    # Whether 1/sqrt(1 - beta2^t) is evaluated in double (C's sqrt) or float (std::sqrt(float)) in the
    # compiled extension. Float, as the bitwise GPU test against the real kernel showed on the H100 node.
    SQRT_IN_DOUBLE = False

    def __init__(self, beta1: float, beta2: float):
        self._b1, self._b2 = _f32(beta1), _f32(beta2)
        self._b1t, self._b2t = _f32(1.0), _f32(1.0)
        self._step = 0

    def increment(self, step: int, beta1: float, beta2: float) -> None:
        b1, b2 = _f32(beta1), _f32(beta2)
        if b1 != self._b1 or b2 != self._b2:
            self._step, self._b1, self._b2 = step, b1, b2
            self._b1t, self._b2t = _f32(math.pow(float(b1), step)), _f32(math.pow(float(b2), step))
        elif step == self._step + 1:
            self._step += 1
            self._b1t = _f32(self._b1t * self._b1)
            self._b2t = _f32(self._b2t * self._b2)
        elif step != self._step:
            self._b1t, self._b2t = _f32(math.pow(float(b1), step)), _f32(math.pow(float(b2), step))
            self._step = step

    def scalars(self, lr: float, eps: float, weight_decay: float, bias_correction: bool, adamw: bool) -> AdamScalars:
        one = _f32(1.0)
        lr, eps, wd = _f32(lr), _f32(eps), _f32(weight_decay)
        if bias_correction:
            bc1 = _f32(one - self._b1t)
            if self.SQRT_IN_DOUBLE:
                bc2 = _f32(1.0 / math.sqrt(float(_f32(one - self._b2t))))
            else:
                bc2 = _f32(one / np.sqrt(_f32(one - self._b2t)))
        else:
            bc1, bc2 = one, one
        step_size = _f32(_f32(-lr) / bc1)
        decay = _f32(_f32(-lr) * wd) if adamw else wd
        return AdamScalars(beta1=float(self._b1), beta2=float(self._b2), beta1_minus1=float(_f32(one - self._b1)),
                           beta2_minus1=float(_f32(one - self._b2)), bias_correction2=float(bc2), eps=float(eps),
                           step_size=float(step_size), decay=float(decay), has_decay=bool(wd > 0), adamw=adamw)


_triton_kernel = None


def _get_triton_kernel():
    global _triton_kernel
    if _triton_kernel is not None:
        return _triton_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def ds_adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, h_ptr, n, tail_start, inv_scale, beta1, beta2, b1m1, b2m1,
                       bc2, eps, step_size, decay, HAS_DECAY: tl.constexpr, ADAMW: tl.constexpr,
                       WRITE_HALF: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tail = offs >= tail_start  # DeepSpeed's scalar remainder loop
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        g = g * inv_scale  # DeepSpeed's unscale_and_clip_grads: grad.mul_(1 / combined_scale)
        if HAS_DECAY and not ADAMW:
            g = tl.fma(p, decay, g)
        m = tl.where(tail, tl.fma(m, beta1, g * b1m1), tl.fma(g, b1m1, m * beta1))
        g = g * g
        v = tl.where(tail, tl.fma(v, beta2, g * b2m1), tl.fma(g, b2m1, v * beta2))
        d = tl.sqrt_rn(v)
        d = tl.fma(d, bc2, eps)
        u = tl.math.div_rn(m, d)
        if HAS_DECAY and ADAMW:
            p = tl.fma(p, decay, p)
        p = tl.fma(u, step_size, p)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if WRITE_HALF:
            tl.store(h_ptr + offs, p.to(h_ptr.dtype.element_ty), mask=mask)

    _triton_kernel = ds_adam_kernel
    return _triton_kernel


def triton_adam_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, half_out: Optional[torch.Tensor],
                 inv_scale: float, s: AdamScalars, block: int = 4096) -> None:
    """One DeepSpeed-exact Adam step in place on the current CUDA stream; optionally writes ``half_out``."""
    n = p.numel()
    if n == 0:
        return
    kernel = _get_triton_kernel()
    grid = (triton_cdiv(n, block),)
    width = cpu_adam_simd_width()
    tail_start = n - n % width if width else 0
    kernel[grid](p, g, m, v, half_out if half_out is not None else p, n, tail_start, float(np.float32(inv_scale)), s.beta1,
                 s.beta2, s.beta1_minus1, s.beta2_minus1, s.bias_correction2, s.eps, s.step_size, s.decay,
                 HAS_DECAY=s.has_decay, ADAMW=s.adamw, WRITE_HALF=half_out is not None, BLOCK=block,
                 num_warps=8, enable_fp_fusion=False)


_simd_width: Optional[int] = None


def cpu_adam_simd_width() -> int:
    """Elements per SIMD step of DeepSpeed's CPU Adam as built on this machine (0: scalar loop only)."""
    global _simd_width
    if _simd_width is None:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        flag = CPUAdamBuilder().simd_width()
        _simd_width = 16 if "AVX512" in flag else 8 if "AVX256" in flag else 0
    return _simd_width


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class LaneAdam:
    """The GPU lane's Adam, picked by the device (device.py ``lane_adam``): ``shadow`` mirrors the beta powers of
    DeepSpeed's C++ Adam so that the lane uses exactly its constants."""

    def __init__(self, beta1: float, beta2: float, adamw: bool):
        self.adamw = adamw
        self.shadow = AdamScalarShadow(beta1, beta2)

    def cpu_ops(self) -> list:
        """(C++ op, optimizer id) pairs this lane owns, for replaying the beta-power history."""
        return []

    def close(self) -> None:
        pass

    def update(self, p, g, m, v, half_out, inv_scale, step: int, group: dict, scalars: Optional[AdamScalars]) -> None:
        """One step of subgroup state (p, m, v) from gradients ``g`` unscaled by ``inv_scale``; writes ``half_out``
        from the new params when given. ``scalars``: :meth:`AdamScalarShadow.scalars` for this step."""
        raise NotImplementedError


class TritonAdam(LaneAdam):
    """On a CUDA device: the Triton kernel, on the current stream, from the shadow's constants."""

    def update(self, p, g, m, v, half_out, inv_scale, step: int, group: dict, scalars: Optional[AdamScalars]) -> None:
        triton_adam_(p, g, m, v, half_out, inv_scale, scalars)


class CpuOpAdam(LaneAdam):
    """On a CPU device: DeepSpeed's own C++ kernel, through an optimizer id of the lane's own (its beta powers
    advance with the lane's calls, apart from DeepSpeed's); ``scalars`` are unused."""

    def __init__(self, beta1: float, beta2: float, lr: float, eps: float, weight_decay: float, adamw: bool):
        super().__init__(beta1, beta2, adamw)
        self._op = load_cpu_adam_op()
        self._opt_id = _next_opt_id()
        self._op.create_adam(self._opt_id, lr, beta1, beta2, eps, weight_decay, adamw, False)

    def cpu_ops(self) -> list:
        return [] if self._op is None else [(self._op, self._opt_id)]

    def close(self) -> None:
        if self._op is not None:
            self._op.destroy_adam(self._opt_id)
            self._op = None

    def update(self, p, g, m, v, half_out, inv_scale, step: int, group: dict, scalars: Optional[AdamScalars]) -> None:
        g.mul_(inv_scale)
        beta1, beta2 = group["betas"]
        self._op.adam_update(self._opt_id, step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                             group["bias_correction"], p, g, m, v)
        if half_out is not None:
            half_out.copy_(p)


_opt_ids = iter(range(1_000_000, 2_000_000))


def _next_opt_id() -> int:
    # DeepSpeedCPUAdam numbers its C++ optimizers from 0; ours stay clear of them.
    return next(_opt_ids)
