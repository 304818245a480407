#!/usr/bin/env bash
# On the GPU machine: overlap_backward (CPU lane during backward) against the same optimizer without it,
# gpt2-1.3b, bf16, micro-batch 8, seq 1024, sub_group_size 2e8 (7 subgroups), 16 CPU threads.
#   run(command="bash scripts/device-overlap.sh a", carry=[".whl"])   # GPU tests + no-offload + overlap, no clipping
#   run(command="bash scripts/device-overlap.sh b", carry=[".whl"])   # the other variants and ZeRO-Offload
#   run(command="bash scripts/device-overlap.sh c", carry=[".whl"])   # 2 GPU-lane subgroups, prefetch, clipping
#   run(command="bash scripts/device-overlap.sh d", carry=[".whl"])   # the tuned overlap schedule vs baselines
#   run(command="bash scripts/device-overlap.sh e", carry=[".whl"])   # tuned without overlap, tuned again
#   run(command="bash scripts/device-overlap.sh j", carry=[".whl"])   # GPU lane during backward: tests + tuned vs baselines
#   run(command="bash scripts/device-overlap.sh l", carry=[".whl"])   # 3 of them during backward; CPU-lane-only schedule
#   run(command="bash scripts/device-overlap.sh m", carry=[".whl"])   # the tuned schedule vs baselines (halfgrads runs)
#   run(command="bash scripts/device-overlap.sh n", carry=[".whl"])   # re-tuned after the refit vs the earlier pick
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/overlap-gpt2-1.3b"
O=$OUT/overlap-gpt2-1.3b
bench() {  # NAME CLIP METHODS SCHEDULE
  echo "=== $1 $(date +%T)"
  timeout 400 python3 -m dostune bench --model gpt2-1.3b --iters 7 --warmup 2 --clip "$2" --methods "$3" \
    --dostune-sub-group-size 200000000 --schedule "$4" --output "$O/$1.json" 2>&1 | grep -v Warning | tail -14
}
bench_config() {  # NAME CLIP METHODS CONFIG
  echo "=== $1 $(date +%T)"
  timeout 400 python3 -m dostune bench --model gpt2-1.3b --iters 9 --warmup 2 --clip "$2" --methods "$3" \
    --config "$4" --output "$O/$1.json" 2>&1 | grep -v Warning | tail -16
}
TUNED=results/h100/tune-gpt2-1.3b-overlap/ds_config.json  # dostune tune's pick with overlap in the search
TUNED_GB=results/h100/overlap-gpu-lane-gpt2-1.3b/ds_config.json  # 7 of 14 on the GPU lane, all 7 during backward
S43='{"gpu_fraction":0.43,"gpu_placement":"first","cpu_threads":16,"overlap_backward":true}'
S57='{"gpu_fraction":0.5714,"gpu_placement":"first","cpu_threads":16,"overlap_backward":true}'
S29='{"gpu_fraction":0.29,"gpu_placement":"first","cpu_threads":16,"overlap_backward":true}'
S29P='{"gpu_fraction":0.29,"gpu_placement":"first","cpu_threads":16,"overlap_backward":true,"prefetch_states":true}'
S57OFF='{"gpu_fraction":0.5715,"gpu_placement":"first","cpu_threads":16}'
case "${1:-a}" in
  a)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_kernel.py tests/test_parity_gpu.py -k "overlap or kernel or bitwise or fp16_output" 2>&1 | tail -6
    bench overlap-g43-clip0 0 no-offload,dostune "$S43" ;;
  b)
    bench overlap-g57-clip0 0 dostune "$S57"
    bench nooverlap-g57-clip0 0 zero-offload,dostune "$S57OFF"
    bench overlap-g43-clip1 1.0 dostune "$S43" ;;
  c)  # each variant in its own process; 2 GPU-lane subgroups instead of 3
    bench nooverlap-g57-clip0-rerun 0 dostune "$S57OFF"
    bench overlap-g29-clip0 0 dostune "$S29"
    bench overlap-g29-prefetch-clip0 0 dostune "$S29P"
    bench overlap-g29-clip1 1.0 dostune "$S29" ;;
  d)  # the tuned overlap schedule against no offload and ZeRO-Offload in one process, then with clipping
    bench_config tuned-clip0 0 no-offload,zero-offload,dostune $TUNED
    bench_config tuned-clip1 1.0 dostune $TUNED ;;
  e)  # the earlier tuned schedule without overlap, and the tuned overlap one again (noise between processes)
    bench_config nooverlap-tuned-clip0 0 dostune results/h100/tune-gpt2-1.3b/ds_config.json
    bench_config tuned-clip0-repeat 0 dostune $TUNED ;;
  f)  # fewer CPU Adam threads while backward runs: does backward slow less, and what does the step pay?
    for t in 12 8; do
      python3 -c "import json,sys; c=json.load(open('$TUNED')); c['dostune']['backward_cpu_threads']=$t; json.dump(c, open('/tmp/bt$t.json','w'))"
      bench_config tuned-clip0-bwdthreads$t 0 dostune /tmp/bt$t.json
    done ;;
  g)  # the GPU lane's first states prefetched during backward, or not: A B A B (processes differ by +-0.05 s)
    python3 -c "import json; c=json.load(open('$TUNED')); c['dostune']['prefetch_states']=True; json.dump(c, open('/tmp/pf.json','w'))"
    for r in 1 2; do
      bench_config tuned-clip0-ab$r 0 dostune $TUNED
      bench_config tuned-prefetch-clip0-ab$r 0 dostune /tmp/pf.json
    done ;;
  h)  # one more subgroup to the CPU lane (3 of 14 on the GPU lane) vs the tuned 4 of 14, each against no offload
    python3 -c "import json; c=json.load(open('$TUNED')); c['dostune']['gpu_fraction']=0.2143; json.dump(c, open('/tmp/g3.json','w'))"
    bench_config g3of14-clip0 0 no-offload,dostune /tmp/g3.json
    bench_config tuned-clip0-vs-nooffload 0 no-offload,dostune $TUNED ;;
  i)  # does the CPU lane during backward slow backward? ZeRO-Offload's backward in the same process as reference
    python3 -c "import json; c=json.load(open('$TUNED')); c['dostune']['overlap_backward']=False; json.dump(c, open('/tmp/nov.json','w'))"
    bench_config tuned-vs-zo-overlap-on 0 zero-offload,dostune $TUNED
    bench_config tuned-vs-zo-overlap-off 0 zero-offload,dostune /tmp/nov.json ;;
  j)  # backward_gpu_subgroups: its GPU tests, then the tuned schedule against no offload and ZeRO-Offload
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_parity_gpu.py -k "gpu_lane_during or overflow" 2>&1 | tail -4
    bench_config gb7-clip0 0 no-offload,zero-offload,dostune $TUNED_GB
    bench_config gb7-clip1 1.0 dostune $TUNED_GB ;;
  l)  # 3 of the 7 GPU-lane subgroups during backward vs baselines; the CPU-lane-only tuned schedule on the same machine
    bench_config gb3-clip0 0 no-offload,zero-offload,dostune results/h100/overlap-gpu-lane-gpt2-1.3b/ds_config-backward-gpu-3.json
    bench_config tuned-cpuonly-clip0-same-machine 0 no-offload,dostune $TUNED ;;
  m)  # results/h100/halfgrads-gpt2-1.3b: the tuned overlap schedule against both baselines, twice, then clipping 1.0
    for r in 1 2; do bench_config tuned-clip0-run$r 0 no-offload,zero-offload,dostune $TUNED; done
    bench_config tuned-clip1 1.0 dostune $TUNED ;;
  n)  # the schedule tuned after the CPU-lane refit against the earlier pick, each with no offload in its process
    bench_config retuned-vs-nooffload 0 no-offload,dostune results/h100/tune-gpt2-1.3b-halfgrads/ds_config.json
    bench_config tuned-vs-nooffload 0 no-offload,dostune $TUNED ;;
esac
echo "=== done $(date +%T)"
