"""Backward passes of the ZeRO-Offload engine that `dostune profile --model` adds after its timed iterations:

* without the offload's gradient copies: each gradient partition is dropped on the device instead of copied to the
  host, so backward is its compute and ZeRO-3's hooks alone (``backward_no_copy_s``). ZeRO-Offload's backward is this
  plus its copies; dostune's is this plus its own, fewer, copies into page-locked memory;
* the same with dostune's CPU-lane kernel working beside it in a thread (``backward_lane``), as ``overlap_backward``
  runs it: how much the lane slows backward's host-bound hooks, and how fast the lane runs beside them;
* on a GPU, with each gradient partition copied asynchronously into page-locked host memory, as dostune's backward
  copies them (``backward_pinned_copy``): how much of those copies backward hides. ZeRO-Offload's own backward shows
  that only where it ran pinned; on a host too small for its pinned buffers it runs pageable and shows nothing of it.

No step follows these passes (the gradients they leave are not used): the engine is measured, not trained, from here
on. docs/performance-model.md says how the model uses them.
"""
from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import DostuneError
from ..host_steal import QuietRuns
from ..records import SetAside
from ..stats import Stat
from .model_record import BackwardLaneProfile, PinnedCopyProfile, ProbeRound
from .timing import NullProgress, ProgressSink, cpu_samples


def drop_gradient_copies(opt) -> Callable:
    """A ``partition_grads`` for ``opt`` that releases each parameter's gradient as DeepSpeed's does but copies its
    partition nowhere (it stays on the device, unused)."""
    from deepspeed.accelerator import get_accelerator

    synchronized = get_accelerator().is_synchronized_device()

    def partition(params_to_release, grad_partitions):
        for param in params_to_release:
            if not synchronized and param.grad is not None:
                param.grad.record_stream(get_accelerator().current_stream())
            param.grad = None
        return list(grad_partitions)

    return partition


def copy_gradients_pinned(opt, scratch: torch.Tensor) -> Callable:
    """A ``partition_grads`` for ``opt`` that releases each parameter's gradient as DeepSpeed's does and copies its
    partition into the page-locked ``scratch`` (reused: the copies are ordered on the stream they are issued on, the
    same stream DeepSpeed's own copies take, and nothing reads them)."""
    drop = drop_gradient_copies(opt)

    def partition(params_to_release, grad_partitions):
        for g in grad_partitions:
            flat = g.reshape(-1)
            scratch[:flat.numel()].copy_(flat, non_blocking=True)
        return drop(params_to_release, grad_partitions)

    return partition


# updates timed by LaneLoad.alone_in_thread: a 10M-element update took 2-9 ms on the H100 hosts, so 50 cost under half
# a second
LANE_THREAD_UPDATES = 50

# LaneLoad.alone: bursts of updates, each burst an untimed update and the profile's repeats, a pause between them. On
# an H100 host (16 vCPUs, 15 lane threads) the median of one burst of five came out 1.8x its usual 2.2-2.6 ms or more
# in 44 of 964 tries, after a torch operation, a GPU backward, a page-locked allocation or a pause (none of the 138
# taken right after another burst), 32 of them at 9.0 ms, and in 21 of 294 bursts after a pause, whose slow updates came
# in stretches of up to 12 in a row. A model profile that reads its lane that slow makes the tuner send the lane's work
# in backward to the step. Five bursts pooled read that slow in 1 of 58. The pause keeps
# each burst's start as a single burst's was (the first updates after an idle spell run slower), so the usual reading
# stays what the model was validated with.
LANE_ALONE_BURSTS = 5
LANE_ALONE_PAUSE_S = 0.1


