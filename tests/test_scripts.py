"""scripts/test.sh (the README's test command, which .ci/run calls) and scripts/install.sh: the CPU gate runs whatever
the suite said, one line sums up both, and the exit code fails when either failed."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path):
    """A copy of scripts/test.sh beside stand-ins for what it runs: the install, pytest and the gate each record
    that they ran and exit as the test says."""
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "install.sh").write_text('echo install-ran; exit "${INSTALL_RC:-0}"\n')
    (tmp_path / "scripts" / "ci-bench-check.sh").write_text(
        'if [ -n "${GATE_SKIP:-}" ]; then echo "ci-bench-check: SKIPPED: the gate\'s pinned commit abc is not in this '
        'checkout" >&2; exit 0; fi\necho gate-ran; exit "${GATE_RC:-0}"\n')
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text('export PATH="$(dirname "${BASH_SOURCE[0]}"):$PATH"\n')
    (bin_dir / "python").write_text('#!/bin/sh\necho "pytest-ran $*"; exit "${PYTEST_RC:-0}"\n')
    (bin_dir / "python").chmod(0o755)
    return tmp_path


def _run(tree: Path, *args, **env):
    r = subprocess.run(["bash", str(tree / "scripts" / "test.sh"), *args], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env))
    return r.returncode, r.stdout + r.stderr, r.stdout.splitlines()[-1]


@pytest.mark.parametrize("pytest_rc,gate_rc,rc,summary", [
    ("0", "0", 0, "tests: passed | cpu gate: passed"),
    ("1", "0", 1, "tests: failed (exit 1) | cpu gate: passed"),
    ("0", "1", 1, "tests: passed | cpu gate: failed (exit 1: the step is slower than the pinned commit's)"),
    ("2", "1", 2, "tests: failed (exit 2) | cpu gate: failed (exit 1: the step is slower than the pinned commit's)"),
    ("5", "0", 1, "tests: failed (pytest collected no tests) | cpu gate: passed"),
    ("0", "2", 2, "tests: passed | cpu gate: could not run (exit 2)"),
])
def test_the_gate_runs_whatever_pytest_said_and_one_line_says_both(tree, pytest_rc, gate_rc, rc, summary):
    got_rc, out, last = _run(tree, "-k", "fast", PYTEST_RC=pytest_rc, GATE_RC=gate_rc)
    assert (got_rc, last) == (rc, summary), out
    assert "pytest-ran -m pytest -q -k fast" in out and "gate-ran" in out


def test_a_skipped_gate_is_said(tree):
    rc, out, last = _run(tree, GATE_SKIP="1")
    assert rc == 0 and last == "tests: passed | cpu gate: skipped (the pinned commit is not in this checkout)", out


def test_a_failed_install_runs_neither_and_says_so(tree):
    rc, out, last = _run(tree, INSTALL_RC="1")
    assert rc == 1 and last == "tests: not run (the install failed) | cpu gate: not run (the install failed)", out
    assert "pytest-ran" not in out and "gate-ran" not in out


def test_ci_calls_exactly_the_test_command():
    lines = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert lines[-1] == "bash scripts/test.sh"


def test_install_builds_the_ops_and_never_imports_torch_before_numpy_is_installed():
    """torch imported before numpy is installed prints "Failed to initialize NumPy": the first line a new user saw.
    Before dostune (and with it numpy) is installed, the script looks torch up without importing it."""
    text = (ROOT / "scripts" / "install.sh").read_text()
    before = text[:text.index('pip_quiet -e ".')]
    assert not re.search(r"import torch|from torch", before)
    assert "python -m dostune ops build" in text[text.index('pip_quiet -e ".'):]
