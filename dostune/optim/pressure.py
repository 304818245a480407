"""GPU memory pressure: what a step does when the device cannot give it the memory it allocates anew each step.

Beyond what the run holds, the step allocates on the device (footprint.gpu_step_bytes): the streamed GPU lane's
staging slots at the step's start, their kept gradients during backward, and the CPU lane's fp32 upload buffer (the
resident subgroups allocate nothing: DeepSpeed built their state and gradient buffer on the device at start-up). On
a shared GPU another process may have taken that memory by then. Rather than fail the run with PyTorch's
out-of-memory error, the step goes on without it, to the same values. All but the upload buffer are reserved before
any GPU-lane work is queued (step.py ``_plan_step``), so the step's plan is decided with nothing half queued:

* no staging slots: none of the streamed GPU-lane subgroups is queued on the GPU lane; the step's plan moves them
  to its ``fallback`` (schedule.make_plan);
* no kept-gradient buffer for a streamed GPU-lane subgroup: DeepSpeed's own offload takes its gradients (grads.py),
  and the subgroup joins the step's ``fallback``;
* the fallback's subgroups are updated as DeepSpeed updates every subgroup: DeepSpeedCPUAdam in place on the host
  states, from DeepSpeed's fp32 gradient buffer (kept gradients are copied there first), then DeepSpeed's own
  blocking copy into the half-precision partition, which converts on the host and needs no device memory;
* no upload buffer: the CPU lane's results go up with that same copy.

The next step tries the device again. The first time, one warning says so; ``stats`` counts every time.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class MemoryPressure:
    def __init__(self):
        self._warned = False
        self.fallback_steps = 0  # steps whose GPU lane left subgroups to the host
        self.fallback_subgroups = 0  # the subgroup updates those were
        self.upload_fallback_steps = 0  # steps whose CPU-lane results went up without the upload buffer

    def gpu_lane_fell_back(self, subgroups: tuple, missing: str) -> None:
        """The GPU lane could not allocate its ``missing`` (e.g. "staging slots"): ``subgroups`` go to the host."""
        self.fallback_steps += 1
        self.fallback_subgroups += len(subgroups)
        self._warn(f"the GPU lane's {missing} could not be allocated, so its subgroups {list(subgroups)} were "
                   "updated on the CPU instead")

    def upload_fell_back(self, nbytes: int, err: BaseException) -> None:
        self.upload_fallback_steps += 1
        self._warn(f"the CPU lane's upload buffer ({nbytes / 2**20:.0f} MiB) could not be allocated on the GPU "
                   f"({_first_line(err)}), so its results went up with DeepSpeed's own blocking copy")

    def _warn(self, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning("dostune: GPU memory pressure (another process may hold GPU memory): %s. The values are the "
                    "same; the step is slower. Every step tries the GPU again; this warning is not repeated "
                    "(dostune_pressure_stats counts the steps).", what)

    @property
    def stats(self) -> dict:
        return {"fallback_steps": self.fallback_steps, "fallback_subgroups": self.fallback_subgroups,
                "upload_fallback_steps": self.upload_fallback_steps}
