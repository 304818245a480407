"""Gradient-norm bookkeeping: the per-parameter norms recorded in backward and replayed to DeepSpeed's exact global
norm at the step, and the running partial norm that tells the speculative CPU lane when clipping is certain.

Recording. DeepSpeed records ``((g.double().norm(2)) ** 2) ** 0.5`` per parameter with ``_constant_buffered_norm2``:
seven tensor operations on the host thread that paces backward (the profiled backward is host-bound). Only the norm
kernel's result is kept here (two operations); the square and the square root, both exactly rounded double
operations, are replayed on the host at the step, so the global norm is bit for bit DeepSpeed's. Python floats
replay double operations exactly (MPS-like devices without fp64 keep DeepSpeed's path), and DeepSpeed sums the norms
of 250M-element pieces of bigger partitions: both left to its code.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.comm import pg_utils
from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
from deepspeed.runtime.zero.utils import get_norm_dtype

if TYPE_CHECKING:
    from .device import Device

RAW_NORM_MAX_NUMEL = 250_000_000  # DeepSpeed norms bigger partitions piece by piece: its own code does it


def clipping_certain(partial_sq, loss_scale: float, clip: Optional[float]) -> bool:
    """Whether a partial sum of squared (scaled) gradient norms already makes clipping, or a skipped step, certain:
    the global norm can only be larger. The test DeepSpeed's clipping applies, on the partial norm."""
    norm = float(np.sqrt(float(partial_sq)))
    return not np.isfinite(norm) or (clip is not None and clip > 0 and norm / loss_scale + 1e-6 > clip)


