"""The CPU regression gate on dostune's optimizer step (docs/ci-gate.md): this tree's schedule timed against the
same schedule at a pinned commit, both lanes and overlap_backward on, in two processes that take turns.

What runs. Two worker processes, one importing this tree's dostune and one a pinned commit's (exported from git
into a temporary folder), each build the same engine from the same seed: ZeRO-3 with CPU offload and dostune's
schedule. Without CUDA the GPU lane runs on the CPU device through the same schedule, staging slots and hand-offs
(as the parity tests run it). This process tells them in turn to run one iteration, A B B A ..., so only one works
at a time, and each reports the time of its optimizer step.

Why a pinned commit and not DeepSpeed's own step as the reference. The machine's other jobs compete for memory
bandwidth, which slows dostune's CPU-lane kernel (more streams, out of place) more than DeepSpeed's in-place
Adam: dostune's step over DeepSpeed's moved by 20% between runs of one tree. The same code at two commits is
slowed alike, so on an unchanged tree the ratio is 1 on any machine, and no measured number has to be stored.

Why the step alone, and why clipping is certain. On a CPU, ZeRO-3's backward spends several times as long per
element as CPU Adam, so a CPU lane overlapped with backward ends inside it and a slower lane costs nothing a clock
can see. The gate clips at a threshold below any gradient norm: overlap_backward then stops speculating at the
first subgroup that becomes ready (its partial-norm cutoff, the path training takes whenever clipping is
certain) and the whole CPU lane runs in the step, beside the GPU lane. The overlap machinery still runs: the lane
worker, shadow buffers, their commit.

Each worker (gate_worker.py) reports its step's CPU time, with one thread and glibc keeping freed memory, for the
reasons given there. The statistic, each step against the pinned one beside it, and the rule that ends a run's
rounds of turns are gate_statistic.py's.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, Field, model_validator

from ..errors import DostuneError, ProfileError
from ..records import Record
from .gate_statistic import paired_ratio, settled
from .gate_worker import SLOW_CPU_LANE_ENV, cpu_lane_slowdown, worker

GATE_KIND = "dostune.gate"
GATE_SCHEMA_VERSION = 2  # 2: a run is timed in rounds (max_pairs, confidence)
# What the workers of the pinned commit and of this tree say to each other; a change moves the pin too.
PROTOCOL = 1
# One GPU-lane subgroup of 2.4M elements (the sixth of seven: gpu_fraction 0.17, spread), six on the CPU lane.
GATE_SCHEDULE = {"gpu_fraction": 0.17, "gpu_placement": "spread", "overlap_backward": True, "cpu_threads": 1,
                 "backward_cpu_threads": 1}


class GateSettings(Record):
    """What each worker builds and how the two are timed."""

    model: str = "ci-gate"
    micro_batch: int = Field(1, ge=1)
    # 4 tokens: the step's work depends on the parameters alone, and backward (untimed) is 3x shorter than at 16
    # on a CPU whose bf16 matmuls take a slow path (AVX2 without AVX-512: about 0.77 s at 16 tokens, 0.25 s at 4)
    seq: int = Field(4, ge=1)
    precision: Literal["bf16", "fp16"] = "bf16"
    sub_group_size: int = Field(2_000_000, ge=1)
    clip: float = Field(1e-6, gt=0)  # below any gradient norm: the CPU lane runs in the step (module docstring)
    threads: int = Field(1, ge=1)  # torch's intra-op threads in each worker
    schedule: dict = Field(default_factory=lambda: dict(GATE_SCHEDULE))
    # Engines per worker, stepped in turn: two identical engines in one process differ by up to 5% in step time
    # (where their buffers landed in memory); comparing each with its twin in the other worker over four of them
    # averages that out (about 0.55 GiB each)
    engines: int = Field(4, ge=1, le=8)
    seed: int = 0
    # The rest is the parent's alone (how long it times and how it judges): the workers are not sent it, so it can
    # change under the same pin (the pinned commit's worker refuses keys it does not know).
    pairs: int = Field(40, ge=4)  # timed turns per round: one step of each worker per turn
    # the most timed turns a run takes before it is judged on what it has (four rounds); only a run that the
    # machine's load left unable to tell sooner takes them
    max_pairs: int = Field(160, ge=4)
    warmup: int = Field(8, ge=1)  # untimed turns, spread over the engines
    # of the interval that must lie clear of the tolerance for a run to stop before max_pairs
    confidence: float = Field(0.99, gt=0.5, lt=1)

    @model_validator(mode="after")
    def _rounds_fit(self):
        if self.max_pairs < self.pairs:
            raise ValueError(f"max_pairs ({self.max_pairs}) is below pairs ({self.pairs}), one round")
        return self


# What a worker builds its engines from: all it is sent.
WORKER_FIELDS = frozenset({"model", "micro_batch", "seq", "precision", "sub_group_size", "clip", "threads",
                           "schedule", "engines", "seed"})


class GateBaseline(Record):
    """The committed gate baseline (results/ci-cpu/gate.json): the commit whose dostune is the reference."""

    schema_version: int = GATE_SCHEMA_VERSION
    kind: Literal["dostune.gate"] = GATE_KIND
    baseline_commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    pinned: str  # when, and why if given
    settings: GateSettings = Field(default_factory=GateSettings)


class GateRun(BaseModel):
    """One gate run: this tree's step over the pinned commit's."""

    ratio: float  # the statistic (CPU time): the median over the pairs of this tree's step over the one beside it
    low: float  # the confidence interval of ratio (settings.confidence)
    high: float
    wall_ratio: float  # the same on wall-clock time (reported, not judged)
    engine_ratios: list[float]  # each engine pair's own median (their spread: what memory placement does)
    current_cpu_s: list[float]  # each timed step, in the order they ran; step j of both sides ran in turn j
    baseline_cpu_s: list[float]
    current_wall_s: list[float]
    baseline_wall_s: list[float]
    rounds: int  # rounds of settings.pairs turns the run took before it settled or reached max_pairs
    lanes: list[str]  # the plan's lane per subgroup
    speculative: int  # CPU-lane updates started during backward (0: the whole lane ran in the step)
    slow_cpu_lane: float  # the test-only slowdown in this tree's worker (DOSTUNE_TEST_SLOW_CPU_LANE)
    seconds: float

    @property
    def noise(self) -> float:
        """Half the width of the ratio's confidence interval, relative to the ratio: how far the run's own pairs
        leave the ratio uncertain (what the machine's other jobs did to it)."""
        return (self.high - self.low) / (2 * self.ratio)


class GateError(DostuneError):
    exit_code = 2


def _git(repo: Path, *args: str, binary: bool = False):
    import subprocess

    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=not binary)
    if res.returncode != 0:
        err = res.stderr if not binary else res.stderr.decode(errors="replace")
        raise GateError(f"git {' '.join(args[:2])} failed in {repo}: {err.strip().splitlines()[-1] if err else '?'}")
    return res.stdout


