"""The optimizer step simulated as dostune's optimizer runs it (equations in docs/performance-model.md).

The GPU lane's transfers queue on the H2D and D2H copy engines in order (the H2D engine serves copies in submission
order, so CPU-lane uploads wait behind the GPU lane's own inputs, as traced on the H100, though not behind those of
subgroups lent to it, as traced on the H200), its inputs slowed while the CPU lane computes, the GPU kernel follows
each input, the CPU lane runs subgroup after subgroup, slowed while DMA runs, and each CPU-updated subgroup's upload
follows its update. With ``overlap_backward`` the CPU lane's worker starts under backward where its speculation
succeeds (the ``no_clip`` regime), or in the step where clipping stops it (``clip``, lanes.py). model.py puts the
simulated step beside backward to predict the iteration; every coefficient comes from the profiles (coefficients.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..optim.footprint import GRAD_BYTES, STATE_BYTES, cpu_lane_reach, half_ring_count
from ..optim.balance import LaneTimes, lane_times
from ..optim.schedule import Plan, ScheduleConfig, make_plan
from .coefficients import StepShape
from .inputs import NodeInputs
from .lanes import Regime, lent_subgroups, speculating_subgroups


@dataclass
class SimSpan:
    lane: str  # cpu, h2d, gpu, d2h, up; grad: backward's gradient copies to the host (before 0)
    subgroup: int
    start: float
    end: float
    gbps: float = 0.0  # PCIe traffic while it runs (copies only)


@dataclass
class StepPrediction:
    lanes_s: float  # from the first lane operation to the last
    overhead_s: float  # DeepSpeed's step prologue and epilogue (coefficients.ds_step_overhead)
    spans: list[SimSpan] = field(default_factory=list)
    cpu_busy_s: float = 0.0
    h2d_busy_s: float = 0.0
    d2h_busy_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.lanes_s + self.overhead_s


def _advance(t: float, work: float, segments: Sequence[tuple[float, float, float]]) -> float:
    """Finish ``work`` seconds (uncontended) of CPU work started at ``t``; inside each (start, end, slowdown)
    segment (sorted, disjoint) the CPU runs ``slowdown`` times slower."""
    for a, b, slow in segments:
        if b <= t:
            continue
        if a > t:  # free stretch before this segment
            if t + work <= a:
                return t + work
            work -= a - t
            t = a
        span = (b - t) / slow  # work done if we run slowed to the end of this segment
        if work <= span:
            return t + work * slow
        work -= span
        t = b
    return t + work


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _dma_segments(spans: Sequence["SimSpan"], contention: float, contention_gbps: float,
                  ) -> list[tuple[float, float, float]]:
    """Piecewise-constant CPU slowdown from the DMA traffic of ``spans``: a profile measured the CPU work
    ``contention`` times slower under ``contention_gbps`` of combined H2D+D2H traffic (the node profile DeepSpeed's
    CPU Adam, the model profile the step's CPU lane); the slowdown is taken to scale linearly with the traffic actually
    running."""
    edges = []
    for x in spans:
        if x.lane in ("h2d", "d2h", "up", "grad") and x.end > x.start:
            edges += [(x.start, x.gbps), (x.end, -x.gbps)]
    edges.sort()
    out, level, prev = [], 0.0, None
    for t, d in edges:
        if prev is not None and t > prev and level > 1e-9:
            slow = 1.0 + (contention - 1.0) * min(1.0, level / contention_gbps)
            out.append((prev, t, slow))
        level += d
        prev = t
    return out


def _clip(segments: Sequence[tuple[float, float, float]], lo: float, hi: float) -> list[tuple[float, float, float]]:
    return [(max(a, lo), min(b, hi), k) for a, b, k in segments if min(b, hi) > max(a, lo)]


def _compose(*segment_lists: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """Sorted, disjoint (start, end, slowdown) segments from several lists that may overlap: where they do,
    their slowdowns multiply."""
    nonempty = [segs for segs in segment_lists if segs]
    if len(nonempty) <= 1:
        return list(nonempty[0]) if nonempty else []
    cuts = sorted({t for segs in segment_lists for a, b, _ in segs for t in (a, b)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        slow = 1.0
        for segs in segment_lists:
            for x, y, k in segs:
                if x <= a and b <= y:
                    slow *= k
        if slow != 1.0:
            out.append((a, b, slow))
    return out


def simulate_step(sizes: Sequence[int], sched: ScheduleConfig, inp: NodeInputs, overhead_s: float = 0.0,
                  iterations: int = 4, backward_s: Optional[float] = None,
                  ready_fraction: Optional[Sequence[float]] = None, plan: Optional[Plan] = None,
                  shape: StepShape = StepShape(), grad_bytes: Optional[Sequence[int]] = None,
                  regime: Regime = "no_clip") -> StepPrediction:
    """The step of ``sched`` over subgroups of ``sizes``, run as the optimizer runs ``plan`` (its lanes, order and
    staging chain; ``make_plan``'s by default) in ``regime`` (lanes.py).

    With ``overlap_backward`` and both the backward time ``backward_s`` and ``ready_fraction`` (how far into
    backward each subgroup's gradients are all final, 0..1) known, the CPU lane is dostune's worker: it produces half
    precision itself and uploads 2 bytes per element. It speculates on the CPU-lane subgroups whose gradients
    are final first (those with shadow buffers: lanes.speculating_subgroups), and updates the others in place in the
    step, after them, with the same kernel. In ``no_clip`` the worker starts each of its subgroups at the moment its
    gradients are final (times before 0 are during backward, where it runs with its backward thread count,
    ``lane_backward_slowdown`` times slower than at the node's rates); only what is left at 0 adds to the step.
    Backward's gradient copies to the host (``grad_bytes`` per subgroup, backward.py) slow the lane there as the
    step's copies do: each subgroup's bytes stream in the stretch of backward that finalises its gradients
    (``gradient_copy_spans``). In ``clip`` the partial norm stopped the worker at its first subgroup: it updates every
    one of them in the step, at the step's threads, as it recomputes them.

    Time 0 is where DeepSpeed's step prologue ends (``prologue_share`` of ``overhead_s``); the states of the
    GPU lane's first ``staging_buffers`` streamed subgroups start coming in at the step's start, before it, and the
    lanes may compute from where the gradient norm is known, before the parameter release that ends the prologue
    (``release_share`` of ``overhead_s``); the step cannot end before the release does. The
    first ``resident_subgroups`` GPU-lane subgroups keep their states on the GPU: no copy in or out, and they go
    first. A CPU-lane subgroup that ``plan`` streams through the GPU lane (a swing of the lane balance towards the GPU)
    brings its gradients in with its states."""
    threads = inp.threads_near(sched.cpu_threads or inp.default_threads)
    base = make_plan(len(sizes), sched)  # the lanes as tuned, before any swing: the lane's ring is sized for them
    plan = plan or base
    cpu = list(plan.cpu_order)
    nbuf = sched.staging_buffers
    lent = lent_subgroups(plan, sched)

    def in_bytes(i: int) -> int:
        return STATE_BYTES + (0 if sched.grads_on_gpu and i not in lent else GRAD_BYTES)

    overlap = bool(sched.overlap_backward and backward_s and ready_fraction is not None)
    in_backward = overlap and regime == "no_clip"  # whether the worker updates anything during backward
    bwd = backward_s if in_backward else 0.0
    prologue = shape.prologue_share * overhead_s
    release = min(shape.release_share, shape.prologue_share) * overhead_s
    # Host-to-device copies read host memory, which the CPU lane streams through while it computes: while it does
    # they run at the rate the node profile measured under CPU Adam (h2d_under_cpu); on two H100 hosts a step's GPU-lane
    # inputs came in at 37-42 GB/s against the 40 and 45 GB/s their profiles measured beside an idle CPU. Where the CPU
    # lane waits (for its upload ring, in clip) they run at the idle rate: on the H200 a llama 3B step's GPU-lane
    # inputs came in at 53 GB/s while the CPU lane stood, 39 GB/s while it computed.
    h2d_alone, h2d_duplex = inp.h2d, inp.h2d_duplex
    under_cpu = inp.h2d_under_cpu
    # the CPU lane's own uploads follow its updates, beside the next one
    up_alone, up_duplex = (h2d_alone.at_rate(under_cpu), h2d_duplex.at_rate(under_cpu)) if cpu else (h2d_alone,
                                                                                                     h2d_duplex)

    def gpu_lane(cpu_busy: Optional[list[tuple[float, float]]]):
        """The GPU lane's spans with the CPU lane computing over ``cpu_busy`` (None: all along, where it has work),
        the end of its inputs that CPU-lane uploads queue behind, and the end of its last write-back."""
        if cpu_busy is None:
            cpu_busy = [(-float("inf"), float("inf"))] if cpu else []
        slowed = [(a, b, 1.0 / under_cpu) for a, b in cpu_busy] if under_cpu != 1.0 else []
        spans: list[SimSpan] = []
        comp_free = d2h_free = -release
        for i in plan.resident:  # nothing to copy: their kernels go first
            t = inp.gpu_adam.t(sizes[i])
            spans.append(SimSpan("gpu", i, comp_free, comp_free + t))
            comp_free += t
        h2d_free = -prologue
        ahead = -prologue
        d2h_end: list[float] = []
        streamed = [gs.subgroup for gs in plan.gpu_slots]
        for n, i in enumerate(streamed):
            s = sizes[i]
            ready = d2h_end[n - nbuf] if n >= nbuf else -prologue
            start = max(h2d_free, ready, -prologue)
            rate = h2d_duplex if n > 0 else h2d_alone  # the previous subgroup's write-back runs alongside
            end = _advance(start, rate.t(in_bytes(i) * s), slowed)
            if end > start:
                spans.append(SimSpan("h2d", i, start, end, in_bytes(i) * s / (end - start) / 1e9))
            h2d_free = end
            # The engine serves copies in submission order, so the CPU lane's uploads wait behind these inputs; a
            # lent subgroup's half-precision gradients are widened by a kernel on the same stream between its copies,
            # which lets an upload through (traced on the H200: the CPU lane's uploads went up beside the lent
            # subgroups' inputs, after the GPU lane's own)
            if i not in lent:
                ahead = end
            c0 = max(end, comp_free, -release)
            comp_free = c0 + inp.gpu_adam.t(s)
            spans.append(SimSpan("gpu", i, c0, comp_free))
            d0 = max(comp_free, d2h_free)
            last = n == len(streamed) - 1
            rate = inp.d2h if (last and not cpu) else inp.d2h_duplex
            d2h_free = d0 + rate.t(STATE_BYTES * s)
            d2h_end.append(d2h_free)
            spans.append(SimSpan("d2h", i, d0, d2h_free, STATE_BYTES * s / (d2h_free - d0) / 1e9))
        return spans, ahead, d2h_free

    # CPU lane and its uploads, iterated: CPU speed depends on when DMA runs, uploads on when the CPU ends.
    # The worker (overlap_backward) updates every CPU-lane subgroup with dostune's kernel: those with shadow buffers as
    # backward finalises them, the last layers first, the rest in place in the step, after them, in index order.
    takes = set(speculating_subgroups(plan, sched)) if overlap else set()
    worker = sorted(takes, key=lambda j: (ready_fraction[j], -j))
    in_place = [j for j in cpu if j not in takes]
    # overlap_backward's lane (dostune's own kernel) works lane_step_slowdown times the node's CPU-lane seconds at the
    # step's thread count, slowed beside DMA by lane_step_contention where measured; during backward it runs with one
    # thread fewer (ScheduleConfig.backward_cpu_threads) and lane_backward_slowdown times the node's seconds at that
    # count
    step_factor = shape.lane_step_slowdown
    # The CPU lane's results go up from a ring of pinned buffers; a buffer is written again only once its last upload
    # has left, so the lane's n-th subgroup waits for upload n - ring, and those uploads queue behind the GPU lane's
    # inputs. On the H100 a llama 2B step's CPU lane stood 40 ms until the GPU lane's last input was in.
    rings = {True: upload_ring(sizes, base, True, sched.upload), False: upload_ring(sizes, base, False, sched.upload)}
    bthreads = sched.backward_cpu_threads or max(1, (sched.cpu_threads or inp.default_threads) - 1)
    in_bwd = shape.lane_backward_slowdown / step_factor * inp.cpu_lane_per_element(bthreads) \
        / inp.cpu_lane_per_element(threads)
    bwd_segment = [(-bwd, 0.0, in_bwd)] if in_backward else []
    grad_spans = gradient_copy_spans(grad_bytes, ready_fraction, bwd, inp) if in_backward and grad_bytes else []
    step_contention = shape.lane_step_contention

    def slowdowns_of(traffic: list[SimSpan]) -> dict[bool, list[tuple[float, float, float]]]:
        """The lanes' slowdowns, the worker's (True) and DeepSpeed's update's (False): the worker's beside backward,
        and beside DMA by the node's contention (DeepSpeed's CPU Adam), in the step by the lane's own where the model
        profile measured it; DeepSpeed's update beside DMA by the node's."""
        dma = _dma_segments(traffic, inp.contention, inp.contention_gbps)
        lane = dma
        if step_contention is not None:
            lane = _clip(dma, -float("inf"), 0.0) + _clip(_dma_segments(traffic, *step_contention), 0.0, float("inf"))
        return {True: _compose(bwd_segment, lane), False: dma}

    spans, ahead, d2h_free = gpu_lane(None)
    slowdowns = slowdowns_of(spans + grad_spans)
    cpu_spans: list[SimSpan] = []
    up_spans: list[SimSpan] = []
    for n_iter in range(max(1, iterations)):
        if n_iter:  # the GPU lane again, its inputs slowed only where the CPU lane computed
            spans, ahead, d2h_free = gpu_lane(_union([(x.start, x.end) for x in cpu_spans]))
        t = -bwd
        cpu_spans, up_spans = [], []
        form_ups: dict[bool, list[SimSpan]] = {True: [], False: []}
        free, free_bwd = ahead, -bwd
        for j in worker + in_place:
            w = overlap  # the worker's kernel, its ring and slowdowns (False: DeepSpeed's update at the step)
            s = sizes[j]
            t = max(t, bwd * (ready_fraction[j] - 1.0)) if j in takes and in_backward else max(t, 0.0)
            ring, ups = rings[w], form_ups[w]
            if ring and len(ups) >= ring:
                t = max(t, ups[len(ups) - ring].end)
            if w:
                work = step_factor * inp.cpu_lane_seconds(s, threads, "cpu_convert")
            else:
                work = inp.cpu_lane_seconds(s, threads, sched.upload)
            end = _advance(t, work, slowdowns[w])
            cpu_spans.append(SimSpan("cpu", j, t, end))
            t = end
            up_bytes = 2 if w or sched.upload == "cpu_convert" else 4
            if end < 0:  # uploaded during backward, on an otherwise idle H2D direction
                u0 = max(free_bwd, end)
                u1 = u0 + up_alone.t(up_bytes * s)
                free_bwd = u1
                up = SimSpan("up", j, u0, u1, up_bytes * s / max(u1 - u0, 1e-12) / 1e9)
            else:
                u0 = max(free, end)
                rate = up_duplex if u0 < d2h_free else up_alone
                copy = rate.t(up_bytes * s)
                u1 = u0 + copy + (inp.convert_gpu.t(s) if up_bytes == 4 else 0.0)
                up = SimSpan("up", j, u0, u1, up_bytes * s / copy / 1e9)
                free = u1
            up_spans.append(up)
            ups.append(up)
        slowdowns = slowdowns_of(spans + grad_spans + up_spans)
    spans = spans + cpu_spans + up_spans
    lanes_s = max(0.0, max((x.end for x in spans), default=0.0))

    def busy(names):  # within the step (work hidden under backward does not count)
        return sum(b - a for a, b in _union([(max(0.0, x.start), x.end) for x in spans
                                             if x.lane in names and x.end > 0]))

    return StepPrediction(lanes_s=lanes_s, overhead_s=overhead_s, spans=sorted(spans, key=lambda x: x.start),
                          cpu_busy_s=busy({"cpu"}), h2d_busy_s=busy({"h2d", "up"}), d2h_busy_s=busy({"d2h"}))


def gradient_copy_spans(grad_bytes: Sequence[int], ready_fraction: Sequence[float], backward_s: float,
                        inp: NodeInputs) -> list[SimSpan]:
    """Backward's gradient copies to the host as traffic spans before 0: a subgroup's bytes stream between the moment
    the subgroup finalised before it did (backward's start for the first) and its own, never faster than the node's
    device-to-host rate. On the H100 host dostune's CPU-lane kernel ran 1.37x slower beside a device-to-host stream
    than alone, and backward's copies are that stream."""
    order = sorted(range(len(grad_bytes)), key=lambda j: ready_fraction[j])
    spans, prev = [], 0.0
    for j in order:
        ready = min(1.0, max(0.0, ready_fraction[j]))
        if grad_bytes[j] > 0:
            end = backward_s * (ready - 1.0)
            start = max(-backward_s, min(backward_s * (prev - 1.0), end - inp.d2h.t(grad_bytes[j])))
            if end > start:
                spans.append(SimSpan("grad", j, start, end, grad_bytes[j] / (end - start) / 1e9))
        prev = max(prev, ready)
    return spans


def upload_ring(sizes: Sequence[int], plan: Plan, overlap: bool, upload: str) -> Optional[int]:
    """How many pinned buffers the CPU lane's uploads rotate through (None: it never waits for one): during backward
    the optimizer's ring (footprint.half_ring_count), in the step two for cpu_convert; gpu_convert uploads the fp32
    params themselves."""
    if overlap:
        reach = cpu_lane_reach(plan)
        return half_ring_count(len(reach), max(sizes[i] for i in reach)) if reach else None
    return 2 if upload == "cpu_convert" else None


def lane_busy_in_backward(step: StepPrediction, backward_s: float) -> float:
    """How long the CPU lane worked between backward's start (-backward_s) and its end (0)."""
    return sum(max(0.0, min(x.end, 0.0) - max(x.start, -backward_s)) for x in step.spans if x.lane == "cpu")


def simulated_lane_times(step: StepPrediction, plan: Plan, cost: dict) -> Optional[LaneTimes]:
    """A simulated step's lane ends as the lane balance measures a step's (balance.lane_times): the CPU lane's updates
    and the GPU lane's last kernel or copy, in seconds from the lanes' start."""
    cpu = [(x.start, x.end) for x in step.spans if x.lane == "cpu"]
    gpu_end = max((x.end for x in step.spans if x.lane in ("gpu", "h2d", "d2h")), default=0.0)
    return lane_times(cpu, gpu_end, len(plan.gpu_slots), cost)
