"""The Adam kernels of the two lanes, and the loader for DeepSpeed's CPU Adam.

GPU lane: torch's fused multi-tensor Adam(W) (``torch._fused_adam_`` / ``torch._fused_adamw_``). It
reads and writes each tensor once, handles the unscale/clip factor through ``grad_scale`` and has
a CPU implementation too, so the GPU lane runs unchanged on a CPU device in tests.

CPU lane: DeepSpeedCPUAdam's C++ kernel, the one DeepSpeed's own offload path uses.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

_cpu_adam_lock = threading.Lock()


def fused_adam_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], step: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, adamw_mode: bool, bias_correction: bool = True,
                grad_scale: Optional[torch.Tensor] = None) -> None:
    """One Adam(W) step in place. ``step`` is a 0-d float tensor on the params' device that already
    holds the new step number (the kernels read it, they do not increment it). ``grad_scale``, when
    given, divides the gradients inside the kernel (loss scale times clip factor).

    Without bias correction (a DeepSpeed option) the kernel is driven with step = +inf so that
    1 - beta**step == 1 exactly.
    """
    fn = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    steps = [step if bias_correction else torch.full_like(step, float("inf"))] * len(params)
    fn(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
       weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None)


def load_cpu_adam_op():
    """Build (first use: about a minute, just in time) and load DeepSpeed's CPU Adam extension."""
    with _cpu_adam_lock:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        return CPUAdamBuilder().load(verbose=False)
