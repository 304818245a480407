"""The model profile's lane reference: dostune itself, with one fixed schedule, on the model being profiled, its CPU lane
traced.

The probes (backward_probes.py, step_lane.py) time dostune's CPU-lane kernel on scratch subgroups beside backward and
beside copies. Training runs the lane otherwise: on subgroups read from memory as their gradients arrive, beside
backward's gradient copies and dostune's hooks. Set beside 160 traced rows of 54 held-out shapes, the model's lane in
backward ran a median 0.90x the traced time per element, with a spread of 17% per shape, and that error moves the
step the lane leaves over (docs/experiments.md, sections 38-40). So the profile also runs dostune as
``dostune tune --validate`` runs a row (bench/run.py ``schedule_run``: each round a fresh process, gradient clipping
off), keeps each round's traced CPU-lane spans, and the performance model takes the lane's rates from them
(perfmodel/lane_reference.py).

The schedule is fixed, not tuned, so that the model still carries the rates over to the schedules it scores: the CPU
lane working during backward (the tuner's pick on every micro-batch-8 shape validated so far), a fifth of the
subgroups on the GPU lane, 25M-element subgroups.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..optim.schedule import ScheduleConfig
from ..profile.timing import NullProgress, ProgressSink
from .model_record import LaneReference

REFERENCE_SCHEDULE = ScheduleConfig(gpu_fraction=0.2, overlap_backward=True)
REFERENCE_SUB_GROUP_SIZE = 25_000_000
REFERENCE_ROUNDS = 2
REFERENCE_ITERS = 6  # timed per round, after REFERENCE_WARMUP; the last one is traced
REFERENCE_WARMUP = 2


def measure_lane_reference(model: str, micro_batch: int, seq: int, precision: str, activation_checkpointing: bool,
                           ds_sub_group_size: int, progress: Optional[ProgressSink] = None,
                           runner: Optional[Callable] = None, rounds: int = REFERENCE_ROUNDS,
                           iters: int = REFERENCE_ITERS, sub_group_size: int = REFERENCE_SUB_GROUP_SIZE,
                           ) -> tuple[Optional[LaneReference], Optional[str]]:
    """Run the reference schedule ``rounds`` times, each in a fresh process. Returns its record, or None and a note
    saying why it did not run (the profile keeps everything else; the model then takes the probes' lane rates).
    ``runner``: how a method is measured (default: ``dostune bench``'s, bench/run.py ``run_method``)."""
    from ..bench.pool import pool_rounds
    from ..bench.run import RoundProgress, run_method, schedule_offload, schedule_run
    from ..models.registry import resolve_model

    progress = progress or NullProgress()
    runner = runner or run_method
    spec = resolve_model(model)
    opts = schedule_run(model, micro_batch, seq, precision, iters, REFERENCE_WARMUP, rounds,
                        activation_checkpointing, ds_sub_group_size)
    offload = schedule_offload(REFERENCE_SCHEDULE, sub_group_size)
    runs = []
    for r in range(rounds):
        res = runner("dostune", spec, opts, offload, RoundProgress(progress, f"lane reference {r + 1}/{rounds}: "))
        if not res.ran:
            first = (res.error or "no reason given").strip().splitlines()[0]
            return None, (f"the lane reference did not run ({first}): the performance model takes the CPU lane's "
                          "rates from the probes")
        runs.append(res)
    traces = [[s for s in res.timeline if s.lane == "cpu"] for res in runs]
    if not any(traces):
        return None, ("the lane reference traced no CPU-lane update: the performance model takes the CPU lane's "
                      "rates from the probes")
    pooled = pool_rounds(runs)
    return LaneReference(schedule=REFERENCE_SCHEDULE.model_dump(exclude_defaults=True),
                         sub_group_size=sub_group_size, rounds=rounds, iterations=iters, traces=traces,
                         bwd_s=pooled.bwd, step_s=pooled.step), None
