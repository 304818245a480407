"""Step-by-step recordings of CPU gate runs, and the figures docs/ci-gate.md draws from them.

    python results/ci-cpu/gate-steps.py record OUT.csv N REF[,REF...] SLOW[,SLOW...] [--turns 160] [--neighbour W]
    python results/ci-cpu/gate-steps.py summary results/ci-cpu/gate-steps.csv

record: N times over, for each reference commit and each CPU-lane slowdown (DOSTUNE_TEST_SLOW_CPU_LANE), one gate run
of this tree against that commit with the baseline's settings, timing --turns turns (no early stop), appended as one
row per step: the parent's clock at the step's request, both CPU and wall time, the 1-minute load average. The load
beside it is the caller's to start (--neighbour names it in the rows). summary: per group of runs (reference,
slowdown) what the first 40 turns and all turns give under the gate's statistic (the median of the turns' ratios,
gate.paired_ratio) and under a low quantile per engine pair, and how alike the two steps of one turn are.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from dostune.bench import gate
from dostune.profile.timing import NullProgress

COLUMNS = ["run", "started", "neighbour", "reference", "slow_cpu_lane", "turn", "side", "engine", "timed", "cpu_ms",
           "wall_ms", "t_s", "load1"]


def record_run(base: gate.GateBaseline, slow: float) -> tuple[list[dict], str]:
    if slow:
        os.environ[gate.SLOW_CPU_LANE_ENV] = f"{slow:g}"
    else:
        os.environ.pop(gate.SLOW_CPU_LANE_ENV, None)
    s, steps, t_start = base.settings, [], time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="gate-steps-") as tmp:
        pinned = Path(tmp) / "pinned"
        gate.export_package(gate.repository(base.baseline_commit), base.baseline_commit, pinned)
        workers = {"current": gate._Worker("current", gate.package_root(), s, True, Path(tmp)),
                   "baseline": gate._Worker("baseline", pinned, s, False, Path(tmp))}
        try:
            for w in workers.values():
                w.read(timeout_s=900.0)

            def ask(name: str, timed: bool) -> dict:
                t = time.perf_counter() - t_start
                out = workers[name].ask(f"step {int(timed)}")
                turn = sum(1 for x in steps if x["side"] == name)
                steps.append({"turn": turn, "side": name, "engine": turn % s.engines, "timed": int(timed),
                              "cpu_ms": f"{out['cpu'] * 1e3:.3f}", "wall_ms": f"{out['wall'] * 1e3:.3f}",
                              "t_s": f"{t:.3f}", "load1": f"{os.getloadavg()[0]:.2f}"})
                return out

            gate.take_turns(s, 0.0, ask, NullProgress())
            for w in workers.values():
                w.ask("end")
        finally:
            for w in workers.values():
                w.close()
    return steps, started


def record(args) -> None:
    base0 = gate.load_gate("results/ci-cpu/gate.json")
    settings = base0.settings.model_copy(update={"pairs": args.turns, "max_pairs": args.turns})
    refs = {r: gate._git(Path.cwd(), "rev-parse", "--verify", f"{r}^{{commit}}").strip() for r in args.refs.split(",")}
    new = not Path(args.out).exists()
    with open(args.out, "a", newline="") as f:
        out = csv.DictWriter(f, COLUMNS)
        if new:
            out.writeheader()
        run = 0 if new else max(int(r["run"]) for r in csv.DictReader(open(args.out))) + 1
        for _ in range(args.n):
            for ref, sha in refs.items():
                for slow in (float(x) for x in args.slow.split(",")):
                    base = base0.model_copy(update={"baseline_commit": sha, "settings": settings})
                    steps, started = record_run(base, slow)
                    for x in steps:
                        out.writerow({"run": run, "started": started, "neighbour": args.neighbour,
                                      "reference": sha[:7], "slow_cpu_lane": f"{slow:g}", **x})
                    f.flush()
                    print(f"run {run}: against {sha[:7]}, CPU lane slowed by {slow:g}, {len(steps)} steps",
                          file=sys.stderr)
                    run += 1


def low_quantile_pairs(cur: list[float], ref: list[float], engines: list[int], q: float = 0.2) -> float:
    """A low quantile of each engine's steps per side, their ratio, the geometric mean over the engine pairs."""
    def quantile(xs):
        xs = sorted(xs)
        k = q * (len(xs) - 1)
        i = int(k)
        return xs[i] if i + 1 >= len(xs) else xs[i] + (k - i) * (xs[i + 1] - xs[i])

    logs = [math.log(quantile([c for c, x in zip(cur, engines) if x == e]) /
                     quantile([r for r, x in zip(ref, engines) if x == e])) for e in sorted(set(engines))]
    return math.exp(sum(logs) / len(logs))


