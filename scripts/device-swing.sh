#!/usr/bin/env bash
# On the GPU machine: gpt2-1.3b, bf16, micro-batch 8, seq 1024, no clipping; each variant a drift-cancelling bench
# (--rounds 2) against no offload, starting from dostune tune's pick (results/h100/tune-gpt2-1.3b-resident/):
#   swing   adaptive_swing=$SWING (default 4; the pick streams 9 GPU-lane subgroups), after its GPU tests
#   static  the pick as tuned
#   passive the pick with OMP_WAIT_POLICY=PASSIVE for the whole process: libgomp's workers sleep after each
#           parallel region instead of spinning ~10 ms (scripts/omp-spin.py), also beside backward's hooks
#   run(command="bash scripts/device-swing.sh swing static", carry=[".whl"])   # ~6-8 min on a warm machine
#   run(command="bash scripts/device-swing.sh passive static", carry=[".whl"])
# Writes under $OUT/swing-gpt2-1.3b: the GPU tests' tail, each bench (.json/.md/timeline), the swing config;
# the swing bench's .md says how many steps ran with each swing. Results so far: results/h100/swing-gpt2-1.3b/
# (indexed in results/README.md); re-running overwrites $OUT's files of the same name, so copy them out per call.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; O=$OUT/swing-gpt2-1.3b; mkdir -p "$O"
C=results/h100/tune-gpt2-1.3b-resident/ds_config.json
SWING=${SWING:-4}
bench() {  # NAME CONFIG [ENV...]
  local name=$1 cfg=$2; shift 2
  echo "=== $name $(date +%T)"
  env "$@" timeout 280 python3 -m dostune bench --model gpt2-1.3b --iters 15 --warmup 3 --rounds 2 --clip 0 \
    --methods no-offload,dostune --config "$cfg" --output "$O/$name.json" 2>&1 | grep -v "Warn\|warn\|INFO" | tail -8
}
[ $# -gt 0 ] || set -- swing static
for variant in "$@"; do
  case $variant in
    swing)
      python3 - "$C" "$O/ds_config-swing$SWING.json" "$SWING" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["dostune"]["adaptive_swing"] = int(sys.argv[3])
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
EOF
      python3 -m pytest -q -m gpu tests/test_parity_gpu.py -k adaptive 2>&1 | tail -3 | tee "$O/gpu-tests-swing.log"
      bench "swing$SWING" "$O/ds_config-swing$SWING.json" ;;
    static) bench static "$C" ;;
    passive) bench passive "$C" OMP_WAIT_POLICY=PASSIVE ;;
    *) echo "unknown variant $variant (swing, static, passive)"; exit 2 ;;
  esac
done
