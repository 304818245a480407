#!/usr/bin/env bash
# Run every test marked `gpu` (bit-exact parity with DeepSpeed on CUDA, the Triton Adam, overlap and overflow
# paths) on a machine with a CUDA GPU; elsewhere they are skipped. Extra arguments go to pytest.
#   bash scripts/gpu-tests.sh              # all of them; the log is kept in runs/gpu-tests.log
#   bash scripts/gpu-tests.sh -k parity    # a subset
# Uses the active virtual environment if there is one, else .venv (created by scripts/install.sh if absent).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -d .venv ] || bash scripts/install.sh test || exit 1
  . .venv/bin/activate
fi
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-tests: torch sees no CUDA GPU here, so every gpu test would be skipped" >&2
  exit 2
fi
python -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
mkdir -p runs
python -m pytest -q -m gpu tests "$@" 2>&1 | tee runs/gpu-tests.log
exit "${PIPESTATUS[0]}"
