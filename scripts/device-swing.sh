#!/usr/bin/env bash
# On the GPU machine: adaptive_swing against the static split it starts from, gpt2-1.3b, bf16, micro-batch 8,
# seq 1024, no clipping; each a drift-cancelling bench (--rounds 2) against no offload, the swing run first.
#   run(command="bash scripts/device-swing.sh", carry=[".whl"])   # ~8 min on a warm machine
# Writes under $OUT/swing-gpt2-1.3b: the GPU tests' tail, both benches (.json/.md/timeline) and the config with
# adaptive_swing set; the swing bench's .md says how many steps ran with each swing.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; O=$OUT/swing-gpt2-1.3b; mkdir -p "$O"
C=results/h100/tune-gpt2-1.3b-resident/ds_config.json  # dostune tune's pick: 12 of 38 on the GPU lane, 9 streamed
SWING=${SWING:-4}
python3 - "$C" "$O/ds_config-swing$SWING.json" "$SWING" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["dostune"]["adaptive_swing"] = int(sys.argv[3])
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
EOF
echo "=== GPU tests $(date +%T)"
python3 -m pytest -q -m gpu tests/test_parity_gpu.py -k adaptive 2>&1 | tail -3 | tee "$O/gpu-tests-swing.log"
for run in "swing$SWING:$O/ds_config-swing$SWING.json" "static:$C"; do
  name=${run%%:*}; cfg=${run#*:}
  echo "=== $name $(date +%T)"
  timeout 280 python3 -m dostune bench --model gpt2-1.3b --iters 15 --warmup 3 --rounds 2 --clip 0 \
    --methods no-offload,dostune --config "$cfg" --output "$O/$name.json" 2>&1 | grep -v "Warn\|warn\|INFO" | tail -8
done
