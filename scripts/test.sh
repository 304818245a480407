#!/usr/bin/env bash
# Install what the tests need into .venv, run the suite (GPU tests skip without a GPU), then the CPU
# regression gate on the optimizer step (scripts/ci-bench-check.sh, docs/ci-gate.md).
# This is the README's test command; .ci/run calls exactly this.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test || exit 1
. .venv/bin/activate
python -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
[ $rc -ne 0 ] && exit $rc
# the optimizer step must not get slower than at the pinned commit (dostune check runs the CPU gate)
bash scripts/ci-bench-check.sh
