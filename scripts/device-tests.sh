#!/usr/bin/env bash
# Run the GPU-marked tests on the device machine in one call:
#   run(command="bash scripts/device-tests.sh", carry=[".whl"])
# Extra arguments go to pytest (e.g. -k parity).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device-env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests "$@" 2>&1 | tee "${OUT:-/tmp}/gpu-tests.log"
