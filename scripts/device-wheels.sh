#!/usr/bin/env bash
# Fill .whl/ with what the GPU device machine (Python 3.12, no network) lacks to run dostune:
# the shared DeepSpeed/Optuna wheels (../shared/device/wheels.sh) plus dostune's CLI dependencies.
# Run from the repository root on the dev machine, then carry ".whl" in the device call.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
if [ -x ../shared/device/wheels.sh ] || [ -f ../shared/device/wheels.sh ]; then
  bash ../shared/device/wheels.sh >/dev/null
fi
mkdir -p .whl
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl \
  typer click shellingham rich markdown-it-py mdurl pygments nvidia-ml-py py-cpuinfo msgpack einops \
  pytest pluggy iniconfig
du -sh .whl
