#!/usr/bin/env bash
# profile -> tune -> train with the CLI. On a machine without a GPU, `dostune tune` falls back to the shipped
# H100 profile and `dostune train` runs the tiny model on the CPU, so the flow can be tried anywhere.
set -euo pipefail
rm -rf runs/ckpt runs/ckpt-demo  # this demo's own checkpoints: `dostune train` refuses to overwrite a run
export MODEL=${MODEL:-gpt2-1.3b}
if nvidia-smi >/dev/null 2>&1; then
  dostune profile --name mynode --output runs/profiles/mynode.json --force
  dostune profile --model "$MODEL" --micro-batch 8 --seq 1024 --name mynode \
    --output "runs/profiles/mynode-$MODEL-b8-s1024.json" --plot runs/profiles/memory.png --force
  dostune tune --profile runs/profiles/mynode.json --model "$MODEL" --trials 50 --output-dir "runs/tune/$MODEL"
  dostune train --config "runs/tune/$MODEL/ds_config.json" --model "$MODEL" --steps 200 --save-dir runs/ckpt
else
  dostune tune --model "$MODEL" --trials 50 --output-dir "runs/tune/$MODEL"   # shipped H100 profiles
  # the tuned schedule's shape on a model that fits a 2-core CPU:
  python - <<'PY'
import json
import os
cfg = json.load(open(f"runs/tune/{os.environ.get('MODEL', 'gpt2-1.3b')}/ds_config.json"))
cfg["zero_optimization"].update(sub_group_size=20000, offload_optimizer={"device": "cpu", "pin_memory": False})
cfg["train_micro_batch_size_per_gpu"] = 2
cfg["dostune"].pop("expected_subgroups", None)
cfg["dostune"].pop("cpu_threads", None)
json.dump(cfg, open("runs/tune/cpu_demo_config.json", "w"), indent=2)
PY
  dostune train --config runs/tune/cpu_demo_config.json --model gpt2-tiny --steps 20 --seq 64 --save-dir runs/ckpt-demo
fi
