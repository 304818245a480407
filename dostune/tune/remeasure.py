"""A committed validation measured again on this host: ZeRO-Offload and the schedules of a `dostune tune --validate`
result run once more, by the same path (tune/validate.py), and written as a tune.json of the same form whose rows
hold the new measurements beside the predictions recorded with them.

Whether a miss is the model's or the measurement's shows when the same rows are measured on another host or another
day, and predicted from profiles taken there: `validation_report --repredict --profiles NODE MODEL` reads the file
this writes with the profiles given instead of the recorded ones (docs/experiments.md, section 24).

    python -m dostune.tune.remeasure results/h100/heldout-6/llama_1_2b.json --rounds 3 --output rows.json

Exit status 0 when it wrote the file, 2 on a bad file or a machine that cannot run it (no CUDA GPU).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path
from typing import Optional

from ..errors import DostuneError
from ..invocation import invocation
from ..profile.timing import LineProgress, ProgressSink
from ..records import atomic_write_text
from .record import TuneResult
from .validate import Runner, validate
from .validation_report import load


def remeasure(result: TuneResult, rounds: int, runner: Optional[Runner] = None,
              host_available: Optional[int] = None, progress: Optional[ProgressSink] = None) -> TuneResult:
    """``result`` with its validated rows measured again (as many schedules as it validated, ``rounds`` rounds);
    the predictions are the ones ``result`` recorded for them."""
    if not result.validation:
        raise DostuneError("this tune.json holds no validated rows to measure again",
                           hint="it comes from dostune tune --validate N")
    schedules = sum(v.method == "dostune" for v in result.validation)
    run = validate(result, schedules, seq=result.seq, rounds=rounds, runner=runner, host_available=host_available,
                   progress=progress)
    if not run.rows:
        raise DostuneError("no row could be measured again (each method failed: see its error in the bench)")
    return result.model_copy(update={
        "validation": run.rows, "validation_bench": None, "validation_figure": None,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "command": invocation(),
        "notes": result.notes + [f"measured again from {result.created}'s validation"
                                 + (f"; {run.stopped}" if run.stopped else "")]})


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dostune.tune.remeasure", description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a tune.json written by dostune tune --validate")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each method a fresh process each round "
                    "(default 2, as tune --validate)")
    ap.add_argument("--output", type=Path, required=True, help="the tune.json to write")
    args = ap.parse_args(argv)
    try:
        # minutes per method and round: a line as each starts, for a log
        again = remeasure(load(args.result), args.rounds, progress=LineProgress())
    except DostuneError as e:
        print(f"error: {e}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        return 2
    atomic_write_text(args.output, again.model_dump_json(indent=1))
    print(f"{len(again.validation)} rows measured again: {args.output}")
    return 0


if __name__ == "__main__":  # the methods run in spawned processes, which import this module again
    sys.exit(main())