class GradNorms:
    def __init__(self, opt, device: "Device"):
        self._opt, self._device = opt, device
        # Python floats replay fp64 operations only: devices without fp64 keep DeepSpeed's own recording
        self.record = self._record if get_norm_dtype() == torch.float64 else self._record_as_deepspeed
        # Parameter id -> the 2-norm of its gradient partition in DeepSpeed's norm dtype, as the norm kernel returns
        # it; what DeepSpeed would record in norm_for_param_grads follows from it exactly.
        self._raw: dict[int, torch.Tensor] = {}
        # The running norm only lets the lanes stop speculating early, once it makes clipping certain or is inf/nan
        # (an overflow: the step is skipped). Without clipping, that leaves overflows, which dynamic fp16 loss
        # scaling produces on purpose but bf16/fp32 gradients almost never do; there its upkeep (a stack, a
        # reduction, a pinned copy per subgroup: ~0.2 ms each on the host thread that paces backward, measured on
        # the H100) buys nothing, and a rare overflow still skips the step exactly, only after speculating.
        self.tracks_partial = float(opt.clip_grad) > 0 or opt.dtype == torch.float16
        self._partial = None  # this backward's running squared norm, on the device

    # ------------------------------------------------------------- in backward
    def _record_as_deepspeed(self, pid: int, grad: torch.Tensor) -> None:
        self._opt.norm_for_param_grads[pid] = self._opt._constant_buffered_norm2(grad)

    def _record(self, pid: int, grad: torch.Tensor) -> None:
        """Record parameter ``pid``'s gradient norm (``record``), as DeepSpeed's norm bookkeeping would."""
        if grad.numel() > RAW_NORM_MAX_NUMEL:
            self._record_as_deepspeed(pid, grad)
            return
        # Tensor.norm(2) is torch.functional.norm, Python that ends in torch.linalg.vector_norm(x, 2) for a strided
        # tensor: called directly here (the same kernel on the same input), without that Python on backward's path.
        flat = grad if grad.dim() == 1 else grad.reshape(-1)
        self._raw[pid] = torch.linalg.vector_norm(flat.to(torch.float64), 2)
        self._opt.norm_for_param_grads.pop(pid, None)

    def _tensor(self, pid: int):
        """(tensor, raw) for a parameter's recorded gradient norm, or None; a value DeepSpeed's own code recorded
        (e.g. set_local_grad_for_param after backward) takes precedence."""
        t = self._opt.norm_for_param_grads.get(pid)
        if t is not None:
            return t, False
        t = self._raw.get(pid)
        return (t, True) if t is not None else None

    def add_partial(self, pids: frozenset) -> tuple:
        """Add a finalised subgroup's squared gradient norms to the running sum, on the stream that made them;
        returns (host copy, event after which the copy and DeepSpeed's non-blocking gradient copies so far are
        done). Raw norms squared differ from DeepSpeed's in the last bit at most: a bound for the cutoff only."""
        sq = torch.stack([self._tensor(p)[0] for p in pids]).double().pow(2).sum()
        self._partial = sq if self._partial is None else self._partial + sq
        return self._device.copy_to_host(self._partial)

    def reset_partial(self) -> None:
        self._partial = None

    def clear(self) -> None:
        """DeepSpeed clears its recorded norms after the step (reset_cpu_buffers); the raw ones go with them."""
        self._raw.clear()

    # ------------------------------------------------------------- at the step
    def _reduction(self, params) -> tuple:
        """How DeepSpeed reduces one subgroup's squared gradient norm across ranks: (partition group, whether every
        rank counts its own partition, the AutoEP expert-parallel group or None)."""
        opt = self._opt
        opt._assert_same_partition_group(params)
        process_group = opt._get_param_partition_group(params[0])
        return process_group, opt._grad_norm_counts_every_rank(params, process_group), \
            opt._autoep_expert_parallel_group(params)

    def _squared_sums(self, groups: list, reductions: list) -> list[float]:
        """Each subgroup's sum of squared per-parameter gradient norms, as DeepSpeed's
        complete_grad_norm_calculation_for_cpu_offload adds them (in doubles, in parameter order), from one copy of
        all the recorded norms to the host."""
        opt = self._opt
        found = []
        for params, (_, counts_every_rank, _) in zip(groups, reductions):
            entries = []
            for p in params:
                if counts_every_rank or is_model_parallel_parameter(p) or (opt.model_parallel_rank == 0):
                    entry = self._tensor(opt.get_param_id(p))
                    if entry is not None:
                        entries.append(entry)
            found.append(entries)
        flat = [t for entries in found for t, _ in entries]
        values = iter(torch.stack([t.reshape(()).to(torch.float64) for t in flat]).cpu().tolist() if flat else [])
        sums = []
        for entries in found:
            total = 0.0
            for (_, raw), v in zip(entries, values):
                param_norm = math.sqrt(v * v) if raw else v  # DeepSpeed's (norm ** 2.0) ** 0.5
                total += param_norm * param_norm
            sums.append(total)
        return sums

    def _finish(self, sums: list[float], reduction: tuple):
        """The rest of DeepSpeed's per-subgroup norm, on a vector of subgroups that share ``reduction``: the same
        all-reduces, square root and nan/inf mask, each elementwise, so each entry is what the scalar code gives."""
        process_group, counts_every_rank, autoep_ep_group = reduction
        total_norm_cuda = get_accelerator().FloatTensor([float(x) for x in sums])
        dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=process_group)
        if not counts_every_rank:
            self._opt._model_parallel_all_reduce(tensor=total_norm_cuda, op=dist.ReduceOp.SUM)
        if pg_utils.is_parallel(autoep_ep_group):
            dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.SUM, group=autoep_ep_group)
        total_norm = total_norm_cuda**(1. / 2.0)
        mask_nan_or_inf_with_val_inplace(total_norm, device=total_norm.device)
        return total_norm.cpu()

    def subgroup_norm(self, params):
        """One subgroup's gradient norm, DeepSpeed's value: one copy of its norms to the host, the same
        double-precision operations in the same order there, then DeepSpeed's reduction on a one-element vector."""
        reduction = self._reduction(params)
        return self._finish(self._squared_sums([params], [reduction]), reduction)[0]

    def all_norms(self) -> Optional[list]:
        """Every subgroup's gradient norm at once, when all reduce over the same groups (always, short of
        AutoEP/tensor-parallel mixes): the same values as one subgroup at a time; None otherwise."""
        groups = list(self._opt.fp16_groups)
        reductions = [self._reduction(g) for g in groups]
        first = reductions[0]
        if any(r[0] is not first[0] or r[1] != first[1] or r[2] is not first[2] for r in reductions):
            return None
        return list(self._finish(self._squared_sums(groups, reductions), first).unbind())
