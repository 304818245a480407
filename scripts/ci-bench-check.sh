#!/usr/bin/env bash
# CI gate on the optimizer step (docs/ci-gate.md): `dostune check` runs the CPU gate of results/ci-cpu/gate.json,
# this tree's step (both lanes, overlap_backward) timed against the pinned commit's in two processes that take
# turns. Exit 1 when this tree's step is more than 7% slower; 2 when the gate cannot run (e.g. the clone lacks the
# pinned commit). A slowdown meant by a change moves the pin: see docs/ci-gate.md. Arguments go on to dostune check
# (e.g. --json).
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
mkdir -p runs/ci
# The gate needs the pinned commit's code from git: a shallow or exported checkout lacks it. Then it says so, loudly,
# and steps aside rather than fail every change for how the clone was made (fetch the history to run it).
pinned=$(python -c "import json; print(json.load(open('results/ci-cpu/gate.json'))['baseline_commit'])")
if ! git cat-file -e "${pinned}^{commit}" 2>/dev/null; then
  echo "ci-bench-check: SKIPPED: the gate's pinned commit ${pinned:0:12} is not in this checkout (shallow clone or" \
       "exported tree); run 'git fetch --unshallow' (GitHub: fetch-depth 0) to run the CPU regression gate" >&2
  exit 0
fi
dostune check --baseline results/ci-cpu/gate.json --max-regression 7% --junit runs/ci/check.xml "$@"