def correlation(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def summary(args) -> None:
    runs = defaultdict(list)
    for row in csv.DictReader(open(args.csv)):
        runs[row["run"]].append(row)
    groups, per_neighbour = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for rows in runs.values():
        neighbour = rows[0]["neighbour"]
        timed = [r for r in rows if r["timed"] == "1"]
        side = {name: sorted((r for r in timed if r["side"] == name), key=lambda r: int(r["turn"]))
                for name in ("current", "baseline")}
        cur = [float(r["cpu_ms"]) for r in side["current"]]
        ref = [float(r["cpu_ms"]) for r in side["baseline"]]
        engines = [int(r["engine"]) for r in side["current"]]
        first = gate.paired_ratio(cur[:40], ref[:40], 0.99)
        pair_quantiles = [low_quantile_pairs([c for c, x in zip(cur[:40], engines) if x == e],
                                             [r for r, x in zip(ref[:40], engines) if x == e], [e] * 10)
                          for e in sorted(set(engines))]
        groups[(neighbour, rows[0]["reference"], rows[0]["slow_cpu_lane"])].append({
            "quantile40": low_quantile_pairs(cur[:40], ref[:40], engines[:40]), "median40": first[0],
            "settled40": gate.settled(first[1], first[2], 0.07),
            "median_all": gate.paired_ratio(cur, ref, 0.99)[0] if len(cur) > 40 else None})
        stats = per_neighbour[neighbour]
        sides = statistics.median(cur[:40]) / statistics.median(ref[:40])
        stats["sides_vs_turns"].append((abs(math.log(sides / first[0])), sides, first[0], rows[0]["run"]))
        stats["half_width40"].append((first[2] - first[1]) / (2 * first[0]))
        # the figure that once chose a second run: half the spread of the engine pairs' quantile ratios
        stats["pair_spread40"].append((max(pair_quantiles) - min(pair_quantiles)) / 2
                                      / low_quantile_pairs(cur[:40], ref[:40], engines[:40]))
        # the parent's clock: building (to the first step), one turn, a round of 40 timed turns
        t = sorted(float(r["t_s"]) for r in rows if r["side"] == "current")
        stats["build_s"].append(t[0])
        stats["turn_s"].append(statistics.median(b - a for a, b in zip(t, t[1:])))
        warmup = len(t) - len(cur)
        if len(t) > warmup + 40:
            stats["round_s"].append(t[warmup + 40] - t[warmup])
        # how alike are this tree's step and the pinned one, k turns apart (each engine's mean removed)
        lc, lr = [math.log(x) for x in cur], [math.log(x) for x in ref]
        for e in set(engines):
            idx = [j for j, x in enumerate(engines) if x == e]
            mc, mr = statistics.fmean(lc[j] for j in idx), statistics.fmean(lr[j] for j in idx)
            for j in idx:
                lc[j] -= mc
                lr[j] -= mr
        for k in (0, 1, 4, 8, 20):
            if len(lc) - k > 10:
                stats[f"lag{k}"].append(correlation(lc[:len(lc) - k], lr[k:]))
        stats["load1"].extend(float(r["load1"]) for r in rows)

    def spread(xs):
        logs = [math.log(x) for x in xs]
        sd = statistics.stdev(logs) if len(logs) > 1 else float("nan")
        return f"mean {math.exp(statistics.fmean(logs)):.4f} sd {sd:.4f} min {min(xs):.4f} max {max(xs):.4f}"

    for (neighbour, ref, slow), rs in sorted(groups.items()):
        print(f"{neighbour}, against {ref}, CPU lane slowed by {slow}: {len(rs)} runs")
        print(f"  first 40 turns, low quantile per engine pair: {spread([r['quantile40'] for r in rs])}")
        print(f"  first 40 turns, median of the turns' ratios:  {spread([r['median40'] for r in rs])}")
        print(f"  first 40 turns, 99% interval clear of 1.07:   {sum(r['settled40'] for r in rs)} of {len(rs)}")
        full = [r["median_all"] for r in rs if r["median_all"] is not None]
        if full:
            print(f"  all turns ({len(full)} runs), median of the ratios: {spread(full)}")
    for neighbour, st in sorted(per_neighbour.items()):
        n = len(st["build_s"])
        worst = max(st.pop("sides_vs_turns"))
        med = {k: statistics.median(v) for k, v in st.items()}
        round_s = f", a round of 40 timed turns {med['round_s']:.1f} s" if "round_s" in med else ""
        print(f"{neighbour}: {n} runs, load average {min(st['load1']):.1f} to {max(st['load1']):.1f}; building "
              f"{med['build_s']:.1f} s, a turn {med['turn_s']:.2f} s{round_s} (medians)")
        print(f"  first 40 turns: 99% interval's half width median {med['half_width40']:.3f} "
              f"({min(st['half_width40']):.3f} to {max(st['half_width40']):.3f}); half the spread of the pairs' "
              f"quantile ratios median {med['pair_spread40']:.3f}, above 0.07 in "
              f"{sum(x > 0.07 for x in st['pair_spread40'])} of {n}")
        print(f"  first 40 turns, widest gap between the ratio of the sides' medians and the median of the turns' "
              f"ratios: {worst[1]:.3f} against {worst[2]:.3f} (run {worst[3]})")
        print("  this tree's step against the pinned step k turns later, correlation (median): "
              + ", ".join(f"k={k}: {med[f'lag{k}']:.2f}" for k in (0, 1, 4, 8, 20) if f"lag{k}" in med))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("n", type=int)
    r.add_argument("refs")
    r.add_argument("slow")
    r.add_argument("--turns", type=int, default=160)
    r.add_argument("--neighbour", default="none")
    s = sub.add_parser("summary")
    s.add_argument("csv")
    args = ap.parse_args()
    record(args) if args.cmd == "record" else summary(args)


if __name__ == "__main__":
    main()
