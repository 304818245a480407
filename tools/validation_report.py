"""The performance model checked across models: reads the tune.json of `dostune tune --validate` runs (one per
model) and writes one table: per model, the median iteration and step errors (relative, and in ms) of dostune's
validated schedules and of ZeRO-Offload, against the bounds the model is held to, and how far the host drifted between
profile and validation (TuneResult.host_drift), with the share of CPU time the hypervisor took in the profile and in
the validated runs, and the timed iterations each set aside for it, how far each row's rounds (each a fresh process)
were apart, each round held to the bounds as the prediction of the others, and in how many rows adaptive_swing ran
another split than the predicted one, where they recorded them.

    python -m tools.validation_report runs/gpu/validate-*/tune.json [--output report.md]

With --repredict, the rows are the same measurements beside what today's model predicts from the same profiles
(tools/repredict.py), instead of the predictions recorded with the model of the validation's day; with
--profiles NODE MODEL too, from those two profiles instead (one model's files).

Exit status 0 when every model is within the bounds, 1 when one is not (the table says which), 2 on a bad file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from dostune.errors import DostuneError
from dostune.host_steal import QUIET_BELOW
from dostune.records import atomic_write_text, read_json_record
from dostune.tune.record import TuneResult, Validation, median, relative_error

# per model, the median error over its validated rows of each method
ITER_BOUND, STEP_BOUND = 0.10, 0.20
METHODS = ("dostune", "zero-offload")


# the held-out shapes' registry lived in examples/ when most validations were measured, and their records name it
_OLD_SHAPES, _SHAPES = "examples.validation_shapes:", "tools.validation_shapes:"


def load(path: "str | Path") -> TuneResult:
    data = read_json_record(path, "tuning result")
    if isinstance(data.get("model"), str) and data["model"].startswith(_OLD_SHAPES):
        data["model"] = _SHAPES + data["model"][len(_OLD_SHAPES):]
    try:
        return TuneResult.model_validate(data)
    except ValueError as e:
        raise DostuneError(f"{path} is not a dostune tuning result: {str(e).splitlines()[0]}") from None


def within(iter_error: Optional[float], step_error: Optional[float]) -> Optional[bool]:
    """Whether a model's median errors are within the bounds (None when either is unknown)."""
    if iter_error is None or step_error is None:
        return None
    return iter_error <= ITER_BOUND and step_error <= STEP_BOUND


def repeat_error(v: Validation, phase: str, k: int) -> Optional[float]:
    """Round ``k`` of ``v`` (iter or step) taken as the prediction of the median of its other rounds (None with fewer
    than two rounds, or no round ``k``): how closely one process of the schedule predicts another on the same host
    minutes later. The model reads its inputs from one profile process, so this is about as close as it can be held."""
    xs = getattr(v, f"measured_round_{phase}_s")
    if not xs or len(xs) < 2 or k >= len(xs):
        return None
    return relative_error(xs[k], median(xs[:k] + xs[k + 1:]))


def repeat_median_error(res: TuneResult, phase: str, method: str, k: int) -> Optional[float]:
    """The median over ``method``'s rows of their round ``k`` taken as the prediction of their other rounds; None
    unless every such row ran that round and another, so that it is the same rows the model is held on."""
    errors = [repeat_error(v, phase, k) for v in res.validation if v.method == method]
    return None if not errors or None in errors else median(errors)


def summarize(results: list[TuneResult]) -> list[dict]:
    """One row per model and method with validated rows: their count, median iteration and step errors (relative,
    and in seconds), whether they are within the bounds (which are relative), and whether the first and the second
    round, each taken as the prediction of the row's other rounds, are (``repeat``: None for a method whose rows did
    not all run two rounds)."""
    out = []
    for index, res in enumerate(results):
        for method in METHODS:
            n = sum(1 for v in res.validation if v.method == method)
            if not n:
                continue
            it, st = res.median_error("iter", method), res.median_error("step", method)
            recorded = [v for v in res.validation if v.method == method and v.measured_swing is not None]
            out.append({"model": res.model, "params": res.params, "method": method, "rows": n, "iter": it,
                        "step": st, "iter_s": res.median_error_s("iter", method),
                        "step_s": res.median_error_s("step", method),
                        "bwd": res.median_error("bwd", method), "drift": res.host_drift("iter"),
                        "steal": (res.profile_steal, res.validation_steal()),
                        "set_aside": (res.profile_set_aside, res.validation_set_aside()),
                        "rounds_apart": (res.round_spread("iter", method), res.round_spread("step", method)),
                        "swung": (sum(v.swung() is not None for v in recorded), len(recorded)) if recorded else None,
                        "ok": within(it, st) is True, "index": index,
                        "repeat": tuple(within(repeat_median_error(res, "iter", method, k),
                                               repeat_median_error(res, "step", method, k)) for k in (0, 1))})
    return out


