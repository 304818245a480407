"""`dostune check`: compare a bench result (or a CPU gate run) with a stored baseline, as a CI gate.

Three kinds of comparison:
* absolute: per method and phase (forward, backward, step, iteration), current / baseline median time.
  Meaningful on the same machine only.
* relative: dostune's speedup over ZeRO-Offload, measured within one run, so it survives a change of
  machine or a noisy one (``ratio_only``).

* the CPU gate (bench/gate.py): this tree's optimizer step over a pinned commit's, timed in one run, taking
  turns; each step against the one beside it, the median of those ratios, and the run measures until the median's
  confidence interval lies clear of the tolerance (or a cap), so the tolerance alone decides (``compare_gate``).

Noise rule (bench results): a slowdown is a regression only when it exceeds both the tolerance and the measured spread
(half the interquartile range of each run's samples, relative to its median, added together; the half
min-max range for results recorded with too few samples for quartiles).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from xml.etree import ElementTree as ET

from ..errors import DostuneError
from ..stats import Stat
from . import gate
from .gate import GateBaseline, GateRun
from .gate_statistic import settled
from .record import BenchResult

PHASES = ("fwd", "bwd", "step", "iter")
IDENTITY = ("model", "params", "micro_batch", "seq", "precision", "world_size")


class UnusableInput(DostuneError):
    exit_code = 2


@dataclass
class Finding:
    name: str  # e.g. "dostune/step" or "speedup/iter"
    baseline: float
    current: float
    ratio: float  # current / baseline, oriented so that > 1 is worse
    noise: float  # relative spread both runs show
    repeats: tuple[int, int]
    regression: bool
    note: str = ""


@dataclass
class CheckReport:
    tolerance: float
    ratio_only: bool
    findings: list[Finding] = field(default_factory=list)

    @property
    def regressions(self) -> list[Finding]:
        return [f for f in self.findings if f.regression]

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0


def _judge(name: str, base: float, cur: float, worse_ratio: float, noise: float, repeats, tol: float,
           note: str = "") -> Finding:
    slower_by = worse_ratio - 1.0
    return Finding(name=name, baseline=base, current=cur, ratio=worse_ratio, noise=noise, repeats=repeats,
                   regression=slower_by > tol and slower_by > noise, note=note)


def identity_mismatch(base: BenchResult, cur: BenchResult, ratio_only: bool) -> Optional[str]:
    fields = IDENTITY + (() if ratio_only else ("node",))
    for f in fields:
        if getattr(base, f) != getattr(cur, f):
            return f"field '{f}' differs: baseline {getattr(base, f)!r}, current {getattr(cur, f)!r}"
    return None


def _speedup(res: BenchResult, phase: str) -> Optional[tuple[float, float, int]]:
    """ZeRO-Offload's median over dostune's, its relative spread, and the repeats behind it."""
    z, d = res.methods.get("zero-offload"), res.methods.get("dostune")
    if not (z and d and z.ran and d.ran):
        return None
    zs, ds = getattr(z, phase), getattr(d, phase)
    if zs is None or ds is None:
        return None
    return zs.median / ds.median, zs.rel_iqr + ds.rel_iqr, min(zs.n, ds.n)


def check_tolerance(tolerance: float) -> None:
    if not 0 <= tolerance < 10:
        raise UnusableInput(f"--max-regression must be a fraction like 0.05 (5%), got {tolerance}")


def compare(base: BenchResult, cur: BenchResult, tolerance: float, ratio_only: bool = False) -> CheckReport:
    check_tolerance(tolerance)
    why = identity_mismatch(base, cur, ratio_only)
    if why:
        raise UnusableInput(f"the results are not comparable: {why}")
    rep = CheckReport(tolerance=tolerance, ratio_only=ratio_only)
    if not ratio_only:
        for name, bm in base.methods.items():
            cm = cur.methods.get(name)
            if cm is None or not bm.ran:
                continue
            if not cm.ran:
                rep.findings.append(Finding(name=f"{name}/iter", baseline=bm.iter_s or 0, current=float("inf"),
                                            ratio=float("inf"), noise=0.0, repeats=(bm.iter.n if bm.iter else 0, 0),
                                            regression=True, note=f"did not run: {(cm.error or '').splitlines()[0]}"))
                continue
            for ph in PHASES:
                b, c = getattr(bm, ph), getattr(cm, ph)
                if not (isinstance(b, Stat) and isinstance(c, Stat)) or b.median <= 0:
                    continue
                rep.findings.append(_judge(f"{name}/{ph}", b.median, c.median, c.median / b.median,
                                           b.rel_iqr + c.rel_iqr, (b.n, c.n), tolerance))
    for ph in ("step", "iter"):
        b, c = _speedup(base, ph), _speedup(cur, ph)
        if b is None:
            continue
        if c is None:
            rep.findings.append(Finding(name=f"speedup/{ph}", baseline=b[0], current=0.0, ratio=float("inf"),
                                        noise=0.0, repeats=(b[2], 0), regression=True,
                                        note="the current run has no dostune vs zero-offload pair"))
            continue
        rep.findings.append(_judge(f"speedup/{ph}", b[0], c[0], b[0] / c[0], b[1] + c[1], (b[2], c[2]), tolerance,
                                   note="dostune vs ZeRO-Offload, measured within each run"))
    if not rep.findings:
        raise UnusableInput("nothing to compare: the baseline and the current result share no method that ran")
    return rep


def compare_gate(base: GateBaseline, run: GateRun, tolerance: float) -> CheckReport:
    """The CPU gate: a regression when this tree's step took more than ``tolerance`` longer than the pinned
    commit's, both measured in the same run, taking turns (the ratio on an unchanged tree is 1)."""
    check_tolerance(tolerance)
    s = base.settings
    pairs = len(run.current_cpu_s)
    if settled(run.low, run.high, tolerance):
        how = f"clear of the {tolerance:.0%} tolerance"
    else:
        how = f"not clear of the tolerance after {pairs} turns, the most a run takes: judged on the median"
    note = (f"this tree's optimizer step over commit {base.baseline_commit[:12]}'s, CPU time: each step against the "
            f"pinned commit's step beside it, median over {pairs} turns ({run.rounds} round(s) of {s.pairs}); "
            f"{s.confidence:.0%} interval {run.low:.3f} to {run.high:.3f}, {how} (wall clock: {run.wall_ratio:.3f})")
    rep = CheckReport(tolerance=tolerance, ratio_only=True)
    rep.findings.append(Finding(name="gate/step", baseline=1.0, current=run.ratio, ratio=run.ratio, noise=run.noise,
                                repeats=(len(run.baseline_cpu_s), len(run.current_cpu_s)),
                                regression=run.ratio - 1 > tolerance, note=note))
    return rep


def check_gate(base: GateBaseline, tolerance: float, progress=None) -> tuple[CheckReport, GateRun]:
    """Run the CPU gate and judge it: (the report, the run). The run measures until its interval is clear of the
    tolerance (bench/gate.py), so on a busy machine it takes longer rather than guess."""
    check_tolerance(tolerance)
    run = gate.run_gate(base, tolerance, progress)
    return compare_gate(base, run, tolerance), run


def junit_xml(rep: CheckReport) -> str:
    suite = ET.Element("testsuite", name="dostune-check", tests=str(len(rep.findings)),
                       failures=str(len(rep.regressions)))
    for f in rep.findings:
        case = ET.SubElement(suite, "testcase", classname="dostune.check", name=f.name)
        if f.regression:
            worse = "missing" if f.ratio == float("inf") else f"worse by {f.ratio - 1:.1%}"
            fail = ET.SubElement(case, "failure", message=f"{worse} (tolerance {rep.tolerance:.0%}, "
                                                          f"noise {f.noise:.1%})")
            fail.text = f"baseline {f.baseline:.6g}, current {f.current:.6g}; {f.note}".strip()
    return ET.tostring(suite, encoding="unicode")
