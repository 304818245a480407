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
# pip's output only when it fails: an editable install otherwise prints setuptools' multi-line notice about it
pip_quiet() {
  local out
  if ! out=$(python -m pip install -q "$@" 2>&1); then
    echo "$out" >&2
    echo "install.sh: pip install $* failed" >&2
    return 1
  fi
}
pip_quiet --upgrade pip || echo "install.sh: going on with $(python -m pip --version | cut -d' ' -f1-2)" >&2
# whether torch is there, without importing it: torch imported before numpy is installed warns "Failed to initialize
# NumPy" (numpy comes with dostune's own requirements, below)
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_quiet torch || exit 1
  else
    pip_quiet torch==2.13.0 || exit 1
  fi
fi
# constrained to the torch installed above: an extra's dependency (accelerate, in dostune[hf]) must not swap its build
torch_pin=$(mktemp)
python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > "$torch_pin"
pip_quiet -e ".${extra:+[$extra]}" -c "$torch_pin" || { rm -f "$torch_pin"; exit 1; }
rm -f "$torch_pin"
# DeepSpeed's CPU Adam (a minute or two) and dostune's CPU kernel, compiled now into this environment's own folder:
# runs then load them, and compile and lock nothing
python -m dostune ops build || { echo "install.sh: building the compiled ops failed (see above)" >&2; exit 1; }
# versions from the packages' metadata: importing DeepSpeed here would print its accelerator banner
python -c "from importlib.metadata import version as v; import dostune; print('dostune', dostune.__version__, \
'| torch', v('torch'), '| deepspeed', v('deepspeed'))"
