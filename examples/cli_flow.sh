#!/usr/bin/env bash
# profile -> tune -> train with the CLI, in the current folder: profiles go to profiles/ (where `dostune tune` finds
# them), everything else under runs/.
# With a GPU: profile this node and the model, tune, train with the tuned config.
# Without one: profile this machine's CPU side, tune gpt2-1.3b from the shipped H200 profile, carry the tuned
# schedule over to a model a CPU trains in seconds (dostune refit) and train that, so the flow runs anywhere.
# Knobs (the defaults are the real run; tests/test_quickstart.py turns them down):
#   MODEL (gpt2-1.3b), TRIALS (50), STEPS (200 on a GPU, 20 on a CPU), NODE (mynode: the GPU node's name in its
#   profiles), PROFILE_ARGS (flags for the profiles: e.g. --thorough; --quick on a machine without a GPU)
set -euo pipefail
MODEL=${MODEL:-gpt2-1.3b}
TRIALS=${TRIALS:-50}
NODE=${NODE:-mynode}
PROFILE_ARGS=${PROFILE_ARGS:-}
rm -rf runs/ckpt runs/ckpt-demo  # this demo's own checkpoints: `dostune train` refuses to overwrite a run
# a GPU dostune would use (CUDA_VISIBLE_DEVICES= hides it, as from dostune itself); nvidia-smi answers in a fraction of
# the seconds that starting torch's CUDA takes
if [ "${CUDA_VISIBLE_DEVICES-all}" != "" ] && nvidia-smi -L >/dev/null 2>&1; then
  # profiles/NODE.json and profiles/NODE-MODEL-b8-s1024.json (named, so that they never overwrite a profile dostune
  # ships in a checkout's profiles/); tune finds the model profile beside the node profile
  dostune profile --name "$NODE" --force $PROFILE_ARGS
  dostune profile --model "$MODEL" --micro-batch 8 --seq 1024 --name "$NODE" --plot "runs/$MODEL-memory.png" --force \
    $PROFILE_ARGS
  dostune tune --profile "profiles/$NODE.json" --model "$MODEL" --trials "$TRIALS" --output-dir "runs/tune/$MODEL"
  # no --save-dir: a checkpoint of gpt2-1.3b's optimizer state is 18 GB (the flow in README.md shows one)
  dostune train --config "runs/tune/$MODEL/ds_config.json" --model "$MODEL" --steps "${STEPS:-200}"
else
  echo "== no GPU here: profiling this machine's CPU side (CPU Adam, conversions) for real"
  dostune profile --name this-node --force $PROFILE_ARGS
  echo "== tuning $MODEL from the shipped H200 profile, not from profiles/this-node.json: the schedule splits"
  echo "   each optimizer step between a GPU and its host, and a machine without a GPU has no GPU or PCIe figures"
  dostune tune --model "$MODEL" --trials "$TRIALS" --output-dir "runs/tune/$MODEL"
  echo "== training the tuned schedule's shape on gpt2-tiny, which a CPU trains in seconds"
  dostune refit --config "runs/tune/$MODEL/ds_config.json" --model gpt2-tiny --micro-batch 2 \
    --output runs/tune/cpu_demo_config.json --force
  dostune train --config runs/tune/cpu_demo_config.json --model gpt2-tiny --steps "${STEPS:-20}" --seq 64 \
    --save-dir runs/ckpt-demo
fi
