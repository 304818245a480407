"""`dostune tune --validate N`: run the best schedules for real and put the measurements beside the predictions."""
from __future__ import annotations

from typing import Optional

from ..bench.run import BenchOptions, method_offload, run_method
from ..dsconfig import OffloadSettings
from ..errors import NotAvailable
from ..models.registry import resolve_model
from ..optim.schedule import ScheduleConfig
from ..profile.identity import cuda_available
from ..profile.timing import NullProgress, ProgressSink
from .record import TuneResult, Validation


def validate(result: TuneResult, n: int, seq: int, iters: int = 5, warmup: int = 2,
             progress: Optional[ProgressSink] = None, activation_checkpointing: bool = False) -> list[Validation]:
    """Measure ZeRO-Offload (ratio 1.0) and the ``n`` best distinct schedules, a few iterations each."""
    if not cuda_available():
        raise NotAvailable("--validate runs the schedules for real and needs a CUDA GPU")
    progress = progress or NullProgress()
    spec = resolve_model(result.model)
    opts = BenchOptions(model=result.model, micro_batch=result.micro_batch, seq=seq, precision=result.precision,
                        iters=iters, warmup=warmup, sub_group_size=result.ds_sub_group_size or 100_000_000)
    from dataclasses import replace

    opts.train = replace(opts.train, micro_batch=result.micro_batch, precision=result.precision,
                         activation_checkpointing=activation_checkpointing)
    out = []
    base = run_method("zero-offload", spec, opts, method_offload("zero-offload", opts, None), progress)
    if base.ran and result.ds_offload is not None:
        out.append(Validation(label="zero-offload (DeepSpeed, ratio 1.0)", sub_group_size=opts.sub_group_size,
                              schedule=None, predicted_iter_s=result.ds_offload.iter_s,
                              predicted_step_s=result.ds_offload.step_s, measured_iter_s=base.iter_s,
                              measured_step_s=base.step_s, measured_peak_gpu_gib=base.peak_gpu_gib))
    for k, rec in enumerate(result.top[:n]):
        sched = ScheduleConfig.model_validate(rec.schedule)
        offload = OffloadSettings(sub_group_size=rec.sub_group_size, schedule=sched.model_copy(update={"trace": True}))
        res = run_method("dostune", spec, opts, offload, progress)
        if not res.ran:
            continue
        out.append(Validation(label=f"dostune #{k + 1}", sub_group_size=rec.sub_group_size, schedule=rec.schedule,
                              predicted_iter_s=rec.predicted.iter_s, predicted_step_s=rec.predicted.step_s,
                              measured_iter_s=res.iter_s, measured_step_s=res.step_s,
                              measured_peak_gpu_gib=res.peak_gpu_gib))
    return out
