"""`dostune check`: a CI gate on iteration time against a stored baseline (a bench result, or a CPU gate record)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..bench.check import IDENTITY, CheckReport, UnusableInput, check_gate, compare, identity_mismatch, junit_xml
from ..bench.record import load_bench
from ..dsconfig import DEFAULT_SUB_GROUP_SIZE
from ..errors import DostuneError, ProfileError
from ..records import atomic_write_text, check_writable
from .common import err_console, flag, handle_errors, need_deepspeed, parse_fraction, print_json, quiet_stdout


def _fraction(text: str) -> float:
    try:
        return parse_fraction(text, "--max-regression")
    except DostuneError as e:
        raise UnusableInput(str(e), hint=e.hint) from None


def change(f) -> str:
    """The value's own change, current against baseline: a time that grows reads +, a speedup that falls reads -
    (whether that is worse is the verdict column's job)."""
    if f.ratio == float("inf") or not f.baseline:
        return "missing"
    return f"{f.current / f.baseline - 1:+.1%}"


def _load(path: Path, what: str, gate: bool = False):
    from ..bench.gate import load_gate

    try:
        return load_gate(path) if gate else load_bench(path)
    except ProfileError as e:
        raise UnusableInput(f"{what}: {e}", hint=e.hint) from None


def _compare(base, cur, tol: float, ratio_only: bool, given: bool) -> CheckReport:
    """compare(), with a hint for results that are not comparable (``given``: --current named the result)."""
    try:
        return compare(base, cur, tol, ratio_only)
    except UnusableInput as e:
        if e.hint is not None or identity_mismatch(base, cur, ratio_only) is None:
            raise
        if all(getattr(base, f) == getattr(cur, f) for f in IDENTITY) and base.node != cur.node:
            hint = "for results of two machines, --ratio-only compares dostune's speedup over ZeRO-Offload"
        else:
            hint = "bench the current result with the baseline's model, batch, seq, precision and world" \
                   + (", or leave out --current: check then benches exactly that" if given else "")
        raise UnusableInput(str(e), hint=hint) from None


def _gate(baseline: Path, base, current: Optional[Path], tol: float, update: bool):
    """The CPU gate: run it now (this tree against the pinned commit) and judge the ratio: (report, what --json
    adds); with ``update``, pin this tree's commit instead (None)."""
    from ..bench.gate import pin
    from ..profile.timing import LineProgress

    if current is not None:
        raise UnusableInput("--current does not apply to a gate baseline: the gate measures both sides in one run",
                            hint="leave out --current")
    if update:
        new = pin("HEAD", settings=base.settings)
        atomic_write_text(baseline, new.model_dump_json(indent=2) + "\n")
        err_console.print(f"baseline {baseline} now pins {new.baseline_commit}")
        return None
    need_deepspeed("dostune check (the CPU gate)")
    rep, run = check_gate(base, tol, LineProgress())
    fields = {"ratio", "low", "high", "wall_ratio", "engine_ratios", "rounds", "lanes", "speculative", "slow_cpu_lane",
              "seconds"}
    summary = {**run.model_dump(include=fields), "noise": run.noise, "pairs": len(run.current_cpu_s)}
    return rep, {"gate": {"baseline_commit": base.baseline_commit, **summary}}


def _fresh_run(base, ratio_only: bool):
    """Bench again exactly what the baseline measured: model, batch, seed, sub_group_size and dostune schedule
    (only ZeRO-Offload and dostune when comparing speedups)."""
    from ..bench.run import BenchOptions, run_bench
    from ..tune.refit import TunedConfig

    methods = [m for m, r in base.methods.items() if r.ran]
    if ratio_only:
        methods = [m for m in methods if m in ("zero-offload", "dostune")]

    def tuned(name: str) -> TunedConfig:  # the DeepSpeed config the baseline ran the method with ({}: none)
        m = base.methods.get(name)
        return TunedConfig.read(m.ds_config if m is not None else {}, f"the baseline's {name} config")

    d, z = tuned("dostune"), tuned("zero-offload")
    sched = d.schedule.model_copy(update={"trace": False}) if d.schedule is not None else None
    sgs = lambda t: t.sub_group_size if t.sub_group_size_given else None  # noqa: E731
    opts = BenchOptions(model=base.model, micro_batch=base.micro_batch, seq=base.seq, precision=base.precision,
                        iters=base.iters, warmup=base.warmup, seed=base.seed, methods=methods, schedule=sched,
                        sub_group_size=sgs(z) or DEFAULT_SUB_GROUP_SIZE, dostune_sub_group_size=sgs(d),
                        dostune_world=d.world, node=base.node)
    from .common import progress_display

    with progress_display() as progress, quiet_stdout():
        return run_bench(opts, progress)


@handle_errors
def check(
    baseline: Path = typer.Option(..., help="Stored baseline: a `dostune bench` result JSON, or a CPU gate baseline "
                                  "(results/ci-cpu/gate.json)."),
    current: Optional[Path] = typer.Option(None, help="Result to check. Default: run `dostune bench` now with the "
                                           "baseline's model, batch, seed, methods and schedule (a gate baseline: "
                                           "run the gate)."),
    max_regression: str = typer.Option("5%", help="Allowed slowdown: a percentage (5%) or a fraction (0.05)."),
    ratio_only: bool = flag(False, "--ratio-only", help="Compare only dostune's speedup over ZeRO-Offload (measured within "
                                    "each run), not absolute times: for a baseline from another machine."),
    update_baseline: bool = flag(False, "--update-baseline", help="Write the current result over the baseline "
                                 "(deliberately); a gate baseline then pins this tree's commit."),
    junit: Optional[Path] = typer.Option(None, help="Also write a JUnit XML report here."),
    json_out: bool = flag(False, "--json", help="Print the findings as JSON on stdout."),
):
    """Compare a fresh (or given) bench result with a baseline; exit 0 within tolerance, 1 on a regression,
    2 on unusable input.

    Per method and phase (forward, backward, step, iteration) the current/baseline ratio of medians, and
    dostune's speedup over ZeRO-Offload. A slowdown counts only when it exceeds both --max-regression and
    the spread the two runs measured. With a CPU gate baseline (results/ci-cpu/gate.json, docs/ci-gate.md) the
    gate times this tree's optimizer step against the pinned commit's, taking turns, and judges the median ratio of
    steps run side by side against --max-regression alone; on a busy machine it times more steps until the
    ratio is clearly on one side of that (a minute or two on 2 cores).

    Example (GitHub Actions step): dostune check --baseline results/h100/bench-gpt2-1.3b.json --ratio-only
    --max-regression 15% --junit check.xml
    """
    tol = _fraction(max_regression)
    # every output is checked before a fresh bench runs (minutes)
    if junit is not None:
        check_writable(junit, "--junit")
    if update_baseline:
        check_writable(baseline, "--baseline")
    from ..bench.gate import is_gate_record

    gate = is_gate_record(baseline)
    base = _load(baseline, "baseline", gate)
    extra: dict = {}
    if gate:
        out = _gate(baseline, base, current, tol, update_baseline)
        if out is None:
            return
        rep, extra = out
    elif current is None:
        need_deepspeed("dostune check (a fresh bench)")
        cur = _fresh_run(base, ratio_only)
        rep = _compare(base, cur, tol, ratio_only, given=False)
    else:
        cur = _load(current, "current")
        rep = _compare(base, cur, tol, ratio_only, given=True)
    _report(rep, tol, ratio_only and not gate, junit, json_out, extra)
    if update_baseline:
        if current is not None:
            atomic_write_text(baseline, current.read_text())
        else:
            from ..records import save_record

            save_record(cur, baseline)
        err_console.print(f"baseline {baseline} updated")
        return
    if rep.regressions:
        err_console.print(f"[bold red]{len(rep.regressions)} regression(s)[/] beyond {tol:.0%}"
                          + ("" if gate else " and the noise"))
        raise typer.Exit(1)
    err_console.print("[green]no regression[/]")


def _report(rep: CheckReport, tol: float, ratio_only: bool, junit: Optional[Path], json_out: bool,
            extra: dict) -> None:
    table = Table(title=f"dostune check: tolerance {tol:.0%}" + (", speedups only" if ratio_only else ""))
    for col in ("what", "baseline", "current", "change", "noise", "repeats", "verdict"):
        table.add_column(col, justify="left" if col in ("what", "verdict") else "right")
    for f in rep.findings:
        table.add_row(f.name, f"{f.baseline:.4g}", f"{f.current:.4g}", change(f), f"{f.noise:.1%}",
                      f"{f.repeats[0]}/{f.repeats[1]}", "[red]REGRESSION[/]" if f.regression else "ok")
    err_console.print(table)
    for f in rep.findings:
        if f.note and f.name.startswith("gate/"):
            err_console.print(f"{f.name}: {f.note}")
    if junit is not None:
        atomic_write_text(junit, junit_xml(rep))
    if json_out:
        print_json({"tolerance": tol, "ratio_only": ratio_only, "regressions": len(rep.regressions),
                    "findings": [f.__dict__ for f in rep.findings], **extra})
