"""The step numbers and float constants of DeepSpeed's C++ Adam, as every lane must use them to reproduce its
updates bit for bit."""
from __future__ import annotations

from typing import Optional

import torch

from .host_state import HostStates
from .kernels import AdamScalars, LaneAdam


class AdamSteps:
    def __init__(self, opt, host: HostStates, lane_adam: LaneAdam):
        self._opt, self._host, self._lane_adam = opt, host, lane_adam
        # Optimizer step number the C++ Adam beta powers were last advanced to by this process (None: never).
        self._beta_step: Optional[int] = None
        self._empty = torch.empty(0, dtype=torch.float32)

    def sync_beta_powers(self) -> None:
        """Make a resumed run's Adam constants bit-equal to an uninterrupted run's.

        DeepSpeed's C++ Adam keeps beta1^t and beta2^t as running float products, but a fresh process (after
        a checkpoint load) computes them with pow() at its first step, which differs in the last bit at some
        steps (e.g. beta2=0.999 at t=6), so every later update would drift. Advancing the products one step
        at a time through the loaded history (empty tensors: no element is touched) restores the exact
        state an uninterrupted run would have."""
        done = int(self._host.step_count(0))
        if self._beta_step == done:
            return
        self._beta_step = done
        if done == 0:
            return
        beta1, beta2 = self._host.group(0)["betas"]
        shadow = self._lane_adam.shadow = type(self._lane_adam.shadow)(beta1, beta2)
        for t in range(1, done + 1):
            self._advance_ops(t)
            shadow.increment(t, beta1, beta2)

    def _advance_ops(self, t: int) -> None:
        """Bring every C++ Adam's beta powers to step ``t`` with a call that updates no element (a no-op for one
        already there)."""
        empty, group = self._empty, self._host.group(0)
        beta1, beta2 = group["betas"]
        for op, opt_id in [(self._opt.optimizer.ds_opt_adam, self._opt.optimizer.opt_id)] + self._lane_adam.cpu_ops():
            op.adam_update(opt_id, t, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                           group["bias_correction"], empty, empty, empty, empty)

    def step_done(self) -> None:
        """The step's updates advanced every subgroup's step count, and the C++ beta powers of the C++ Adams that
        ran follow; those of one that updated nothing this step are advanced here. Otherwise its next call would
        skip steps, and the C++ Adam then computes the powers with pow(), off in the last bit from the running
        products of an uninterrupted DeepSpeed: DeepSpeed's own when the CPU lane is empty or runs during backward
        and a subgroup later reaches it (adaptive_swing, GPU memory pressure: pressure.py), the CPU emulation of
        the GPU lane after a step whose GPU-lane subgroups all fell back."""
        self._beta_step = int(self._host.step_count(0))
        self._advance_ops(self._beta_step)

    def scalars(self, which: frozenset) -> dict[int, AdamScalars]:
        """The float constants DeepSpeed's C++ Adam would use for each subgroup in ``which`` this step: replay its
        IncrementStep over all subgroups in DeepSpeed's order (step numbers after this step's increment).
        Idempotent within a step."""
        shadow, out = self._lane_adam.shadow, {}
        for i in range(self._host.count):
            group = self._host.group(i)
            shadow.increment(self._host.step_count(i) + 1, *group["betas"])
            if i in which:
                out[i] = shadow.scalars(group["lr"], group["eps"], group["weight_decay"], group["bias_correction"],
                                        self._opt.optimizer.adam_w_mode)
        return out