def tally(rows: list[dict]) -> dict:
    """Per validation with both methods: how many are within both bounds for both, by the prediction; and of those
    whose every row ran two rounds or more, how many by the prediction and by one round taken as the prediction of
    the others (the first round, the second): how often a prediction as close as a second process of the same
    schedule, minutes later on the same host, would meet the bounds."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["index"], []).append(r)
    both = [rs for rs in by.values() if {r["method"] for r in rs} == set(METHODS)]
    repeated = [rs for rs in both if all(None not in r["repeat"] for r in rs)]
    return {"models": len(both), "within": sum(all(r["ok"] for r in rs) for rs in both),
            "repeated": len(repeated), "repeated_within": sum(all(r["ok"] for r in rs) for rs in repeated),
            "repeat_within": tuple(sum(all(r["repeat"][k] for r in rs) for rs in repeated) for k in (0, 1))}


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _pct_ms(x: Optional[float], seconds: Optional[float]) -> str:
    return _pct(x) if seconds is None else f"{_pct(x)} ({1e3 * seconds:.0f} ms)"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown(rows: list[dict], repredicted: bool = False) -> str:
    # results from before the steal was recorded keep their table as it was
    steal = any(x is not None for r in rows for x in r.get("steal", ()))
    aside = any(x is not None for r in rows for x in r.get("set_aside", ()))
    apart = any(x is not None for r in rows for x in r.get("rounds_apart", ()))
    swing = any(r.get("swung") is not None for r in rows)
    repeat = any(x is not None for r in rows for x in r.get("repeat", ()))
    lines = [f"Median relative errors of `dostune tune --validate` per model (bounds: iteration <= {ITER_BOUND:.0%}, "
             f"step <= {STEP_BOUND:.0%})"
             + (", re-predicted by today's model from each validation's profiles: shapes the model was since "
                "changed for are not unseen" if repredicted else ""), "",
             "Iteration and step: the median relative error over the model's rows, and the median absolute error "
             "(ms). Host drift: ZeRO-Offload's validated iteration over the model profile's measurement of it: how far "
             "the host moved since its profile, with one process's spread against another's, or, where the profile was "
             "taken on another machine, how far the two differ. Every row of that model holds a move of that size, "
             "whatever the model."
             + (" Host steal: the share of CPU time the hypervisor took while the model profile timed its iterations, "
                "and over the validated runs." if steal else "")
             + (f" Set aside: timed iterations the hypervisor took more than {QUIET_BELOW:.0%} of the CPU from, each "
                "run again." if aside else "")
             + (" Rounds apart: per row, how much longer its slowest round took than its fastest, each round a fresh "
                "process running the same schedule; the median over the model's rows, iteration / step. Errors of "
                "that size are the measurement's own." if apart else "")
             + (" Swing moved: of the rows that recorded adaptive_swing's split, those that ran with GPU-lane subgroups "
                "moved to the CPU lane in a timed iteration; the model predicts the tuned split, so their step is "
                "another split's." if swing else "")
             + (" A round as the other's: the first round's medians, then the second's, each taken as the prediction "
                "of the row's other rounds (fresh processes minutes apart on the same host) and held to the same "
                "bounds over the model's rows; '-' where a row ran one round."
                if repeat else ""), "",
             "| model | parameters | method | rows | iteration | step | backward | within | host drift |"
             + (" host steal, profile / runs |" if steal else "") + (" set aside, profile / runs |" if aside else "")
             + (" rounds apart |" if apart else "") + (" swing moved |" if swing else "")
             + (" a round as the other's |" if repeat else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if steal else "") + ("---|" if aside else "")
             + ("---|" if apart else "") + ("---|" if swing else "") + ("---|" if repeat else "")]
    for r in rows:
        line = (f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['method']} | {r['rows']} | "
                f"{_pct_ms(r['iter'], r['iter_s'])} | {_pct_ms(r['step'], r['step_s'])} | {_pct(r['bwd'])} | "
                f"{'yes' if r['ok'] else 'NO'} | {_ratio(r['drift'])} |")
        if steal:
            line += f" {_pct(r['steal'][0])} / {_pct(r['steal'][1])} |"
        if aside:
            line += " " + " / ".join("-" if x is None else str(x) for x in r["set_aside"]) + " |"
        if apart:
            line += f" {_pct(r['rounds_apart'][0])} / {_pct(r['rounds_apart'][1])} |"
        if swing:
            line += " - |" if r.get("swung") is None else " {} of {} |".format(*r["swung"])
        if repeat:
            line += " " + " / ".join({True: "yes", False: "NO", None: "-"}[x] for x in r["repeat"]) + " |"
        lines.append(line)
    t = tally(rows)
    if t["models"] > 1:
        lines += ["", f"Within both bounds for both methods: {t['models']} validations, {t['within']} by the "
                  "prediction."
                  + (f" Of the {t['repeated']} whose every row ran two rounds or more: {t['repeated_within']} by the "
                     f"prediction, {t['repeat_within'][0]} with the first round as the prediction of the others and "
                     f"{t['repeat_within'][1]} with the second." if t["repeated"] else "")]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.validation_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="tune.json files written by dostune tune --validate")
    ap.add_argument("--output", type=Path, help="also write the table to this file")
    ap.add_argument("--repredict", action="store_true", help="put today's model's predictions, from each "
                    "validation's own profiles, beside its measurements")
    ap.add_argument("--profiles", nargs=2, type=Path, metavar=("NODE", "MODEL"), help="with --repredict: predict "
                    "from this node profile and model profile instead of each validation's own")
    args = ap.parse_args(argv)
    if args.profiles and not args.repredict:
        ap.error("--profiles goes with --repredict")
    try:
        results = [load(p) for p in args.results]
        if args.profiles:
            from tools.repredict import repredict

            models = {r.model for r in results}
            if len(models) > 1:
                raise DostuneError(f"--profiles holds one model's profile, the files are of {len(models)} models")
            results = [repredict(r, *args.profiles) for r in results]
        elif args.repredict:
            from tools.repredict import repredict_file

            results = [repredict_file(p, r) for p, r in zip(args.results, results)]
        rows = summarize(results)
    except DostuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = markdown(rows, repredicted=args.repredict)
    print(text, end="")
    if args.output is not None:
        atomic_write_text(args.output, text)
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
