#!/usr/bin/env bash
# CI gate on the optimizer step: a small CPU bench of dostune's update against DeepSpeed's own CPU path in one
# run, checked by ratio (dostune's speedup over ZeRO-Offload) against the committed CPU baseline.
# Exit 1 when the step got slower beyond 15% and beyond the measured noise.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
mkdir -p runs/ci
dostune bench --model ci-step-bench --micro-batch 1 --seq 16 --methods zero-offload,dostune --iters 20 --warmup 3 \
  --sub-group-size 5000000 --schedule '{"gpu_fraction": 0.0}' --node ci-cpu --output runs/ci/bench.json \
  || exit 2
dostune check --baseline results/ci-cpu/baseline.json --current runs/ci/bench.json --ratio-only \
  --max-regression 15% --junit runs/ci/check.xml
