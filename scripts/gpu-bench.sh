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
#   train:MODEL         dostune train, 20 steps, with $OUT/tune-MODEL/ds_config.json as it is -> $OUT/train-MODEL.log
#   refusals:MODEL      the launches that must stop before any engine, one line and exit 2 each: the tuned config in
#                       another world (GPUS+1 ranks if the node has them, else 1 rank when GPUS > 1), more ranks than
#                       GPUs, a hostfile naming a node that does not exist -> $OUT/refusals-MODEL.txt
#   validate:MODEL[:ARGS]  the performance model on MODEL: dostune profile --model (micro-batch 8, seq 1024), then
#                       dostune tune --validate $VALIDATE (default 3) from it and $OUT/node.json (the profile step
#                       first): ZeRO-Offload and the best schedules run beside their predictions, phase by phase
#                       -> $OUT/validate-NAME/{model-profile.json,tune.json,validation.png,ds_config.json}. ARGS (+ for
#                       spaces) go to both commands: flags they share, e.g. --micro-batch+16+--activation-checkpointing.
#                       VALIDATE_ARGS: flags for tune alone, e.g. "--validate-iters 2" (each method runs
#                       --validate-rounds 2 rounds in reversed order by default)
# Example, the whole flow for gpt2-1.3b, every method measured twice in reverse order (drift-cancelling):
#   bash scripts/gpu-bench.sh env profile model:gpt2-1.3b tune:gpt2-1.3b bench:gpt2-1.3b:--rounds+2
# Several GPUs of one node (docs/multi-gpu.md): GPUS=N runs model:, bench: and train: under DeepSpeed's launcher
# (`deepspeed --num_gpus N`) and tunes with --num-gpus N; `profile` measures every GPU it sees together. E.g.
#   GPUS=2 bash scripts/gpu-bench.sh env profile model:gpt2-1.3b tune:gpt2-1.3b \
#     bench:gpt2-1.3b:--methods+zero-offload,twin-flow-mem,dostune train:gpt2-1.3b refusals:gpt2-1.3b
# The performance model on four models of both families, 0.7B-7B, each profiled, tuned and validated on this node
# (docs/performance-model.md, "Validating"):
#   bash scripts/gpu-bench.sh env profile validate:gpt2-760m validate:llama-1.1b validate:gpt2-2.7b \
#     validate:llama-7b:--micro-batch+16+--activation-checkpointing
# MODEL in model:, tune:, bench:, train: and validate: is a preset, hf=PATH (a Hugging Face config file) or
# py=MODULE.FACTORY (your own factory: --model MODULE:FACTORY); the files are named by the preset, the config's file
# name without .json, or FACTORY (the NAME above).
# NODE (default: the short host name) names the node in the profiles.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -d .venv ] || bash scripts/install.sh || exit 1
  . .venv/bin/activate
