#!/usr/bin/env bash
# On the GPU machine: does keeping backward's hook thread on a CPU of its own (and the CPU lane's threads off it)
# shorten a dostune backward? gpt2-1.3b, bf16, micro-batch 8, seq 1024, no clipping, the 25M-subgroup tuned pick
# (results/h100/tune-gpt2-1.3b-resident/) with adaptive_swing 9; each A/B alternates iterations of one engine
# (scripts/device-profile-backward.py's ALT), so the host's drift between processes does not enter.
# Variants: pin (every other iteration), threads (fewer CPU-lane threads in backward, in blocks of 4 iterations so
# that adaptive_swing can rebalance the step; the first of each block is not timed).
#   run(command="bash scripts/device-pin.sh pin threads", carry=[".whl"])   # ~5 min each on a fresh machine
# Writes under $OUT/pin-gpt2-1.3b: each A/B's result lines, the CPU kernel's and worker's tests' tail.
# Results: results/h100/pin-gpt2-1.3b/ (indexed in results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; O=$OUT/pin-gpt2-1.3b; mkdir -p "$O"
C=results/h100/swing-gpt2-1.3b/ds_config-swing9.json
lscpu > "$O/lscpu.txt"
ab() {  # NAME ALT [PATCH...]
  local name=$1 alt=$2; shift 2
  echo "=== $name $(date +%T)"
  ALT="$alt" timeout 240 python3 scripts/device-profile-backward.py "$C" "$@" 2>&1 | grep "^==\|Error\|error" \
    | tee "$O/$name.txt"
}
[ $# -gt 0 ] || set -- pin
for variant in "$@"; do
  case $variant in
    pin)
      python3 -m pytest -q tests/test_overlap_worker.py tests/test_cpu_kernel.py 2>&1 | tail -3 | tee "$O/tests.log"
      ab alt-pin '{"_overlap.pin_threads": true}' '{"backward_cpu_threads": 12}'
      ab alt-threads10 '{"_overlap.threads_backward": 10}'
      ab alt-pin-threads10 '{"_overlap.pin_threads": true, "_overlap.threads_backward": 10}' ;;
    threads)
      for t in 12 10 8; do BLOCK=4 ab "block-threads$t" "{\"_overlap.threads_backward\": $t}"; done ;;
    *) echo "unknown variant $variant (pin, threads)"; exit 2 ;;
  esac
done
