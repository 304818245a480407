"""`dostune tune --validate N`: run ZeRO-Offload and the N best schedules for real and put the measurements beside
the predictions, phase by phase (the rows of tune.json's ``validation``; validation_figure.py draws them).

They run with gradient clipping off: the model predicts steps that do not clip (with clipping, a step that clips
redoes the CPU lane's updates made during backward, and a freshly initialised model clips every step), so that is
what is measured. ZeRO-Offload runs in the form this host's memory holds (pin_memory off where its pinned buffers
cannot fit), the form the model profile measured and the prediction assumes.

They run in rounds, as ``dostune bench --rounds`` runs its methods: every method once per round, the order reversed
every other round (ZeRO-Offload, #1, #2, ..., then ..., #2, #1, ZeRO-Offload), and each row is the median of all its
rounds' iterations. Each method runs in a fresh process, and on the H100 hosts schedules the model predicts alike read
backwards of 1.56 and 2.35 s in two processes minutes apart: a single process per row measures the moment as much as
the schedule. The pooled measurements, each method's traced step included, are kept as a bench record
(``validation-bench.json`` beside tune.json).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from ..bench.record import BenchResult, MethodResult
from ..bench.pool import pool_rounds
from ..bench.run import BenchOptions, RoundProgress, bench_record, method_offload, run_method
from ..dsconfig import DEFAULT_SUB_GROUP_SIZE, OffloadSettings
from ..errors import DostuneError, NotAvailable
from ..host_memory import fit_host_memory
from ..host_steal import NOTE_ABOVE
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
    """One validated row: the prediction's phases beside the measured medians, pooled over the rounds, each round's
    own medians, and the split the swing ran each timed iteration with."""
    return Validation(label=label, method=method, sub_group_size=sub_group_size, schedule=schedule,
                      predicted_fwd_s=predicted.fwd_s, predicted_bwd_s=predicted.bwd_s,
                      predicted_step_s=predicted.step_s, predicted_iter_s=predicted.iter_s,
                      predicted_peak_gpu_gib=predicted.peak_gpu_gib, measured_fwd_s=measured.fwd_s,
                      measured_bwd_s=measured.bwd_s, measured_step_s=measured.step_s,
                      measured_iter_s=measured.iter_s, measured_peak_gpu_gib=measured.peak_gpu_gib,
                      measured_steal=measured.steal,
                      set_aside=measured.set_aside.runs if measured.set_aside is not None else None,
                      measured_round_iter_s=measured.round_iter_s or None,
                      measured_round_step_s=measured.round_step_s or None, measured_swing=measured.swing or None)


@dataclass
class ValidationRun:
    rows: list[Validation]  # predicted beside measured, one per method that ran (tune.json's validation)
    bench: BenchResult  # every method's pooled measurement, as dostune bench records it
    # None when every round finished; else what was stopped and what the rows hold (a line for tune.json's notes)
    stopped: Optional[str] = None


def validate(result: TuneResult, n: int, seq: int, iters: int = 12, warmup: int = 2, rounds: int = 2,
             progress: Optional[ProgressSink] = None, activation_checkpointing: bool = False,
             runner: Optional[Runner] = None, host_available: Optional[int] = None) -> ValidationRun:
    """Measure ZeRO-Offload (ratio 1.0) and the ``n`` best distinct schedules, ``iters`` iterations each in each of
    ``rounds`` rounds (the order reversed every other round). ``runner``: how a method is measured (default:
    ``dostune bench``'s, which needs a CUDA GPU). A KeyboardInterrupt while measuring stops it: the rounds that
    finished are kept, and ``stopped`` says what the rows hold."""
    if rounds < 1 or iters < 1 or warmup < 0:
        raise DostuneError(f"validation needs at least 1 round, 1 iteration and no negative warm-up, got {rounds}, "
                           f"{iters} and {warmup}",
                           hint="see dostune tune --help")
    if runner is None:
        if not cuda_available():
            raise NotAvailable("--validate runs the schedules for real and needs a CUDA GPU")
        runner = run_method
        host_available = available_host_bytes()
    progress = progress or NullProgress()
    spec = resolve_model(result.model)
    opts = BenchOptions(model=result.model, micro_batch=result.micro_batch, seq=seq, precision=result.precision,
                        iters=iters, warmup=warmup, rounds=rounds, clip=0.0,
                        sub_group_size=result.ds_sub_group_size or DEFAULT_SUB_GROUP_SIZE)
    opts.train = replace(opts.train, micro_batch=result.micro_batch, precision=result.precision, clip=0.0,
                         activation_checkpointing=activation_checkpointing)
    # (label, method, offload settings, sub_group_size, schedule, prediction) of every method to measure
    jobs = []
    try:
        zo, note = fit_host_memory("zero-offload", method_offload("zero-offload", opts, None), param_numels(spec),
                                   result.precision, host_available)
    except DostuneError:  # its state cannot fit this host at all: nothing to compare with
        zo = None
    if zo is not None and result.ds_offload is not None:
        jobs.append(("zero-offload" + (f" ({note})" if note else ""), "zero-offload", zo, opts.sub_group_size, None,
                     result.ds_offload))
    for k, rec in enumerate(result.top[:n]):
        sched = ScheduleConfig.model_validate(rec.schedule)
        offload = OffloadSettings(sub_group_size=rec.sub_group_size, pin_memory=False,
                                  schedule=sched.model_copy(update={"trace": True}))
        jobs.append((f"dostune #{k + 1}", "dostune", offload, rec.sub_group_size, rec.schedule, rec.predicted))
    runs: dict[str, list[MethodResult]] = {job[0]: [] for job in jobs}
    stopped, r = None, 0
    try:
        for r in range(rounds):
            sink = RoundProgress(progress, f"round {r + 1}/{rounds}: ") if rounds > 1 else progress
            for label, method, offload, *_ in (jobs if r % 2 == 0 else jobs[::-1]):
                if runs[label] and not runs[label][-1].ran:  # failed once (out of memory, say): it would again
                    continue
                runs[label].append(runner(method, spec, opts, offload, sink))
    except KeyboardInterrupt:
        # Ctrl-C, or a SIGTERM the caller turned into one: the method being measured is given up, the rounds that
        # finished are kept, so minutes of measurement are not lost with it
        done = ", ".join(f"{label} {sum(x.ran for x in results)}" for label, results in runs.items())
        stopped = (f"validation stopped in round {r + 1} of {rounds}: each row pools the rounds its method finished "
                   f"({done})")
    pooled = {label: pool_rounds(results) for label, results in runs.items() if results}
    rows = [row(label, method, sgs, schedule, predicted, pooled[label])
            for label, method, _, sgs, schedule, predicted in jobs if label in pooled and pooled[label].ran]
    return ValidationRun(rows=rows, bench=bench_record(opts, result.params, pooled), stopped=stopped)


METHODS = ("dostune", "zero-offload")


def _share(x: Optional[float]) -> str:
    return "an unknown share" if x is None else f"{x:.1%}"


def validation_details(res: TuneResult) -> list[str]:
    """What a validation says beyond each row's measured against predicted, a line each (tune.json's details, which
    `dostune tune --verbose` prints): the median errors per method, how far the host moved since the model profile,
    how far the rounds disagreed, the rows whose swing ran another split, and the hypervisor's steal."""
    out = []
    for method in METHODS:
        rows = sum(v.method == method for v in res.validation)
        it, st = res.median_error("iter", method), res.median_error("step", method)
        if it is not None and st is not None:
            out.append(f"{method}: median prediction error over {rows} row(s): iteration {it:.1%} "
                       f"({1e3 * res.median_error_s('iter', method):.0f} ms), step {st:.1%} "
                       f"({1e3 * res.median_error_s('step', method):.0f} ms)")
    drift, step_drift = res.host_drift("iter"), res.host_drift("step")
    if drift is not None:
        # ZeRO-Offload's prediction is the model profile's own measurement of it: the ratio is the host's, not the
        # model's, and every other row was measured on the same host
        step = f" (its step {step_drift:.2f}x)" if step_drift is not None else ""
        out.append(f"ZeRO-Offload ran {drift:.2f}x the iteration its model profile measured{step}: the host's speed "
                   "moved by that much since the profile, and every error above holds that move; far from 1.00x, "
                   "profile the model again before taking the errors for the model's")
    spreads = [f"{m} {it:.1%} / {st:.1%}" for m in METHODS
               if (it := res.round_spread("iter", m)) is not None and (st := res.round_spread("step", m)) is not None]
    if spreads:
        # each round is a fresh process running the same schedule: no prediction can agree better than they do
        out.append("the same schedule measured in separate processes differed by " + ", ".join(spreads)
                   + " (iteration / step, slowest round over fastest, median over rows): errors of that size are "
                     "this host's own variation; more --validate-rounds average more of it out")
    swung = [(v.label, *moved) for v in res.validation if (moved := v.swung()) is not None]
    if swung:
        # the model predicts the tuned split; the swing moves subgroups between the lanes when the lanes' measured
        # times disagree with it
        out.append("adaptive_swing moved subgroups between the lanes (+k: to the CPU lane, -k: to the GPU lane) while "
                   "measuring " + ", ".join(f"{label} ({med:+g} typically, {most:+d} at most)"
                                            for label, med, most in swung)
                   + ": those rows ran another split than the one predicted, so their step may differ from the "
                     "prediction for that reason")
    prof, runs = res.profile_steal, res.validation_steal()
    if prof is not None or runs is not None:
        def aside(n):
            return "" if not n else f" ({n} timed iteration{'s' if n != 1 else ''} set aside for it)"

        quiet = all(x is None or x <= NOTE_ABOVE for x in (prof, runs))
        out.append(f"the hypervisor took {_share(prof)} of the CPU while the model profile timed its iterations"
                   f"{aside(res.profile_set_aside)} and {_share(runs)} over the validated runs"
                   f"{aside(res.validation_set_aside())}: "
                   + ("the host was quiet" if quiet else "CPU work runs slower under steal, so a difference between "
                      "the two moves every error; profile and validate when the host is quiet"))
    return out
