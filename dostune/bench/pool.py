"""One bench method's results made one: the ranks of a run under DeepSpeed's launcher (the slowest rank's pace), and
the rounds of a bench or a validation (every round's timed iterations pooled)."""
from __future__ import annotations

from ..records import SetAside
from ..stats import Stat
from .record import MethodResult, RankFigures


def combine_ranks(results: list[MethodResult]) -> MethodResult:
    """Every rank's result of one method as one: the slowest rank's (longest median iteration) with the highest
    peak memory of any rank and each rank's figures; a rank that failed makes the method a failure."""
    failed = next(((k, r) for k, r in enumerate(results) if not r.ran), None)
    if failed is not None:
        return failed[1].model_copy(update={"error": f"on rank {failed[0]}: {failed[1].error}"})
    ranks = [RankFigures(rank=k, iter_s=r.iter_s, fwd_s=r.fwd_s, bwd_s=r.bwd_s, step_s=r.step_s,
                         peak_gpu_gib=r.peak_gpu_gib, host_peak_rss_gib=r.host_peak_rss_gib)
             for k, r in enumerate(results)]
    slowest = max(range(len(results)), key=lambda k: results[k].iter_s)
    peaks = [r.peak_gpu_gib for r in results if r.peak_gpu_gib is not None]
    phase_peak = {ph: max(r.phase_peak_gib.get(ph, 0.0) for r in results) for ph in results[slowest].phase_peak_gib}
    # the ranks of one node share its CPUs; across nodes, the most stolen-from is the one that says most (the ranks
    # agreed on which iterations to set aside, QuietRuns, so the slowest rank's set_aside holds for all)
    steal = max((r.steal for r in results if r.steal is not None), default=None)
    return results[slowest].model_copy(update=dict(ranks=ranks, slowest_rank=slowest, phase_peak_gib=phase_peak,
                                                   peak_gpu_gib=max(peaks) if peaks else None, steal=steal,
                                                   round_steal=[steal] if steal is not None else [],
                                                   **_highest(results, "host_peak_rss_gib", "host_pinned_gib")))


def _highest(results: list[MethodResult], *fields: str) -> dict:
    """Each field's highest value over ``results`` (None where none has one)."""
    return {f: max((x for r in results if (x := getattr(r, f)) is not None), default=None) for f in fields}


def pool_rounds(rounds: list[MethodResult]) -> MethodResult:
    """One method's result over all rounds: medians and spread of every round's timed iterations together, the
    highest peak memory, the last round's timeline; the first round's losses (every round starts from the same
    seed). A round that failed makes the method's result that failure."""
    failed = next((r for r in rounds if not r.ran), None)
    if failed is not None or len(rounds) == 1:
        return failed or rounds[0]
    first = rounds[0]
    samples = {k: [x for r in rounds for x in r.samples.get(k, [])] for k in ("fwd", "bwd", "step", "iter")}
    stats = {k: Stat.of(v) for k, v in samples.items()}
    peaks = [r.peak_gpu_gib for r in rounds if r.peak_gpu_gib is not None]
    phase_peak = {k: max(r.phase_peak_gib.get(k, 0.0) for r in rounds) for k in first.phase_peak_gib}
    before = [r.allocated_before_gib for r in rounds if r.allocated_before_gib is not None]
    rate = first.update_gelem_s * first.step_s / stats["step"].median if first.update_gelem_s else None
    # rounds time the same number of iterations of the same work, so each weighs about the same
    steal = [x for r in rounds for x in r.round_steal]
    return first.model_copy(update=dict(
        iter_s=stats["iter"].median, fwd_s=stats["fwd"].median, bwd_s=stats["bwd"].median,
        step_s=stats["step"].median, iter=stats["iter"], fwd=stats["fwd"], bwd=stats["bwd"], step=stats["step"],
        peak_gpu_gib=max(peaks) if peaks else None, phase_peak_gib=phase_peak,
        allocated_before_gib=max(before) if before else None,
        update_gelem_s=round(rate, 3) if rate else None, timeline=rounds[-1].timeline, samples=samples,
        round_iter_s=[x for r in rounds for x in r.round_iter_s],
        round_step_s=[x for r in rounds for x in r.round_step_s], round_steal=steal,
        swing=[x for r in rounds for x in r.swing],
        steal=round(sum(steal) / len(steal), 4) if steal else None,
        set_aside=SetAside.of([r.set_aside for r in rounds]),
        **_highest(rounds, "host_peak_rss_gib", "host_pinned_gib")))
