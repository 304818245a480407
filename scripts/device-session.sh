#!/usr/bin/env bash
# One device call that does a session's GPU work and leaves its outputs under $OUT:
#   run(command="bash scripts/device-session.sh STEP...", carry=[".whl"], timeout_s=600)
# Steps (in the order given):
#   env                 versions of what the machine has
#   profile             dostune profile of the node -> $OUT/node.json
#   tests               every test marked gpu -> $OUT/gpu-tests.log
#   bench:MODEL[:ARGS]  dostune bench of MODEL (ARGS: extra flags, + for spaces) -> $OUT/bench-MODEL.*
#   tune:MODEL[:ARGS]   dostune tune with $OUT/node.json if this call profiled, else the shipped profile
#                       -> $OUT/tune-MODEL/{ds_config.json,tune.json,timeline.png}
#   model:MODEL[:ARGS]  dostune profile --model MODEL (micro-batch 8, seq 1024) -> $OUT/model-MODEL.{json,png}
#   check:MODEL         dostune check against the committed H100 baseline results/h100/bench-MODEL.json,
#                       by dostune's speedup over ZeRO-Offload (the lent H100s differ in absolute speed)
#                       -> $OUT/check-MODEL.{xml,json}
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    env)
      { nvidia-smi; python3 -c "import torch, triton, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'deepspeed', deepspeed.__version__)"; nproc; free -g; } > "$OUT/env.txt" 2>&1
      tail -4 "$OUT/env.txt" ;;
    profile)
      timeout 300 python3 -m dostune profile --name h100-pcie5 --output "$OUT/node.json" --force 2>&1 | tail -40 ;;
    tests)
      timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -25 ;;
    bench:*)
      spec=${step#bench:}; model=${spec%%:*}; args=""
      [ "$spec" != "$model" ] && args=$(echo "${spec#*:}" | tr '+' ' ')
      timeout 420 python3 -m dostune bench --model "$model" --output "$OUT/bench-$model.json" $args 2>&1 | tail -30 ;;
    tune:*)
      spec=${step#tune:}; model=${spec%%:*}; args=""
      [ "$spec" != "$model" ] && args=$(echo "${spec#*:}" | tr '+' ' ')
      prof=profiles/h100-pcie5.json; [ -f "$OUT/node.json" ] && prof="$OUT/node.json"
      timeout 480 python3 -m dostune tune --model "$model" --profile "$prof" \
        --model-profile "profiles/h100-pcie5-$model-b8-s1024.json" --output-dir "$OUT/tune-$model" \
        --storage "sqlite:////tmp/study-$model.db" $args 2>&1 | tail -45 ;;
    model:*)
      spec=${step#model:}; model=${spec%%:*}; args=""
      [ "$spec" != "$model" ] && args=$(echo "${spec#*:}" | tr '+' ' ')
      timeout 300 python3 -m dostune profile --model "$model" --micro-batch 8 --seq 1024 --name h100-pcie5 \
        --output "$OUT/model-$model.json" --plot "$OUT/model-$model.png" --force $args 2>&1 | tail -16 ;;
    check:*)
      model=${step#check:}
      timeout 400 python3 -m dostune check --baseline "results/h100/bench-$model.json" --ratio-only \
        --max-regression 15% --junit "$OUT/check-$model.xml" 2>&1 | tail -20
      echo "check exit code: ${PIPESTATUS[0]}" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
