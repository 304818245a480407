"""`dostune tune --validate N`: run ZeRO-Offload and the N best schedules for real and put the measurements beside
the predictions, phase by phase (the rows of tune.json's ``validation``; validation_figure.py draws them).

They run with gradient clipping off: the model predicts steps that do not clip (with clipping, a step that clips
redoes the CPU lane's updates made during backward, and a freshly initialised model clips every step), so that is
what is measured. ZeRO-Offload runs in the form this host's memory holds (pin_memory off where its pinned buffers
cannot fit), the form the model profile measured and the prediction assumes.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from ..bench.record import MethodResult
from ..bench.run import BenchOptions, method_offload, run_method
from ..dsconfig import OffloadSettings
from ..errors import DostuneError, NotAvailable
from ..host_memory import fit_host_memory
from ..models.registry import ModelSpec, resolve_model
from ..optim.footprint import available_host_bytes
from ..optim.schedule import ScheduleConfig
from ..perfmodel.subgroups import param_numels
from ..profile.identity import cuda_available
from ..profile.timing import NullProgress, ProgressSink
from .record import PredictedTimes, TuneResult, Validation

#: measures one method: (name, model, options, offload settings, progress) -> its bench result (bench/run.py)
Runner = Callable[[str, ModelSpec, BenchOptions, OffloadSettings, ProgressSink], MethodResult]


def row(label: str, method: str, sub_group_size: int, schedule: Optional[dict], predicted: PredictedTimes,
        measured: MethodResult) -> Validation:
    """One validated row: the prediction's phases beside the measured medians."""
    return Validation(label=label, method=method, sub_group_size=sub_group_size, schedule=schedule,
                      predicted_fwd_s=predicted.fwd_s, predicted_bwd_s=predicted.bwd_s,
                      predicted_step_s=predicted.step_s, predicted_iter_s=predicted.iter_s,
                      predicted_peak_gpu_gib=predicted.peak_gpu_gib, measured_fwd_s=measured.fwd_s,
                      measured_bwd_s=measured.bwd_s, measured_step_s=measured.step_s,
                      measured_iter_s=measured.iter_s, measured_peak_gpu_gib=measured.peak_gpu_gib)


def validate(result: TuneResult, n: int, seq: int, iters: int = 5, warmup: int = 2,
             progress: Optional[ProgressSink] = None, activation_checkpointing: bool = False,
             runner: Optional[Runner] = None, host_available: Optional[int] = None) -> list[Validation]:
    """Measure ZeRO-Offload (ratio 1.0) and the ``n`` best distinct schedules, a few iterations each. ``runner``:
    how a method is measured (default: ``dostune bench``'s, which needs a CUDA GPU)."""
    if runner is None:
        if not cuda_available():
            raise NotAvailable("--validate runs the schedules for real and needs a CUDA GPU")
        runner = run_method
        host_available = available_host_bytes()
    progress = progress or NullProgress()
    spec = resolve_model(result.model)
    opts = BenchOptions(model=result.model, micro_batch=result.micro_batch, seq=seq, precision=result.precision,
                        iters=iters, warmup=warmup, clip=0.0, sub_group_size=result.ds_sub_group_size or 100_000_000)
    opts.train = replace(opts.train, micro_batch=result.micro_batch, precision=result.precision, clip=0.0,
                         activation_checkpointing=activation_checkpointing)
    out = []
    try:
        zo, note = fit_host_memory("zero-offload", method_offload("zero-offload", opts, None), param_numels(spec),
                                   result.precision, host_available)
    except DostuneError:  # its state cannot fit this host at all: nothing to compare with
        zo = None
    if zo is not None and result.ds_offload is not None:
        base = runner("zero-offload", spec, opts, zo, progress)
        if base.ran:
            label = "zero-offload" + (f" ({note})" if note else "")
            out.append(row(label, "zero-offload", opts.sub_group_size, None, result.ds_offload, base))
    for k, rec in enumerate(result.top[:n]):
        sched = ScheduleConfig.model_validate(rec.schedule)
        offload = OffloadSettings(sub_group_size=rec.sub_group_size, pin_memory=False,
                                  schedule=sched.model_copy(update={"trace": True}))
        res = runner("dostune", spec, opts, offload, progress)
        if res.ran:
            out.append(row(f"dostune #{k + 1}", "dostune", rec.sub_group_size, rec.schedule, rec.predicted, res))
    return out
