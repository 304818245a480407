"""`dostune tune --validate N`: run ZeRO-Offload and the N best schedules for real and put the measurements beside
the predictions, phase by phase (the rows of tune.json's ``validation``; validation_figure.py draws them).

They run with gradient clipping off by default, and each row beside the prediction of the regime its steps are in
(perfmodel/lanes.py): off, no step clips; at a threshold (``clip``), the model profile's gradient norms say whether
they do (a freshly initialised model's usually do: overlap_backward's CPU lane then works in the step). ZeRO-Offload
runs in the form this host's memory holds (pin_memory off where its pinned buffers cannot fit), the form the model
profile measured and the prediction assumes.

With ``neighbours`` the pick runs beside the schedules one step from it in each main knob (Space.neighbours) in the
same rounds, and ``regret`` is the pick's measured iteration over the best measured.

They run in rounds, as ``dostune bench --rounds`` runs its methods: every method once per round, the order reversed
every other round (ZeRO-Offload, #1, #2, ..., then ..., #2, #1, ZeRO-Offload), and each row is the median of all its
rounds' iterations. Each method runs in a fresh process, and on the H100 hosts schedules the model predicts alike read
backwards of 1.56 and 2.35 s in two processes minutes apart: a single process per row measures the moment as much as
the schedule. The pooled measurements, each method's traced step included, are kept as a bench record
(``validation-bench.json`` beside tune.json).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

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
from .record import PredictedTimes, TrialRecord, TuneResult, Validation
from .regime import regime_at

#: measures one method: (name, model, options, offload settings, progress) -> its bench result (bench/run.py)
Runner = Callable[[str, ModelSpec, BenchOptions, OffloadSettings, ProgressSink], MethodResult]


def row(label: str, method: str, sub_group_size: int, schedule: Optional[dict], predicted: PredictedTimes,
        measured: MethodResult, neighbour: Optional[str] = None) -> Validation:
    """One validated row: the prediction's phases (of its regime) beside the measured medians, pooled over the rounds,
    each round's own medians, and the split the swing ran each timed iteration with; ``neighbour``: which of the pick's
    neighbours it is."""
    return Validation(label=label, method=method, sub_group_size=sub_group_size, schedule=schedule,
                      predicted_fwd_s=predicted.fwd_s, predicted_bwd_s=predicted.bwd_s,
                      predicted_step_s=predicted.step_s, predicted_iter_s=predicted.iter_s,
                      predicted_peak_gpu_gib=predicted.peak_gpu_gib, measured_fwd_s=measured.fwd_s,
                      measured_bwd_s=measured.bwd_s, measured_step_s=measured.step_s,
                      measured_iter_s=measured.iter_s, measured_peak_gpu_gib=measured.peak_gpu_gib,
                      measured_steal=measured.steal,
                      set_aside=measured.set_aside.runs if measured.set_aside is not None else None,
                      measured_round_iter_s=measured.round_iter_s or None,
                      measured_round_step_s=measured.round_step_s or None, measured_swing=measured.swing or None,
                      regime=predicted.regime, neighbour=neighbour)


@dataclass
class ValidationRun:
    rows: list[Validation]  # predicted beside measured, one per method that ran (tune.json's validation)
    bench: BenchResult  # every method's pooled measurement, as dostune bench records it
    # None when every round finished; else what was stopped and what the rows hold (a line for tune.json's notes)
    stopped: Optional[str] = None
    # with neighbours: the pick's measured iteration over the best measured, and the best's label (regret)
    regret: Optional[float] = None
    regret_best: Optional[str] = None


def validate(result: TuneResult, n: int, seq: int, iters: int = 12, warmup: int = 2, rounds: int = 2,
             progress: Optional[ProgressSink] = None, activation_checkpointing: bool = False,
             runner: Optional[Runner] = None, host_available: Optional[int] = None, clip: float = 0.0,
             neighbours: Sequence[tuple[str, TrialRecord]] = ()) -> ValidationRun:
    """Measure ZeRO-Offload (ratio 1.0) and the ``n`` best distinct schedules (with ``n`` 0, neither), then the pick
    and its ``neighbours`` ((label, record) each) where given, ``iters`` iterations each in each of ``rounds`` rounds
    (the order reversed every other round), gradient clipping at ``clip`` (0: off). ``runner``: how a method is
    measured (default: ``dostune bench``'s, which needs a CUDA GPU). A KeyboardInterrupt while measuring stops it: the
    rounds that finished are kept, and ``stopped`` says what the rows hold."""
    if rounds < 1 or iters < 1 or warmup < 0:
        raise DostuneError(f"validation needs at least 1 round, 1 iteration and no negative warm-up, got {rounds}, "
                           f"{iters} and {warmup}",
                           hint="see dostune tune --help")
    if not clip >= 0:
        raise DostuneError(f"the validation's clipping must be 0 (off) or positive, got {clip}")
    if runner is None:
        if not cuda_available():
            raise NotAvailable("--validate runs the schedules for real and needs a CUDA GPU")
        runner = run_method
        host_available = available_host_bytes()
    progress = progress or NullProgress()
    spec = resolve_model(result.model)
    opts = BenchOptions(model=result.model, micro_batch=result.micro_batch, seq=seq, precision=result.precision,
                        iters=iters, warmup=warmup, rounds=rounds, clip=clip,
                        sub_group_size=result.ds_sub_group_size or DEFAULT_SUB_GROUP_SIZE)
    opts.train = replace(opts.train, micro_batch=result.micro_batch, precision=result.precision, clip=clip,
                         activation_checkpointing=activation_checkpointing)
    regime = runs_regime(result, clip)
    # (label, method, offload settings, sub_group_size, schedule, prediction, neighbour) of every method to measure
    jobs = []
    try:
        zo, note = fit_host_memory("zero-offload", method_offload("zero-offload", opts, None), param_numels(spec),
                                   result.precision, host_available)
    except DostuneError:  # its state cannot fit this host at all: nothing to compare with
        zo = None
    if n and zo is not None and result.ds_offload is not None:
        jobs.append(("zero-offload" + (f" ({note})" if note else ""), "zero-offload", zo, opts.sub_group_size, None,
                     result.ds_offload, None))

    def schedule_job(label: str, rec: TrialRecord, neighbour: Optional[str]) -> tuple:
        sched = ScheduleConfig.model_validate(rec.schedule)
        offload = OffloadSettings(sub_group_size=rec.sub_group_size, pin_memory=False,
                                  schedule=sched.model_copy(update={"trace": True}))
        predicted = rec.regimes.get(regime, rec.predicted) if regime is not None else rec.predicted
        return label, "dostune", offload, rec.sub_group_size, rec.schedule, predicted, neighbour

    for k, rec in enumerate(result.top[:max(n, 1 if neighbours else 0)]):
        jobs.append(schedule_job(f"dostune #{k + 1}", rec, None))
    # a neighbour that is one of the best schedules already runs as that one
    running = [(job[3], job[4]) for job in jobs]
    jobs += [schedule_job(f"neighbour: {label}", rec, label) for label, rec in neighbours
             if (rec.sub_group_size, rec.schedule) not in running]
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
    rows = [row(label, method, sgs, schedule, predicted, pooled[label], near)
            for label, method, _, sgs, schedule, predicted, near in jobs if label in pooled and pooled[label].ran]
    ratio, best = regret(rows) if neighbours else (None, None)
    return ValidationRun(rows=rows, bench=bench_record(opts, result.params, pooled), stopped=stopped, regret=ratio,
                         regret_best=best)


def runs_regime(result: TuneResult, clip: float) -> Optional[str]:
    """The regime of runs that clip at ``clip`` (0: off), by the model profile's gradient norms that ``result``
    keeps; None where they are unknown (each row then holds the prediction the schedule was scored by)."""
    return regime_at(result.profile_grad_norms or [], clip)


def regret(rows: Sequence[Validation], pick: str = "dostune #1") -> tuple[Optional[float], Optional[str]]:
    """(the pick's measured iteration over the best measured of the dostune rows, that row's label); (None, None)
    where the pick did not run."""
    measured = {v.label: v.measured_iter_s for v in rows if v.method == "dostune"}
    if pick not in measured:
        return None, None
    best = min(measured, key=measured.get)
    return measured[pick] / measured[best], best


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
    if res.validation_clip and res.validation and runs_regime(res, res.validation_clip) is None:
        out.append(f"the validation clipped at {res.validation_clip:g}, and the model profile recorded no gradient "
                   "norm to tell whether its steps clip there: each row stands beside the prediction its schedule was "
                   "scored by; profile the model again with this dostune to compare each with its own regime")
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
