#!/usr/bin/env bash
# What `dostune profile --thorough` buys over the default, on a GPU machine: the node and MODEL (default gpt2-1.3b,
# micro-batch 8, seq 1024) profiled in the default mode and with --thorough, each profile's wall seconds, then a tune
# from each pair and, from each pair, the predicted iteration of one fixed schedule (the one tuned from the thorough
# pair), of that pair's own tuned pick and of ZeRO-Offload: one table row per mode. DeepSpeed's CPU Adam and
# dostune's CPU kernel are built first, untimed, so that neither mode's time holds a first build. The modes run one
# after the other, so the host's drift between them shows in the table too. Budgeted for under 9 minutes on one H200
# with gpt2-1.3b.
#   bash scripts/profile-accuracy.sh          # MODEL=..., TRIALS (30), OUT (runs/profile-accuracy) to change them
set -euo pipefail
MODEL=${MODEL:-gpt2-1.3b}
TRIALS=${TRIALS:-30}
OUT=${OUT:-runs/profile-accuracy}
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  { echo "profile-accuracy: needs a CUDA GPU (torch sees none)" >&2; exit 2; }
mkdir -p "$OUT"
echo "== building DeepSpeed's CPU Adam and dostune's CPU kernel (untimed)"
dostune profile --quick --name warm --output "$OUT/warm.json" --force >/dev/null 2>&1
python -c "from dostune.optim import cpu_kernel; cpu_kernel.load()"
for mode in standard thorough; do
  flag=$([ "$mode" = thorough ] && echo --thorough || true)
  mkdir -p "$OUT/$mode"
  echo "== $mode: node profile, $MODEL profile, tune ($TRIALS trials); logs in $OUT/$mode/"
  t0=$SECONDS
  dostune profile --name acc --output "$OUT/$mode/acc.json" --force $flag 2>"$OUT/$mode/node.log"
  t1=$SECONDS
  dostune profile --model "$MODEL" --micro-batch 8 --seq 1024 --name acc --force $flag \
    --output "$OUT/$mode/acc-$MODEL-b8-s1024.json" 2>"$OUT/$mode/model.log"
  echo "$((t1 - t0)) $((SECONDS - t1))" > "$OUT/$mode/seconds"
  dostune tune --profile "$OUT/$mode/acc.json" --model "$MODEL" --trials "$TRIALS" --output-dir "$OUT/$mode/tune" \
    2>"$OUT/$mode/tune.log"
done
MODEL=$MODEL OUT=$OUT python - <<'EOF'
import json, os
from dostune.optim.schedule import ScheduleConfig
from dostune.tune.search import TuneOptions, build_space

model, out = os.environ["MODEL"], os.environ["OUT"]
fixed = json.load(open(f"{out}/thorough/tune/tune.json"))["best"]
print(f"fixed schedule (tuned from the thorough pair): sub_group_size {fixed['sub_group_size']:g}, {fixed['schedule']}")
print("| mode | node profile s | model profile s | fixed schedule's iteration s | tuned pick's s | ZeRO-Offload's s |")
print("|---|---|---|---|---|---|")
for mode in ("standard", "thorough"):
    node_s, model_s = open(f"{out}/{mode}/seconds").read().split()
    space = build_space(TuneOptions(model=model, profile=f"{out}/{mode}/acc.json",
                                    model_profile=f"{out}/{mode}/acc-{model}-b8-s1024.json"))[0]
    it = space.predict_schedule(fixed["sub_group_size"], ScheduleConfig(**fixed["schedule"])).iter_s
    own = json.load(open(f"{out}/{mode}/tune/tune.json"))["best"]["predicted"]["iter_s"]
    print(f"| {mode} | {node_s} | {model_s} | {it:.4f} | {own:.4f} | {space.zero_offload().iter_s:.4f} |")
EOF
