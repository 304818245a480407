#!/usr/bin/env bash
# On the GPU machine: 200 steps of MODEL on a local text corpus with a tuned config, checkpointing every 100
# steps; then a second run (deterministic kernels, see `dostune train --help`) resumes from the step-100 checkpoint and must reproduce steps 101-200 exactly.
#   run(command="bash scripts/device-train-resume.sh", carry=[".whl"])
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-gpt2-1.3b}
CONFIG=${CONFIG:-results/h100/tune-$MODEL/ds_config.json}
CORPUS=${CORPUS:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')}
CK=/tmp/ckpt-$MODEL; rm -rf "$CK"
echo "corpus: $CORPUS"
timeout 360 python3 -m dostune train --config "$CONFIG" --model "$MODEL" --steps 200 --seq 1024 --data "$CORPUS" --deterministic \
  --save-dir "$CK" --save-every 100 --log-every 25 --metrics "$OUT/train-full.jsonl" 2>&1 | grep -v Warning | tail -12
echo 'step100' > "$CK/latest"   # resume from the middle checkpoint
timeout 300 python3 -m dostune train --config "$CONFIG" --model "$MODEL" --steps 200 --seq 1024 --data "$CORPUS" --deterministic \
  --save-dir "$CK" --resume --log-every 25 --metrics "$OUT/train-resumed.jsonl" 2>&1 | grep -v Warning | tail -6
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
full = [json.loads(l) for l in open(f"{out}/train-full.jsonl")]
res = [json.loads(l) for l in open(f"{out}/train-resumed.jsonl")]
a = [r["loss"] for r in full if r["step"] > 100]
b = [r["loss"] for r in res]
print(f"loss: step 1 {full[0]['loss']:.4f} -> step 200 {full[-1]['loss']:.4f}; "
      f"median step time {sorted(r['iter_s'] for r in full)[len(full)//2]:.3f} s")
print("resumed steps 101-200 identical to the uninterrupted run:", a == b, f"({len(a)} vs {len(b)} steps)")
PY
