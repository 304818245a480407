#!/usr/bin/env bash
# CI gate on the optimizer step (docs/ci-gate.md): `dostune check` runs the CPU gate of results/ci-cpu/gate.json,
# this tree's step (both lanes, overlap_backward) timed against the pinned commit's in two processes that take
# turns. Exit 1 when this tree's step is more than 7% slower; 2 when the gate cannot run (e.g. the clone lacks the
# pinned commit). A slowdown meant by a change moves the pin: see docs/ci-gate.md.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
mkdir -p runs/ci
dostune check --baseline results/ci-cpu/gate.json --max-regression 7% --junit runs/ci/check.xml
