#!/usr/bin/env bash
# CI gate on the optimizer step: `dostune check` re-runs the CPU bench recorded in the committed baseline
# (dostune's update against DeepSpeed's own CPU path, in one run, same model/batch/seed/schedule) and compares
# dostune's speedup over ZeRO-Offload with the baseline's. Exit 1 when the step got slower beyond 15% and
# beyond the measured noise; 2 when the inputs are unusable.
# The baseline was made with:
#   dostune bench --model ci-step-bench --micro-batch 1 --seq 16 --methods zero-offload,dostune --iters 20 \
#     --warmup 3 --sub-group-size 5000000 --schedule '{"gpu_fraction": 0.0}' --node ci-cpu \
#     --output results/ci-cpu/baseline.json
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
mkdir -p runs/ci
dostune check --baseline results/ci-cpu/baseline.json --ratio-only --max-regression 15% --junit runs/ci/check.xml