class LaneLoad:
    """dostune's CPU-lane kernel (out-of-place CPU Adam: half-precision gradients in, fp32 states and half-precision
    parameters out, streaming stores) on ``subgroups`` scratch subgroups of ``elements`` in turn, round after round in a
    worker thread while the context is open, with Python's GIL switch interval the CPU lane sets while it works."""

    def __init__(self, elements: int, threads: int, half: torch.dtype = torch.bfloat16, subgroups: int = 1):
        from ..optim import cpu_kernel
        from ..optim.kernels import AdamScalarShadow

        cpu_kernel.load()  # build (or find) the kernel before any buffer: a missing compiler is said first
        self._kernel = cpu_kernel
        gen = torch.Generator().manual_seed(0)
        self.elements, self.threads, self.subgroups = elements, threads, subgroups
        # Updates take the scratch subgroups' inputs in turn. One subgroup over and over stays in the last-level cache
        # where it fits (the backward probes' reading); several whose inputs outgrow it are read from memory, as
        # training reads each subgroup once per step (step_lane.py). Outputs go out with streaming stores, past the
        # cache, so one set of them serves all.
        shape = (subgroups, elements)
        self.p = torch.randn(shape, generator=gen)
        self.g = (torch.randn(shape, generator=gen) * 1e-3).to(half)
        self.m, self.v = torch.zeros(shape), torch.zeros(shape)
        self._next = 0
        self.out = [torch.empty(elements) for _ in range(3)]
        self.half = torch.empty(elements, dtype=half)
        shadow = AdamScalarShadow(0.9, 0.999)
        shadow.increment(1, 0.9, 0.999)
        self.scalars = shadow.scalars(1e-4, 1e-8, 0.01, True, True)
        self.spans: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._limit: Optional[int] = None  # alone_in_thread's updates: the worker ends itself after them
        self._thread: Optional[threading.Thread] = None
        self._switch: Optional[float] = None

    def update(self) -> None:
        i, self._next = self._next, (self._next + 1) % self.subgroups
        self._kernel.adam_out_of_place(self.p[i], self.g[i], self.m[i], self.v[i], *self.out, self.scalars,
                                       inv_scale=1.0, half_out=self.half, threads=self.threads)

    def alone(self, repeats: int, bursts: int = LANE_ALONE_BURSTS, pause_s: float = LANE_ALONE_PAUSE_S) -> Stat:
        """``bursts`` of ``repeats`` updates timed in this thread with nothing else running, each burst after an
        untimed update and, from the second on, ``pause_s`` after the last: one Stat over all of them, so one slow
        stretch cannot set it."""
        samples: list[float] = []
        for b in range(bursts):
            if b:
                time.sleep(pause_s)
            samples += cpu_samples(self.update, repeats)
        return Stat.of(samples)

    def alone_in_thread(self, updates: int) -> Stat:
        """``updates`` updates with nothing else running, timed in the worker thread under the lane's GIL switch
        interval while this thread waits (after one untimed): the lane's own conditions, against ``alone``'s main
        thread. Both are recorded, so that a comparison with training's traces can pick one; the model reads
        ``alone``'s, the reading it was validated with."""
        self.spans.clear()
        self._limit = updates + 1
        try:
            with self:
                self._thread.join()
        finally:
            self._limit = None
        timed = [b - a for a, b in self.spans[1:]]
        self.spans.clear()
        return Stat.of(timed)

    def _run(self) -> None:
        while not self._stop.is_set() and (self._limit is None or len(self.spans) < self._limit):
            t0 = time.perf_counter()
            self.update()
            self.spans.append((t0, time.perf_counter()))

    def __enter__(self) -> "LaneLoad":
        from ..optim.overlap import LANE_SWITCH_INTERVAL_S

        self._stop.clear()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, LANE_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="dostune-lane-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    def within(self, windows: list[tuple[float, float]]) -> list[float]:
        """Durations of the updates that ran inside one of ``windows``: whole ones, else (windows shorter than an
        update) every update that overlapped one."""
        inside = [b - a for a, b in self.spans if any(w0 <= a and b <= w1 for w0, w1 in windows)]
        return inside or [b - a for a, b in self.spans if any(a < w1 and b > w0 for w0, w1 in windows)]


def lane_threads() -> int:
    """The CPU lane's default thread count during backward: one fewer than the step's (torch's), leaving a core to
    backward's own host work (ScheduleConfig.backward_cpu_threads)."""
    return max(1, torch.get_num_threads() - 1)


# rounds at most, however short a pass is against ``seconds``: the record keeps every round
MAX_ROUNDS = 400


@dataclass
class BackwardProbes:
    """What measure_backward_probes measured: every reading is the median over all kept rounds."""

    no_copy: Stat  # backward without gradient copies
    forward: Stat  # the forward before each of those passes
    lane: Optional[BackwardLaneProfile]  # None (with a note) where dostune's kernel cannot be built
    pinned_copy: Optional[PinnedCopyProfile]  # None without a CUDA GPU
    rounds: list[ProbeRound]  # each kept round's readings, in the order they ran
    set_aside: SetAside  # rounds set aside for steal
    notes: list[str]


def probe_rounds(repeats: int, seconds: float, round_s: float, gather: Callable[[Optional[float]], list]) -> int:
    """How many rounds spread the probes over ``seconds`` when one takes ``round_s``: at least ``repeats``, at most
    MAX_ROUNDS; under the launcher every rank runs the most any rank needs (``gather``: the value of every rank)."""
    wanted = max(repeats, min(MAX_ROUNDS, math.ceil(seconds / round_s))) if seconds > 0 and round_s > 0 else repeats
    return int(max(gather(wanted)))


