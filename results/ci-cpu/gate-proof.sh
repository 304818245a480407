#!/usr/bin/env bash
# The CPU gate's proof (docs/ci-gate.md): N runs of scripts/ci-bench-check.sh on an unchanged tree and N with the
# CPU lane made 20% slower by the test-only switch DOSTUNE_TEST_SLOW_CPU_LANE=0.2, alternating, one after another,
# each beside a busy second process that this script starts and stops: the parity tests
# (python -m pytest -q tests/test_parity.py) in a loop, as a CI job's test suite would run beside the gate.
# One CSV row per check: the verdict, the judged ratio and its interval, the noise, the turns timed and in how many
# rounds (rounds > 1: the run measured more because its first round could not tell), the gate's seconds, and the
# 1-minute load average before and after the check.
#   bash results/ci-cpu/gate-proof.sh [output.csv] [N]     (default: results/ci-cpu/gate-proof.csv, N 10)
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv ] && . .venv/bin/activate
out=${1:-results/ci-cpu/gate-proof.csv}
n=${2:-10}
tmp=$(mktemp)
# its own session, so that stopping it stops the pytest it is running too
setsid bash -c 'while true; do python -m pytest -q -p no:cacheprovider tests/test_parity.py > /dev/null 2>&1; done' &
busy=$!
trap 'kill -TERM -- -"$busy" 2>/dev/null; rm -f "$tmp"' EXIT
sleep 20  # the neighbour at work before the first check
load() { cut -d' ' -f1 /proc/loadavg; }
echo "run,slow_cpu_lane,exit_code,verdict,ratio,low,high,noise,pairs,rounds,measured_again,wall_ratio,engine_ratios,"\
"speculative,seconds,load_before,load_after,started" > "$out"
for i in $(seq 1 "$n"); do
  for slow in "" 0.2; do
    started=$(date -u +%FT%TZ)
    before=$(load)
    if [ -n "$slow" ]; then
      DOSTUNE_TEST_SLOW_CPU_LANE=$slow bash scripts/ci-bench-check.sh --json > "$tmp" 2>/dev/null
    else
      env -u DOSTUNE_TEST_SLOW_CPU_LANE bash scripts/ci-bench-check.sh --json > "$tmp" 2>/dev/null
    fi
    rc=$?
    python - "$tmp" "$i" "$rc" "$started" "$before" "$(load)" >> "$out" <<'PY'
import json, sys
path, run, rc, started, before, after = sys.argv[1:]
try:
    g = json.load(open(path))["gate"]
except (OSError, ValueError, KeyError):
    print(f"{run},,{rc},error,,,,,,,,,,,,{before},{after},{started}")
else:
    verdict = {"0": "ok", "1": "REGRESSION"}.get(rc, "error")
    engines = " ".join(f"{r:.4f}" for r in g["engine_ratios"])
    print(f"{run},{g['slow_cpu_lane']:g},{rc},{verdict},{g['ratio']:.4f},{g['low']:.4f},{g['high']:.4f},"
          f"{g['noise']:.4f},{g['pairs']},{g['rounds']},{int(g['rounds'] > 1)},{g['wall_ratio']:.4f},{engines},"
          f"{g['speculative']},{g['seconds']:.1f},{before},{after},{started}")
PY
    tail -1 "$out"
  done
done
