"""Where a validated step's miss lies: each dostune row's traced step (the last timed step of its last round, kept
in the validation's bench record) beside the spans today's model predicts for it from the validation's own profiles.

Per row, in the step's own clock (0 where DeepSpeed's step starts; spans before it ran during backward):

- when the lanes end: the model's after its prologue share of the step overhead, the trace's at its last span; the
  model's later end is the first part of its step error;
- what follows them: the model's rest of the overhead against the measured step's median less the traced last span; the
  second part (the two add up to the step error: predicted less measured);
- the CPU lane's seconds per element, the model's over the trace's, for the subgroups it took up during backward and
  for those it took up in the step.

    python -m tools.lane_check runs/gpu/validate-*/tune.json [--profiles NODE MODEL]

One traced step against the median of all the timed ones: a row's figures hold that step's own draw. The bench record
is found where tune recorded it or beside the tune.json as ``MODEL-bench.json`` (how committed validations keep it).
Exit status 0, or 2 on a bad file.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from dostune.bench.record import BenchResult, load_bench
from dostune.errors import DostuneError
from dostune.tune.record import TuneResult, median
from dostune.tune.space import Space
from tools.repredict import prediction_space, profiles_of, validated_schedule
from tools.validation_report import _ratio as _x, load


@dataclass
class LaneCheck:
    model: str
    label: str
    step_error_s: float  # predicted less measured step
    lanes_end_s: float  # the model's lanes end less the traced ones, from the step's start
    after_lanes_s: float  # the model's time after its lanes less the measured step's after the traced ones
    backward_rate: Optional[float]  # the CPU lane's seconds per element, model over trace, taken up during backward
    step_rate: Optional[float]  # the same for the subgroups taken up in the step


def seconds_per_element(spans: Sequence, sizes: Sequence[int], in_step: bool) -> Optional[float]:
    """The CPU lane's seconds per element over the subgroups it took up in the step (``in_step``) or before it."""
    mine = [s for s in spans if s.lane == "cpu" and (s.start >= 0) == in_step]
    elements = sum(sizes[s.subgroup] for s in mine)
    return sum(s.end - s.start for s in mine) / elements if elements else None


def _over(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def bench_of(result: TuneResult, path: Path) -> Path:
    recorded = Path(result.validation_bench) if result.validation_bench else None
    if recorded is not None and recorded.is_file():
        return recorded
    beside = path.with_name(f"{path.stem}-bench.json")
    if not beside.is_file():
        raise DostuneError(f"{path}: its validation's bench record is neither at {result.validation_bench} nor at "
                           f"{beside}")
    return beside


def compare(result: TuneResult, bench: BenchResult, space: Space) -> list[LaneCheck]:
    """The rows of ``result`` whose traced step in ``bench`` (its validation's record) has a CPU lane, against
    ``space``'s predictions (prediction_space, or the search's own)."""
    prologue = space.coeffs.shape.prologue_share
    out = []
    for v in result.validation:
        measured = bench.methods.get(v.label)
        traced = measured.timeline if measured is not None else []
        if v.method != "dostune" or not any(s.lane == "cpu" for s in traced):
            continue
        p = space.predict_schedule(v.sub_group_size, validated_schedule(v))
        step, sizes = p.step, p.sizes
        if max(s.subgroup for s in traced) >= len(sizes):
            raise DostuneError(f"{result.model}: {v.label}'s traced step has subgroups the model does not "
                               f"({len(sizes)})")
        traced_end = max(s.end for s in traced)
        out.append(LaneCheck(
            model=result.model, label=v.label, step_error_s=step.step_s - v.measured_step_s,
            lanes_end_s=prologue * step.overhead_s + step.lanes_s - traced_end,
            after_lanes_s=(1 - prologue) * step.overhead_s - (v.measured_step_s - traced_end),
            backward_rate=_over(seconds_per_element(step.spans, sizes, False),
                                 seconds_per_element(traced, sizes, False)),
            step_rate=_over(seconds_per_element(step.spans, sizes, True), seconds_per_element(traced, sizes, True))))
    return out


def check(path: "str | Path", profiles: Optional[tuple[Path, Path]] = None) -> list[LaneCheck]:
    """``compare`` for one tune.json, predicted from its own profiles or from ``profiles`` (node, model)."""
    path = Path(path)
    result = load(path)
    bench = load_bench(bench_of(result, path))
    return compare(result, bench, prediction_space(result, *(profiles or profiles_of(result, path)))[0])


def _ms(x: float) -> str:
    return f"{1e3 * x:+.0f} ms"


def markdown(rows: list[LaneCheck]) -> str:
    lines = ["| model | row | step error | = lanes' end | + after the lanes | CPU lane per element, model / traced: "
             "in backward | in the step |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.model} | {r.label} | {_ms(r.step_error_s)} | {_ms(r.lanes_end_s)} | {_ms(r.after_lanes_s)} | "
              f"{_x(r.backward_rate)} | {_x(r.step_rate)} |" for r in rows]
    if rows:
        lines.append(f"| median of {len(rows)} rows | | {_ms(median(r.step_error_s for r in rows))} | "
                     f"{_ms(median(r.lanes_end_s for r in rows))} | {_ms(median(r.after_lanes_s for r in rows))} | "
                     f"{_x(median(r.backward_rate for r in rows))} | {_x(median(r.step_rate for r in rows))} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.lane_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="tune.json files written by dostune tune --validate")
    ap.add_argument("--profiles", nargs=2, type=Path, metavar=("NODE", "MODEL"), help="predict from this node "
                    "profile and model profile instead of each validation's own")
    args = ap.parse_args(argv)
    try:
        rows = [r for p in args.results for r in check(p, args.profiles)]
    except DostuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
