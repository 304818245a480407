#!/usr/bin/env bash
# Profile, tune and benchmark on a GPU machine in one go; every output lands under $OUT (default runs/gpu).
#   bash scripts/gpu-bench.sh STEP...      (the steps run in the order given)
# Steps:
#   env                 the GPU, driver and library versions -> $OUT/env.txt
#   tests               every test marked gpu (scripts/gpu-tests.sh) -> runs/gpu-tests.log
#   profile             dostune profile of this node -> $OUT/node.json
#   model:MODEL         dostune profile --model MODEL, micro-batch 8, seq 1024 -> $OUT/model-MODEL.{json,png}
#   tune:MODEL          dostune tune from the two profiles above -> $OUT/tune-MODEL/{ds_config.json,tune.json,timeline.png}
#   bench:MODEL[:ARGS]  dostune bench of MODEL with $OUT/tune-MODEL/ds_config.json if tuned, else dostune's default
#                       schedule; ARGS are extra bench flags with + for spaces -> $OUT/bench-MODEL.{json,md,png}
#   check:MODEL         dostune check by speedup over ZeRO-Offload against $BASELINE
#                       (default results/h100/bench-MODEL.json) -> $OUT/check-MODEL.xml
# Example, the whole flow for gpt2-1.3b, every method measured twice in reverse order (drift-cancelling):
#   bash scripts/gpu-bench.sh env profile model:gpt2-1.3b tune:gpt2-1.3b bench:gpt2-1.3b:--rounds+2
# NODE (default: the short host name) names the node in the profiles.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -d .venv ] || bash scripts/install.sh || exit 1
  . .venv/bin/activate
fi
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
NODE=${NODE:-$(hostname -s)}
rc=0
split() {  # SPEC -> model, args (the part after the first ':', + for spaces)
  model=${1%%:*}; args=""
  [ "$1" != "$model" ] && args=$(echo "${1#*:}" | tr '+' ' ')
  return 0
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    env)
      { nvidia-smi
        python -c "import torch, deepspeed, dostune; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| deepspeed', deepspeed.__version__, '| dostune', dostune.__version__)"
        nproc; free -g; } > "$OUT/env.txt" 2>&1
      tail -5 "$OUT/env.txt" ;;
    tests)
      bash scripts/gpu-tests.sh || rc=1 ;;
    profile)
      dostune profile --name "$NODE" --output "$OUT/node.json" --force || rc=1 ;;
    model:*)
      split "${step#model:}"
      dostune profile --model "$model" --micro-batch 8 --seq 1024 --name "$NODE" \
        --output "$OUT/model-$model.json" --plot "$OUT/model-$model.png" --force $args || rc=1 ;;
    tune:*)
      split "${step#tune:}"
      dostune tune --model "$model" --profile "$OUT/node.json" --model-profile "$OUT/model-$model.json" \
        --output-dir "$OUT/tune-$model" --storage "sqlite:///$OUT/study-$model.db" $args || rc=1 ;;
    bench:*)
      split "${step#bench:}"
      config=()
      [ -f "$OUT/tune-$model/ds_config.json" ] && config=(--config "$OUT/tune-$model/ds_config.json")
      dostune bench --model "$model" "${config[@]}" --output "$OUT/bench-$model.json" $args || rc=1 ;;
    check:*)
      model=${step#check:}
      dostune check --baseline "${BASELINE:-results/h100/bench-$model.json}" --ratio-only --max-regression 15% \
        --junit "$OUT/check-$model.xml"
      code=$?; echo "check exit code: $code"; [ $code -eq 0 ] || rc=1 ;;
    *) echo "unknown step $step (env, tests, profile, model:M, tune:M, bench:M[:ARGS], check:M)" >&2; rc=2 ;;
  esac
done
echo "=== done $(date +%T)"
exit $rc
