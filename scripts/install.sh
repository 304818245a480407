#!/usr/bin/env bash
# Create .venv (if absent) and install dostune into it. On a machine without a CUDA build of torch,
# pin the local CPU build first: a loose torch requirement would pull a multi-GB CUDA build.
# Usage: bash scripts/install.sh [extra]   (extra: "test" adds pytest and the hf extra; "hf" adds transformers
# and accelerate)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch 2>&1 | grep -v "is ignored" || true
  else
    python -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
  fi
fi
# constrained to the torch installed above: an extra's dependency (accelerate, in dostune[hf]) must not swap its build
torch_pin=$(mktemp)
python -c "import torch; print('torch==' + torch.__version__)" > "$torch_pin"
python -m pip install -q -e ".${extra:+[$extra]}" -c "$torch_pin" 2>&1 | grep -v "is ignored" || true
rm -f "$torch_pin"
python -c "import dostune, deepspeed, torch; print('dostune', dostune.__version__, '| torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
