"""The performance model's predictions for fixed models and schedules on the shipped profiles, pinned in
``tests/data/predicted-times.json``: the file declares each case's inputs beside what the model predicted for them,
and tests/test_predicted_times.py fails, naming what moved, when a change moves a prediction. A change meant to move
them rewrites the file (and says why in its commit message):

    python -m tools.predicted_times --write tests/data/predicted-times.json
    python -m tools.predicted_times --check tests/data/predicted-times.json   # exit 1 and the list when any moved

The file names the shipped node profile every case is predicted on ("node_profile"), so that a new default node
profile does not move the pinned predictions. A case is added by adding its inputs to the file's "cases" (model,
model_profile: a file of the shipped profiles folder or null for the node profile alone, sub_group_size, schedule:
ScheduleConfig fields, gpu_memory_budget) and writing the file. The predictions go through the tuner's own entry
points (``build_space`` and ``Space.predict_schedule``), so what is pinned is what `dostune tune` scores, whatever the
model looks like inside.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Optional

from dostune.optim.schedule import ScheduleConfig
from dostune.profile.paths import profiles_dir

PINNED_FILE = Path(__file__).resolve().parents[1] / "tests" / "data" / "predicted-times.json"
UPDATE_COMMAND = "python -m tools.predicted_times --write tests/data/predicted-times.json"
# Floating point alone may differ in the last bits between machines (numpy's transcendental functions)
REL_TOL = 1e-9
INPUTS = ("model", "model_profile", "sub_group_size", "schedule", "gpu_memory_budget")


@functools.lru_cache(maxsize=None)
def _space(node_profile: str, model: str, model_profile: Optional[str], gpu_memory_budget: str):
    from dostune.tune.search import TuneOptions, build_space

    folder = profiles_dir()
    opts = TuneOptions(model=model, profile=folder / node_profile,
                       model_profile=folder / model_profile if model_profile else None,
                       gpu_memory_budget=gpu_memory_budget)
    return build_space(opts)[0]


def predict_case(node_profile: str, case: dict) -> dict:
    """The case's predicted step and iteration seconds (iteration: None without a model profile) and subgroups, on the
    shipped node profile ``node_profile``, in the regime without clipping, and the step, iteration and lane balance's
    swing in the regime with it (clip_*)."""
    space = _space(node_profile, case["model"], case.get("model_profile"), case.get("gpu_memory_budget", "auto"))
    sched = ScheduleConfig(**case.get("schedule", {}))
    p = space.predict_schedule(case["sub_group_size"], sched)
    c = space.predict_schedule(case["sub_group_size"], sched, "clip")
    return {"step_s": p.step_s, "iter_s": p.iter_s, "subgroups": len(p.sizes), "clip_step_s": c.step_s,
            "clip_iter_s": c.iter_s, "clip_swing": c.swing}


def compute(pinned: dict) -> dict:
    """``pinned`` with every case's predictions made again from its inputs."""
    node = pinned["node_profile"]
    cases = {name: {**{k: c[k] for k in INPUTS if k in c}, "predicted": predict_case(node, c)}
             for name, c in pinned["cases"].items()}
    return {"node_profile": node, "update_with": UPDATE_COMMAND, "cases": cases}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=0.0)
    return a == b


def moved(pinned: dict, current: dict) -> list[str]:
    """One line per prediction that differs between the pinned file and now (and per case added or removed)."""
    out = []
    old, new = pinned.get("cases", {}), current.get("cases", {})
    for name in sorted(set(old) - set(new)):
        out.append(f"{name}: pinned but no longer computed")
    for name in sorted(set(new) - set(old)):
        out.append(f"{name}: computed but not pinned")
    for name in sorted(set(old) & set(new)):
        a, b = old[name].get("predicted") or {}, new[name]["predicted"]
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if _same(x, y):
                continue
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x:
                out.append(f"{name}: {key} {x:.6g} -> {y:.6g} ({y / x - 1:+.3%})")
            else:
                out.append(f"{name}: {key} {x!r} -> {y!r}")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.predicted_times", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, nargs="?", const=PINNED_FILE, metavar="FILE",
                      help="recompute the file's cases and write their predictions into it")
    mode.add_argument("--check", type=Path, nargs="?", const=PINNED_FILE, metavar="FILE",
                      help="recompute and compare; exit 1 if any moved")
    args = ap.parse_args(argv)
    path = args.write or args.check
    pinned = json.loads(path.read_text())
    current = compute(pinned)
    if args.write is not None:
        from dostune.records import atomic_write_text

        atomic_write_text(path, json.dumps(current, indent=2, sort_keys=True) + "\n")
        print(f"wrote {len(current['cases'])} pinned predictions to {path}")
        return 0
    lines = moved(pinned, current)
    for line in lines:
        print(line)
    print(f"{len(lines)} prediction(s) moved" if lines else "no prediction moved")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
