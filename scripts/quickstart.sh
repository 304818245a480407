#!/usr/bin/env bash
# The main job on a built-in default: install, then profile -> tune -> train (examples/cli_flow.sh), in the
# repository: the profiles land in profiles/, beside the shipped ones, the rest under runs/.
# With a GPU: profile this node and gpt2-1.3b, tune 50 trials, train 200 steps with the tuned config.
# Without one: profile this machine's CPU side for real, tune gpt2-1.3b from the shipped H200 profile (the
# schedule needs GPU and PCIe figures), then train a tiny model on the CPU with the tuned schedule's shape.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
bash examples/cli_flow.sh
