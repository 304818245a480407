"""Which DeepSpeed releases dostune runs on, checked when a command or ``dostune.initialize`` needs DeepSpeed.

dostune's ZeRO-3 optimizer subclasses ``DeepSpeedZeroOptimizer_Stage3`` and overrides and calls private
methods of it (dostune/optim), which DeepSpeed changes between releases without notice. A release outside the
tested range may fail in the middle of a step or, worse, compute something else; so it is refused up front
with one line, unless the user says otherwise through ``DOSTUNE_ALLOW_DEEPSPEED``.

Replaced for DeepSpeed: py-cpuinfo's ``get_cpu_info`` (``remember_cpu_info``). DeepSpeed asks it at every
``DeepSpeedCPUAdam`` and twice at every op load (``cpu_arch``, ``simd_width``), and each answer runs a Python
subprocess (1.5-2 s on a 2-core machine); the CPU does not change while a process runs, so the first answer is kept.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import sys
from importlib import metadata
from typing import Optional

from .errors import DostuneError

#: The DeepSpeed releases dostune is tested with, inclusive (pyproject.toml pins the same; a test checks).
TESTED_DEEPSPEED = ("0.19.8", "0.19.8")
#: Set to ``any`` (or to the installed version) to run on an untested DeepSpeed at your own risk.
ALLOW_ENV = "DOSTUNE_ALLOW_DEEPSPEED"


def installed_deepspeed() -> Optional[str]:
    """The installed DeepSpeed's version, read from its metadata (without importing it), or None."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def tested_range() -> str:
    lo, hi = TESTED_DEEPSPEED
    return lo if lo == hi else f"{lo} to {hi}"


def _in_range(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    lo, hi = (Version(x) for x in TESTED_DEEPSPEED)
    # a local or post build of a tested release (0.19.8+cu124) carries the same code
    return lo <= Version(v.base_version) <= hi


def check_deepspeed(purpose: str = "dostune") -> Optional[str]:
    """Raise a one-line DostuneError if DeepSpeed is missing or outside the tested range; return a note to show
    when the range was overridden through DOSTUNE_ALLOW_DEEPSPEED, else None."""
    version = installed_deepspeed()
    pin = f"pip install deepspeed=={TESTED_DEEPSPEED[1]}"
    if version is None:
        raise DostuneError(f"{purpose} needs DeepSpeed, which is not installed", hint=pin)
    if _in_range(version):
        return None
    allowed = os.environ.get(ALLOW_ENV, "").strip()
    if allowed in ("any", version):
        return (f"DeepSpeed {version} is outside dostune's tested range ({tested_range()}); running anyway "
                f"because {ALLOW_ENV}={allowed}")
    raise DostuneError(f"DeepSpeed {version} is installed but {purpose} is tested with DeepSpeed {tested_range()} "
                       "only (it replaces private ZeRO-3 optimizer methods that change between releases)",
                       hint=f"{pin}, or set {ALLOW_ENV}={version} to run at your own risk")


def remember_cpu_info() -> None:
    """Keep py-cpuinfo's first answer for the rest of the process (a copy each call, as a fresh answer would be):
    DeepSpeed calls ``get_cpu_info`` three times to build one engine with CPU Adam and once more for every further
    one, and each call runs a Python subprocess. Measured on a 2-core machine: 1.5-2 s a call, and a tiny ZeRO-3
    engine built and stepped once in 0.6 s instead of 2.1. Called before dostune builds a DeepSpeed engine; a
    second call changes nothing."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then falls back to lscpu itself
        return
    if getattr(cpuinfo.get_cpu_info, "dostune_remembered", False):
        return
    first = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())

    get_cpu_info.dostune_remembered = True
    cpuinfo.get_cpu_info = get_cpu_info


# DeepSpeed's note on every CPU run ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
# printed by deepspeed.comm when it loads its shared-memory or oneCCL op): news only when it is not the case.
_BUILD_NOTE = re.compile(r"DeepSpeed \S+ built successfully")


class StderrWithoutBuildNotes:
    """stdout redirected to stderr, less DeepSpeed's "... built successfully" lines. Writes are passed on by the
    line (a line is held until its newline, or a flush); everything else a file has is stderr's."""

    def __init__(self, target):
        self._target = target
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        kept = [line for line in lines if not _BUILD_NOTE.fullmatch(line.strip())]
        if kept:
            self._target.write("\n".join(kept) + "\n")
        return len(text)

    def flush(self) -> None:
        """Pass on the line begun so far (a prompt, a progress dot), unless it is the note before its newline."""
        if self._pending and not _BUILD_NOTE.fullmatch(self._pending.strip()):
            self._target.write(self._pending)
            self._pending = ""
        self._target.flush()

    def __getattr__(self, name):
        return getattr(self._target, name)


@contextlib.contextmanager
def stdout_to_stderr():
    """Inside: stdout goes to stderr (stdout is for the --json output a script reads), less DeepSpeed's
    "... built successfully" lines (a failed build still raises)."""
    stream = StderrWithoutBuildNotes(sys.stderr)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()  # a last line without its newline, unless it is the note