def measure_backward_probes(opt, backward: Callable[[], tuple[float, float, float]], repeats: int, lane_elements: int,
                            half: torch.dtype, progress: Optional[ProgressSink] = None,
                            gather: Callable[[Optional[float]], list] = lambda share: [share],
                            seconds: float = 0.0) -> BackwardProbes:
    """``backward()``: one forward and backward of the engine whose optimizer is ``opt``, returning (forward's
    seconds, start, end of the backward on the host clock), synchronised. Rounds of the probes run back to back for
    ``seconds`` (at least ``repeats`` rounds): a host's speed wanders in stretches of seconds, so a few rounds in a
    row read one stretch, and rounds spread over a span the host's usual speed.
    ``gather``: every rank's share of a round (QuietRuns), and every rank's count of rounds."""
    progress = progress or NullProgress()
    pinned = torch.cuda.is_available()
    passes = 3 if pinned else 2
    what = ("backward without gradient copies, with page-locked ones, and beside the CPU lane" if pinned
            else "backward without gradient copies, alone and beside the CPU lane")
    progress.start(what, passes * repeats + 1)
    notes: list[str] = []
    before = opt.partition_grads  # DeepSpeed's own, or a profiling wrapper of it: put back as found
    opt.partition_grads = drop_gradient_copies(opt)
    try:
        def timed() -> tuple[float, float, float]:
            try:
                return backward()
            finally:
                opt.zero_grad()  # no step follows: start the next pass as a fresh iteration
                progress.advance()

        t0 = time.perf_counter()
        timed()  # warm-up: the first pass without copies
        rounds_wanted = probe_rounds(repeats, seconds, passes * (time.perf_counter() - t0), gather)
        if rounds_wanted != repeats:
            progress.start(f"{what}: {rounds_wanted} rounds over about {seconds:.0f} s", passes * rounds_wanted)
        scratch = None
        if pinned:
            params = [p for g in opt.fp16_groups for p in g]
            scratch = torch.empty(max(p.partition_numel() for p in params), dtype=params[0].dtype).pin_memory()
        try:
            lane = LaneLoad(lane_elements, lane_threads(), half)
        except (DostuneError, OSError) as e:
            notes.append(f"backward beside the CPU lane not measured ({str(e).splitlines()[0]}): the tuner predicts "
                         "the lane from stand-in figures; fix that and profile again to measure it")
            lane = None
        lane_alone = lane.alone(repeats) if lane is not None else None
        lane_alone_thread = lane.alone_in_thread(LANE_THREAD_UPDATES) if lane is not None else None
        # The probes take turns, pass by pass (no copies, page-locked copies, beside the lane; again): the model takes
        # their differences, and on the H100 hosts a llama 2B backward without copies read 0.327 s in a block of five
        # passes before the page-locked block read 0.223 s, a host that sped up between them, not copies that help.
        # A round the hypervisor took from is set aside and another runs (QuietRuns); the lane's updates count only
        # inside the kept rounds' windows.
        rounds = QuietRuns(rounds_wanted, gather=gather, on_set_aside=lambda share, left: progress.start(
            f"a round of backward passes set aside: the hypervisor took {share:.1%} of the CPU (steal); at most {left} "
            "more", left * passes))
        while rounds.more():
            rounds.start()
            opt.partition_grads = drop_gradient_copies(opt)
            one = [timed(), None, None]
            if scratch is not None:
                opt.partition_grads = copy_gradients_pinned(opt, scratch)
                one[1] = timed()
                opt.partition_grads = drop_gradient_copies(opt)
            if lane is not None:
                with lane:
                    one[2] = timed()
            rounds.stop(one)
        del scratch
        kept = rounds.kept()
        alone, runs, beside_lane = ([r[k] for r in kept if r[k] is not None] for k in range(3))
        windows = [(a, b) for _, a, b in beside_lane]

        def seconds_of(one) -> Optional[float]:
            return None if one is None else one[2] - one[1]

        def lane_in(one) -> Optional[float]:
            inside = lane.within([one[1:]]) if lane is not None and one is not None else []
            return statistics.median(inside) if inside else None

        first = kept[0][0][1]
        kept_rounds = [ProbeRound(t_s=r[0][1] - first, forward_s=r[0][0], no_copy_s=seconds_of(r[0]),
                                  pinned_copy_s=seconds_of(r[1]), beside_lane_s=seconds_of(r[2]),
                                  lane_update_s=lane_in(r[2])) for r in kept]
        copied = None
        if runs:
            copied = PinnedCopyProfile(bytes=sum(p.partition_numel() for p in params) * params[0].element_size(),
                                       backward_s=Stat.of([b - a for _, a, b in runs]))
        beside = lane.within(windows) if lane is not None else []
        if lane is not None and not beside:
            notes.append("backward beside the CPU lane not recorded: backward ended before one CPU-lane update did (a "
                         "model this small); the tuner predicts the lane from stand-in figures")
        return BackwardProbes(
            no_copy=Stat.of([b - a for _, a, b in alone]), forward=Stat.of([f for f, _, _ in alone]),
            lane=BackwardLaneProfile(
                threads=lane.threads, elements=lane.elements, lane_alone_s=lane_alone,
                lane_alone_thread_s=lane_alone_thread, lane_beside_s=Stat.of(beside),
                backward_s=Stat.of([b - a for a, b in windows])) if beside else None,
            pinned_copy=copied, rounds=kept_rounds, set_aside=rounds.set_aside(), notes=notes)
    finally:
        opt.partition_grads = before