def package_root() -> Path:
    """The folder holding the running dostune package (what this tree's worker imports)."""
    return Path(__file__).resolve().parents[2]


def repository(commit: str) -> Path:
    """The git repository that has ``commit``: the one holding this dostune, else the current folder's."""
    import subprocess

    for start in (package_root(), Path.cwd()):
        res = subprocess.run(["git", "-C", str(start), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if res.returncode != 0:
            continue
        repo = Path(res.stdout.strip())
        if subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0:
            return repo
    raise GateError(f"the CPU gate runs dostune at commit {commit[:12]} beside this tree, and no git repository here "
                    "has that commit", hint=f"run it from a clone of dostune with its history (git fetch origin "
                    f"{commit}), or pin another commit (docs/ci-gate.md)")


def export_package(repo: Path, commit: str, dest: Path) -> None:
    """Write the dostune package as it was at ``commit`` under ``dest``."""
    import io
    import tarfile

    data = _git(repo, "archive", "--format=tar", commit, "dostune", binary=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        # the "data" filter (refuse links out of dest, device files) where this Python has it
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def _worker_env(root: Path, slow: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}  # a world of its own
    env["PYTHONPATH"] = str(root)
    if not slow:
        env.pop(SLOW_CPU_LANE_ENV, None)
    return env


class _Worker:
    def __init__(self, name: str, root: Path, settings: GateSettings, slow: bool, logdir: Path):
        import subprocess

        self.name = name
        self.log = logdir / f"{name}.log"
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dostune.bench.gate", "worker",
                                      settings.model_dump_json(include=WORKER_FIELDS)], cwd=root,
                                     env=_worker_env(root, slow), text=True, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, bufsize=1)

    def read(self, timeout_s: float = 300.0) -> dict:
        import select

        # one line answers each request and nothing follows it, so the pipe holds no more than select sees
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            self.close()
            raise GateError(f"the gate's {self.name} worker did not answer within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise self._stopped()
        return json.loads(line)

    def ask(self, line: str) -> dict:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it had stopped already: say how, not "Broken pipe"
            raise self._stopped() from None
        return self.read()

    def _stopped(self) -> GateError:
        self.proc.wait()
        self._err.flush()
        tail = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()][-1:] or ["(no output)"]
        code = self.proc.returncode
        how = f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        if code == -signal.SIGKILL:
            how += ", as the kernel does when memory runs out"
        return GateError(f"the gate's {self.name} worker stopped ({how}): {tail[0][:300]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


def take_turns(s: GateSettings, tolerance: float, ask: Callable[[str, bool], dict],
               progress) -> tuple[dict[str, list[dict]], int]:
    """Step the two workers in turn (``ask(name, timed)`` runs one iteration of that worker and returns its
    answer): the warm-up, then rounds of ``s.pairs`` timed turns until the ratio's interval is clear of
    1 + ``tolerance`` or ``s.max_pairs`` turns are timed. Returns each side's timed answers and the rounds."""
    times: dict[str, list[dict]] = {"current": [], "baseline": []}

    def turns(first: int, n: int) -> None:
        for k in range(first, first + n):
            # A B, then B A: neither always runs right after the other
            for name in (("current", "baseline") if k % 2 == 0 else ("baseline", "current")):
                out = ask(name, k >= s.warmup)
                if k >= s.warmup:
                    times[name].append(out)
            progress.advance()

    progress.start(f"gate: {s.warmup} warm-up and {s.pairs} timed steps of each, taking turns", s.warmup + s.pairs)
    turns(0, s.warmup + s.pairs)
    rounds = 1
    while True:
        ratio, low, high = paired_ratio([x["cpu"] for x in times["current"]], [x["cpu"] for x in times["baseline"]],
                                        s.confidence)
        more = min(s.pairs, s.max_pairs - len(times["current"]))
        if settled(low, high, tolerance) or more <= 0:
            return times, rounds
        progress.start(f"gate: {ratio - 1:+.1%} so far ({s.confidence:.0%} interval {low - 1:+.1%} to "
                       f"{high - 1:+.1%}), which a busy machine leaves on both sides of the {tolerance:.0%} "
                       f"tolerance: {more} more timed steps of each", more)
        turns(s.warmup + len(times["current"]), more)
        rounds += 1


def run_gate(base: GateBaseline, tolerance: float, progress=None) -> GateRun:
    """Export the pinned commit's dostune, start both workers and time them taking turns, a round of ``pairs``
    turns at a time, until the ratio's interval is clear of 1 + ``tolerance`` or ``max_pairs`` turns are timed."""
    import tempfile

    from ..profile.timing import NullProgress

    progress = progress or NullProgress()
    s = base.settings
    cpu_lane_slowdown()  # a malformed switch stops here, not in a worker
    t_start = time.perf_counter()
    repo = repository(base.baseline_commit)
    with tempfile.TemporaryDirectory(prefix="dostune-gate-") as tmp:
        pinned = Path(tmp) / "pinned"
        export_package(repo, base.baseline_commit, pinned)
        progress.start(f"gate: building this tree's engine and commit {base.baseline_commit[:12]}'s", 1)
        workers = {"current": _Worker("current", package_root(), s, True, Path(tmp)),
                   "baseline": _Worker("baseline", pinned, s, False, Path(tmp))}
        try:
            ready = {k: w.read(timeout_s=900.0) for k, w in workers.items()}  # a first CPU Adam build: minutes
            for k, r in ready.items():
                if r.get("protocol") != PROTOCOL:
                    raise GateError(f"the {k} worker speaks gate protocol {r.get('protocol')}, this one {PROTOCOL}",
                                    hint="pin a commit whose gate matches (docs/ci-gate.md)")
            progress.advance()

            times, rounds = take_turns(s, tolerance, lambda name, timed: workers[name].ask(f"step {int(timed)}"),
                                       progress)
            end = {k: w.ask("end") for k, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
    cur = {m: [x[m] for x in times["current"]] for m in ("cpu", "wall")}
    ref = {m: [x[m] for x in times["baseline"]] for m in ("cpu", "wall")}
    ratio, low, high = paired_ratio(cur["cpu"], ref["cpu"], s.confidence)
    # timed step j of both workers ran in turn warmup + j, on engine (warmup + j) mod engines of each
    by_engine = [[j for j in range(len(cur["cpu"])) if (s.warmup + j) % s.engines == e] for e in range(s.engines)]
    engine_ratios = [paired_ratio([cur["cpu"][j] for j in js], [ref["cpu"][j] for j in js], s.confidence)[0]
                     for js in by_engine if js]
    wall_ratio = paired_ratio(cur["wall"], ref["wall"], s.confidence)[0]
    return GateRun(ratio=ratio, low=low, high=high, wall_ratio=wall_ratio, engine_ratios=engine_ratios,
                   current_cpu_s=cur["cpu"], baseline_cpu_s=ref["cpu"], current_wall_s=cur["wall"],
                   baseline_wall_s=ref["wall"], rounds=rounds,
                   lanes=ready["current"]["lanes"], speculative=end["current"]["speculative"],
                   slow_cpu_lane=ready["current"]["slow_cpu_lane"], seconds=time.perf_counter() - t_start)


def load_gate(path) -> GateBaseline:
    from ..records import load_record

    return load_record(path, GateBaseline, "gate baseline", GATE_KIND, GATE_SCHEMA_VERSION)


def is_gate_record(path) -> bool:
    """Whether a JSON record names itself a gate baseline (anything else is read as a bench result)."""
    from ..records import read_json_record

    try:
        return read_json_record(path, "baseline").get("kind") == GATE_KIND
    except ProfileError:
        return False


def pin(commit: str = "HEAD", why: str = "", settings: Optional[GateSettings] = None,
        repo: Optional[Path] = None) -> GateBaseline:
    """A baseline that pins ``commit`` of ``repo`` (default: this dostune's); HEAD must have no uncommitted change
    in dostune/, or the pinned commit would not be what this tree runs."""
    repo = repo or package_root()
    sha = _git(repo, "rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    if commit == "HEAD" and _git(repo, "status", "--porcelain", "--", "dostune").strip():
        raise GateError("dostune/ has uncommitted changes: the pinned commit would not hold what this tree runs",
                        hint="commit them first, then pin")
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return GateBaseline(baseline_commit=sha, pinned=when + (f": {why}" if why else ""),
                        settings=settings or GateSettings())


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dostune.bench.gate", description="The CPU gate's baseline and "
                                 "worker (docs/ci-gate.md); `dostune check --baseline <gate baseline>` runs the gate.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pin", help="write a gate baseline that pins a commit")
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--why", default="", help="a few words on why the pin moves")
    p.add_argument("--output", type=Path, required=True)
    w = sub.add_parser("worker", help="one side of a gate run (started by the gate itself)")
    w.add_argument("settings")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return worker(args.settings)
    from ..records import atomic_write_text

    try:
        base = pin(args.commit, args.why)
    except DostuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(args.output, base.model_dump_json(indent=2) + "\n")
    print(f"{args.output}: the gate now compares against {base.baseline_commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
