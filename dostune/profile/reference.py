"""The model profile's reference run: dostune itself, with one fixed schedule, on the model being profiled.

The probes (backward_probes.py) and the node profile measure the parts of an interleaved iteration apart: backward
without copies, dostune's CPU-lane kernel on a scratch subgroup, CPU Adam beside copies. Training puts them together,
and on the 22 shapes the model met unseen the parts' composition put dostune's iteration a median 7% short (short on
14), its backward 8% short (on 15), and missed its step by more than 20% on 10 (docs/experiments.md, sections 27 and
31): dostune's own backward hooks are in no probe, and the lane reads a cached scratch subgroup faster than training
reads its subgroups from memory. So the profile also runs
dostune, as ``dostune tune --validate`` runs a schedule (bench/run.py ``schedule_run``: each round a fresh process,
gradient clipping off), and the performance model is calibrated to what it measured (perfmodel/calibration.py).

The schedule is fixed, not tuned, so that the model still has to carry the measurement over to the schedules it
scores: the CPU lane working during backward (the tuner's pick on every micro-batch-8 shape validated so far), a fifth
of the subgroups on the GPU lane, 25M-element subgroups.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..optim.schedule import ScheduleConfig
from ..profile.timing import NullProgress, ProgressSink
from .model_record import ReferenceRun

REFERENCE_SCHEDULE = ScheduleConfig(gpu_fraction=0.2, overlap_backward=True)
REFERENCE_SUB_GROUP_SIZE = 25_000_000
REFERENCE_ROUNDS = 2
REFERENCE_ITERS = 12  # timed per round, after REFERENCE_WARMUP
REFERENCE_WARMUP = 2


def measure_reference(model: str, micro_batch: int, seq: int, precision: str, activation_checkpointing: bool,
                      ds_sub_group_size: int, progress: Optional[ProgressSink] = None,
                      runner: Optional[Callable] = None, rounds: int = REFERENCE_ROUNDS,
                      iters: int = REFERENCE_ITERS) -> tuple[Optional[ReferenceRun], Optional[str]]:
    """Run the reference schedule ``rounds`` times, each in a fresh process. Returns the pooled run, or None and a
    note saying why it did not run (the profile keeps everything else; the model then goes uncalibrated).
    ``runner``: how a method is measured (default: ``dostune bench``'s, bench/run.py ``run_method``)."""
    from ..bench.pool import pool_rounds
    from ..bench.run import RoundProgress, run_method, schedule_offload, schedule_run
    from ..models.registry import resolve_model

    progress = progress or NullProgress()
    runner = runner or run_method
    spec = resolve_model(model)
    opts = schedule_run(model, micro_batch, seq, precision, iters, REFERENCE_WARMUP, rounds,
                        activation_checkpointing, ds_sub_group_size)
    offload = schedule_offload(REFERENCE_SCHEDULE, REFERENCE_SUB_GROUP_SIZE)
    runs = []
    for r in range(rounds):
        res = runner("dostune", spec, opts, offload, RoundProgress(progress, f"reference run {r + 1}/{rounds}: "))
        if not res.ran:
            first = (res.error or "no reason given").strip().splitlines()[0]
            return None, (f"the reference schedule did not run ({first}): the performance model is not calibrated "
                          "to a run of dostune on this model")
        runs.append(res)
    pooled = pool_rounds(runs)
    return ReferenceRun(schedule=REFERENCE_SCHEDULE.model_dump(exclude_defaults=True),
                        sub_group_size=REFERENCE_SUB_GROUP_SIZE, rounds=rounds, iterations=iters, fwd_s=pooled.fwd,
                        bwd_s=pooled.bwd, step_s=pooled.step, iter_s=pooled.iter), None


def describe_reference(run: ReferenceRun) -> str:
    """The reference schedule in a few words, for the profile's summary and the tuner's notes."""
    words = [f"{k} {v}" for k, v in run.schedule.items() if not isinstance(v, bool)]
    words += [k for k, v in run.schedule.items() if v is True]
    return ", ".join(words + [f"{run.sub_group_size / 1e6:g}M-element subgroups"])
