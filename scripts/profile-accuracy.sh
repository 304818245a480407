#!/usr/bin/env bash
# What `dostune profile --thorough` buys over the default, on a GPU machine.
#   bash scripts/profile-accuracy.sh [MODE...]    MODE: standard, thorough (default: both, one after the other)
#       profiles the node and MODEL (default gpt2-1.3b, micro-batch 8, seq 1024) in that mode into $OUT/MODE/
#       (NAME.json and NAME-MODEL-b8-s1024.json, NAME default "acc"), each profile's wall seconds in $OUT/MODE/seconds
#   bash scripts/profile-accuracy.sh table [CONFIG [ITER_S]]
#       one row per mode found in $OUT: the profiles' wall seconds and the iteration each pair predicts for one fixed
#       schedule (CONFIG, a ds_config.json; default the one tuned from the last mode's pair), beside ITER_S, an
#       iteration measured with that schedule (e.g. by `dostune train`), when given. Needs no GPU.
# The compiled ops are built first (untimed), so that no mode's time holds a first build.
# OUT (runs/profile-accuracy), MODEL, NAME and TRIALS (30) change the defaults.
set -euo pipefail
MODEL=${MODEL:-gpt2-1.3b}
NAME=${NAME:-acc}
TRIALS=${TRIALS:-30}
OUT=${OUT:-runs/profile-accuracy}
if [ "${1:-}" = table ]; then
  CONFIG=${2:-} ITER_S=${3:-} MODEL=$MODEL NAME=$NAME OUT=$OUT python - <<'EOF'
import json, os
from pathlib import Path
from dostune.optim.schedule import ScheduleConfig
from dostune.tune.search import TuneOptions, build_space

model, name, out = os.environ["MODEL"], os.environ["NAME"], Path(os.environ["OUT"])
modes = [m for m in ("standard", "thorough") if (out / m / "seconds").exists()]
config = Path(os.environ["CONFIG"] or out / modes[-1] / "tune" / "ds_config.json")
ds = json.loads(config.read_text())
sgs, sched = ds["zero_optimization"]["sub_group_size"], ScheduleConfig.from_ds_config(ds)
measured = float(os.environ["ITER_S"]) if os.environ["ITER_S"] else None
print(f"fixed schedule ({config}): sub_group_size {sgs:g}, {sched.model_dump(exclude_none=True)}")
print()
print("| mode | node profile s | model profile s | predicted iteration s" + (" | measured s | error |" if measured else " |"))
print("|---|---|---|---" + ("|---|---|" if measured else "|"))
for mode in modes:
    node_s, model_s = (out / mode / "seconds").read_text().split()
    space = build_space(TuneOptions(model=model, profile=out / mode / f"{name}.json",
                                    model_profile=out / mode / f"{name}-{model}-b8-s1024.json"))[0]
    it = space.predict_schedule(sgs, sched).iter_s
    tail = f" | {measured:.3f} | {abs(it - measured) / measured:.1%} |" if measured else " |"
    print(f"| {mode} | {node_s} | {model_s} | {it:.3f}" + tail)
EOF
  exit
fi
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  { echo "profile-accuracy: needs a CUDA GPU (torch sees none)" >&2; exit 2; }
mkdir -p "$OUT"
dostune ops build
for mode in "${@:-standard thorough}"; do
  for m in $mode; do
    flag=$([ "$m" = thorough ] && echo --thorough || true)
    mkdir -p "$OUT/$m"
    echo "== $m: node profile, $MODEL profile, tune ($TRIALS trials); logs in $OUT/$m/"
    t0=$SECONDS
    dostune profile --name "$NAME" --output "$OUT/$m/$NAME.json" --force $flag 2>"$OUT/$m/node.log"
    t1=$SECONDS
    dostune profile --model "$MODEL" --micro-batch 8 --seq 1024 --name "$NAME" --force $flag \
      --output "$OUT/$m/$NAME-$MODEL-b8-s1024.json" 2>"$OUT/$m/model.log"
    echo "$((t1 - t0)) $((SECONDS - t1))" > "$OUT/$m/seconds"
    dostune tune --profile "$OUT/$m/$NAME.json" --model "$MODEL" --trials "$TRIALS" --output-dir "$OUT/$m/tune" \
      2>"$OUT/$m/tune.log"
  done
done
