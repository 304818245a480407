#!/usr/bin/env bash
# Install what the tests need into .venv, run the suite (GPU tests skip without a GPU), then the CPU
# regression gate on the optimizer step (scripts/ci-bench-check.sh, docs/ci-gate.md) whatever the suite said,
# and end with one line for both, e.g. "tests: failed (exit 1) | cpu gate: passed". Exit 0 only when both passed
# (a gate that steps aside for a shallow clone counts as passed and says it was skipped).
# This is the README's test command; .ci/run calls exactly this.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! bash scripts/install.sh test; then
  echo "tests: not run (the install failed) | cpu gate: not run (the install failed)"
  exit 1
fi
. .venv/bin/activate
python -m pytest -q "$@"
tests_rc=$?
case $tests_rc in
  0) tests="passed" ;;
  5) tests="failed (pytest collected no tests)"; tests_rc=1 ;;
  *) tests="failed (exit $tests_rc)" ;;
esac
# the optimizer step must not get slower than at the pinned commit (dostune check runs the CPU gate); its output
# is kept to tell a gate that stepped aside (it says SKIPPED and exits 0) from one that ran
gate_log=$(mktemp)
bash scripts/ci-bench-check.sh 2>&1 | tee "$gate_log"
gate_rc=${PIPESTATUS[0]}
case $gate_rc in
  0) if grep -q "ci-bench-check: SKIPPED" "$gate_log"; then gate="skipped (the pinned commit is not in this checkout)"
     else gate="passed"; fi ;;
  1) gate="failed (exit 1: the step is slower than the pinned commit's)" ;;
  *) gate="could not run (exit $gate_rc)" ;;
esac
rm -f "$gate_log"
echo "tests: $tests | cpu gate: $gate"
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$gate_rc"
