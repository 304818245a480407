"""The performance model's predictions for a fixed set of models and schedules on the shipped profiles, pinned in
``tests/data/predicted-times.json``: a change that moves a predicted time must say so by regenerating that file
(tests/test_predicted_times.py fails otherwise, naming what moved).

    python -m dostune.bench.predicted --write tests/data/predicted-times.json

The predictions go through the tuner's own entry points (``build_space`` and ``Space.predict_schedule``), so what
is pinned is what `dostune tune` scores, whatever the performance model looks like inside.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..optim.schedule import ScheduleConfig
from ..profile.paths import SHIPPED_NODE, profiles_dir

PINNED_FILE = "tests/data/predicted-times.json"
UPDATE_COMMAND = f"python -m dostune.bench.predicted --write {PINNED_FILE}"
# Floating point alone may differ in the last bits between machines (numpy's transcendental functions)
REL_TOL = 1e-9


@dataclass(frozen=True)
class Case:
    model: str
    model_profile: Optional[str]  # a file in the shipped profiles folder; None: node profile only (step time alone)
    sub_group_size: int
    schedule: dict = field(default_factory=dict)  # ScheduleConfig fields
    gpu_memory_budget: str = "auto"  # needs a model profile; GiB otherwise

    @property
    def name(self) -> str:
        sched = ",".join(f"{k}={v}" for k, v in sorted(self.schedule.items())) or "defaults"
        return f"{self.model}/sgs={self.sub_group_size:g}/{sched}"


_GPT2_1_3B = "h100-pcie5-gpt2-1.3b-b8-s1024.json"
_GPT2_2_7B = "h100-pcie5-gpt2-2.7b-b8-s1024.json"
# Each schedule feature the model prices: lanes, placement, staging, upload, where gradients stay, overlap with
# backward, resident subgroups, adaptive swing; two sub_group_sizes.
SCHEDULES = (
    {"gpu_fraction": 0.0},
    {"gpu_fraction": 0.25},
    {"gpu_fraction": 0.5, "gpu_placement": "spread", "staging_buffers": 3, "upload": "cpu_convert",
     "grads_on_gpu": False},
    {"gpu_fraction": 0.4, "overlap_backward": True},
    {"gpu_fraction": 0.4, "overlap_backward": True, "resident_subgroups": 1},
    {"gpu_fraction": 0.5, "overlap_backward": True, "adaptive_swing": 3, "cpu_threads": 8},
)
CASES = tuple(
    [Case(m, p, 100_000_000, s) for m, p in (("gpt2-1.3b", _GPT2_1_3B), ("gpt2-2.7b", _GPT2_2_7B)) for s in SCHEDULES]
    + [Case("gpt2-1.3b", _GPT2_1_3B, 25_000_000, s) for s in SCHEDULES[1::2]]
    + [Case("llama-1.1b", None, 100_000_000, s, gpu_memory_budget="20") for s in SCHEDULES[:2]]
)


@functools.lru_cache(maxsize=None)
def _space(model: str, model_profile: Optional[str], gpu_memory_budget: str):
    from ..tune.search import TuneOptions, build_space

    folder = profiles_dir()
    opts = TuneOptions(model=model, profile=folder / SHIPPED_NODE,
                       model_profile=folder / model_profile if model_profile else None,
                       gpu_memory_budget=gpu_memory_budget)
    return build_space(opts)[0]


def predict_case(case: Case) -> dict:
    """The case's predicted step and iteration seconds (iteration: None without a model profile) and subgroups."""
    space = _space(case.model, case.model_profile, case.gpu_memory_budget)
    p = space.predict_schedule(case.sub_group_size, ScheduleConfig(**case.schedule))
    return {"step_s": p.step_s, "iter_s": p.iter_s, "subgroups": len(p.sizes)}


def compute() -> dict:
    """What the pinned file holds: every case's inputs and predictions."""
    return {"node_profile": SHIPPED_NODE, "update_with": UPDATE_COMMAND,
            "cases": {c.name: {"model": c.model, "model_profile": c.model_profile, "sub_group_size": c.sub_group_size,
                               "schedule": c.schedule, "gpu_memory_budget": c.gpu_memory_budget,
                               "predicted": predict_case(c)} for c in CASES}}


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
        a, b = old[name].get("predicted", {}), new[name]["predicted"]
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
    ap = argparse.ArgumentParser(prog="python -m dostune.bench.predicted", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, metavar="FILE", help="recompute and write the pinned predictions")
    mode.add_argument("--check", type=Path, metavar="FILE", help="recompute and compare; exit 1 if any moved")
    args = ap.parse_args(argv)
    current = compute()
    if args.write is not None:
        from ..records import atomic_write_text

        atomic_write_text(args.write, json.dumps(current, indent=2, sort_keys=True) + "\n")
        print(f"wrote {len(current['cases'])} pinned predictions to {args.write}")
        return 0
    lines = moved(json.loads(args.check.read_text()), current)
    for line in lines:
        print(line)
    print(f"{len(lines)} prediction(s) moved" if lines else "no prediction moved")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
