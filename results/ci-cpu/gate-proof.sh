#!/usr/bin/env bash
# The CPU gate's proof (docs/ci-gate.md): N gate checks on an unchanged tree and N with the CPU lane made 20%
# slower by the test-only switch DOSTUNE_TEST_SLOW_CPU_LANE=0.2, alternating, one after another, each exactly as CI
# runs it (scripts/ci-bench-check.sh); one CSV row per check (gate_runs: 2 when a noisy regression ran again).
#   bash results/ci-cpu/gate-proof.sh [output.csv] [N]     (default: results/ci-cpu/gate-proof.csv, N 20)
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv ] && . .venv/bin/activate
out=${1:-results/ci-cpu/gate-proof.csv}
n=${2:-20}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
echo "run,slow_cpu_lane,exit_code,verdict,ratio,wall_ratio,engine_ratios,noise,gate_runs,speculative,seconds,started" \
  > "$out"
for i in $(seq 1 "$n"); do
  for slow in "" 0.2; do
    started=$(date -u +%FT%TZ)
    if [ -n "$slow" ]; then
      DOSTUNE_TEST_SLOW_CPU_LANE=$slow dostune check --baseline results/ci-cpu/gate.json --max-regression 7% --json \
        > "$tmp" 2>/dev/null
    else
      env -u DOSTUNE_TEST_SLOW_CPU_LANE dostune check --baseline results/ci-cpu/gate.json --max-regression 7% \
        --json > "$tmp" 2>/dev/null
    fi
    rc=$?
    python - "$tmp" "$i" "$rc" "$started" >> "$out" <<'PY'
import json, sys
path, run, rc, started = sys.argv[1:]
try:
    g = json.load(open(path))["gate"]
except (OSError, ValueError, KeyError):
    print(f"{run},,{rc},error,,,,,,,,{started}")
else:
    verdict = {"0": "ok", "1": "REGRESSION"}.get(rc, "error")
    engines = " ".join(f"{r:.4f}" for r in g["engine_ratios"])
    runs = g.get("runs", [g])  # the judged run is the last; seconds: all of them
    seconds = sum(r["seconds"] for r in runs)
    print(f"{run},{g['slow_cpu_lane']:g},{rc},{verdict},{g['ratio']:.4f},{g['wall_ratio']:.4f},{engines},"
          f"{g['noise']:.4f},{len(runs)},{g['speculative']},{seconds:.1f},{started}")
PY
    tail -1 "$out"
  done
done
