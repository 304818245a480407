#!/usr/bin/env bash
# On a multi-GPU machine (e.g. nvidia-h200-x2): data-parallel ZeRO-3 training through DeepSpeed's launcher,
# dostune's interleaved optimizer on every rank versus plain DeepSpeed ZeRO-Offload with the same config.
#   run(command="bash scripts/device-multi-gpu.sh", kind="nvidia-h200-x2", carry=[".whl"])
# Per-rank metrics land in $OUT/{dostune,zero-offload}/metrics[.rankN].jsonl; a summary is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-gpt2-1.3b}; STEPS=${STEPS:-30}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
THREADS=$(( $(nproc) / NGPU ))
# The tuned single-GPU schedule, re-targeted: each rank holds 1/NGPU of the state, so the subgroup count
# differs (expected_subgroups is dropped) and the CPU threads are shared among the ranks.
python3 - "$MODEL" "$THREADS" > /tmp/ds_multi.json <<'PY'
import json, sys
cfg = json.load(open(f"results/h100/tune-{sys.argv[1]}/ds_config.json"))
cfg["dostune"].pop("expected_subgroups", None)
cfg.pop("train_batch_size", None)  # DeepSpeed derives it for the number of GPUs
cfg["dostune"].update(cpu_threads=int(sys.argv[2]), grads_on_gpu=False, trace=False)
print(json.dumps(cfg))
PY
nvidia-smi -L
for method in dostune zero-offload; do
  extra=""; [ $method = zero-offload ] && extra="--plain-deepspeed"
  echo "=== $method $(date +%T)"
  timeout 270 python3 -m deepspeed.launcher.runner --num_gpus "$NGPU" --master_port 29517 --module dostune.train --config /tmp/ds_multi.json --model "$MODEL" \
    --steps "$STEPS" --seq 1024 --log-every 10 --metrics "$OUT/$method/metrics.jsonl" $extra 2>&1 \
    | grep -E "step |ran steps|Error|error" | grep -v Warning | tail -8
done
python3 - "$OUT" "$NGPU" <<'PY'
import glob, json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
res = {}
for method in ("dostune", "zero-offload"):
    for path in sorted(glob.glob(f"{out}/{method}/metrics*.jsonl")):
        rows = [json.loads(l) for l in open(path)][5:]  # past warm-up
        if rows:
            med = {k: statistics.median(r[k] for r in rows) for k in ("iter_s", "fwd_s", "bwd_s", "step_s")}
            res.setdefault(method, []).append(med)
            print(f"{method:13s} {path.split('/')[-1]:22s} " + " ".join(f"{k} {v:.3f}" for k, v in med.items())
                  + f"  (median of {len(rows)} steps)")
if len(res) == 2:
    it = {m: max(r["iter_s"] for r in v) for m, v in res.items()}
    print(f"{n}-GPU iteration: dostune {it['dostune']:.3f} s vs ZeRO-Offload {it['zero-offload']:.3f} s "
          f"-> {it['zero-offload'] / it['dostune']:.2f}x")
PY