fi
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
NODE=${NODE:-$(hostname -s)}
GPUS=${GPUS:-1}
PORT=${PORT:-29531}
VALIDATE=${VALIDATE:-3}
rc=0
launch() {  # MODULE ARGS...: one process, or N ranks under DeepSpeed's launcher
  local module=$1; shift
  if [ "$GPUS" -gt 1 ]; then deepspeed --num_gpus "$GPUS" --master_port "$PORT" --module "dostune.$module" "$@"
  else dostune "$module" "$@"; fi
}
expect_refusal() {  # LABEL COMMAND...: must exit 2 with an "error:" line
  local label=$1; shift
  local log; log=$("$@" 2>&1); local code=$?
  { echo "--- $label (exit $code): $*"; echo "$log" | grep -E "^(error|hint):" | sort -u; } >> "$REFUSALS"
  if [ $code -eq 2 ] && echo "$log" | grep -q "^error:"; then echo "refused as expected: $label"
  else echo "NOT refused as expected: $label (exit $code)"; rc=1; fi
}
split() {  # SPEC -> model (for --model), name (for file names), args (after the first ":", + for spaces)
  model=${1%%:*}; args=""
  [ "$1" != "$model" ] && args=$(echo "${1#*:}" | tr '+' ' ')
  name=$model
  case "$model" in
    hf=*) name=$(basename "${model#hf=}" .json); model="hf:${model#hf=}" ;;
    py=*) model=${model#py=}; name=${model##*.}; model="${model%.*}:$name" ;;
  esac
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
      launch profile --model "$model" --micro-batch 8 --seq 1024 --name "$NODE" \
        --output "$OUT/model-$name.json" --plot "$OUT/model-$name.png" --force $args || rc=1 ;;
    tune:*)
      split "${step#tune:}"
      dostune tune --model "$model" --profile "$OUT/node.json" --model-profile "$OUT/model-$name.json" \
        --num-gpus "$GPUS" --output-dir "$OUT/tune-$name" --storage "sqlite:///$OUT/study-$name.db" $args || rc=1 ;;
    bench:*)
      split "${step#bench:}"
      config=()
      [ -f "$OUT/tune-$name/ds_config.json" ] && config=(--config "$OUT/tune-$name/ds_config.json")
      launch bench --model "$model" "${config[@]}" --output "$OUT/bench-$name.json" $args || rc=1 ;;
    train:*)
      split "${step#train:}"
      launch train --config "$OUT/tune-$name/ds_config.json" --model "$model" --steps 20 \
        --metrics "$OUT/train-$name.jsonl" $args 2>&1 | tee "$OUT/train-$name.log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
    refusals:*)
      model=${step#refusals:}
      cfg="$OUT/tune-$model/ds_config.json"
      REFUSALS="$OUT/refusals-$model.txt"; : > "$REFUSALS"
      have=$(nvidia-smi -L | wc -l)
      if [ "$GPUS" -gt 1 ]; then
        expect_refusal "a config tuned for $GPUS GPUs on 1" dostune train --config "$cfg" --model "$model" --steps 1
      fi
      if [ "$have" -gt "$GPUS" ]; then
        expect_refusal "a config tuned for $GPUS GPUs on $((GPUS + 1))" deepspeed --num_gpus $((GPUS + 1)) \
          --master_port "$PORT" --module dostune.train --config "$cfg" --model "$model" --steps 1
      fi
      expect_refusal "more ranks than the node's $have GPUs" deepspeed --num_gpus $((have + 1)) --master_port "$PORT" \
        --module dostune.train --config "$cfg" --model "$model" --steps 1
      printf "localhost slots=%s\nno-such-node.invalid slots=%s\n" "$GPUS" "$GPUS" > "$OUT/hostfile-missing-node"
      expect_refusal "a hostfile naming a missing node" dostune tune --model "$model" --profile "$OUT/node.json" \
        --hostfile "$OUT/hostfile-missing-node" --output-dir "$OUT/tune-refused"
      [ ! -e "$OUT/tune-refused" ] || { echo "tune-refused was written"; rc=1; }
      cat "$REFUSALS" ;;
    validate:*)
      split "${step#validate:}"
      dir="$OUT/validate-$name"
      if [ ! -f "$OUT/node.json" ]; then echo "validate needs $OUT/node.json: run the profile step first" >&2; rc=1
      else
        mkdir -p "$dir"
        dostune profile --model "$model" --micro-batch 8 --seq 1024 --name "$NODE" \
          --output "$dir/model-profile.json" --plot "$dir/model-profile.png" --force $args \
        && dostune tune --model "$model" --profile "$OUT/node.json" --model-profile "$dir/model-profile.json" \
          --validate "$VALIDATE" ${VALIDATE_ARGS:-} --output-dir "$dir" --storage "sqlite:///$dir/study.db" $args \
          2>&1 | tee "$dir/tune.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
      fi ;;
    check:*)
      model=${step#check:}
      dostune check --baseline "${BASELINE:-results/h100/bench-$model.json}" --ratio-only --max-regression 15% \
        --junit "$OUT/check-$model.xml"
      code=$?; echo "check exit code: $code"; [ $code -eq 0 ] || rc=1 ;;
    *) echo "unknown step $step (env, tests, profile, model:M, tune:M, bench:M[:ARGS], check:M, train:M, refusals:M," \
         "validate:M[:ARGS])" >&2
       rc=2 ;;
  esac
done
echo "=== done $(date +%T)"
exit $rc
