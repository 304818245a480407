#!/usr/bin/env bash
# The main job on a built-in default: install, then profile this node. On a machine without a
# GPU the CPU side is measured for real and the GPU side is reported as not available.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
dostune profile --force
