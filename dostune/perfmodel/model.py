"""The analytic performance model of the interleaved update (equations in docs/performance-model.md).

A step is simulated as the optimizer runs it: the GPU lane's transfers queue on the H2D and D2H copy
engines in order (the H2D engine serves copies in submission order, so CPU-lane uploads wait behind the
GPU lane's inputs, as traced on the H100), the GPU kernel follows each input, the CPU lane runs subgroup
after subgroup, slowed while DMA runs, and each CPU-updated subgroup's upload follows its update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..optim.footprint import GRAD_BYTES, STATE_BYTES, gpu_step_bytes, pinned_host_bytes, resident_bytes
from ..optim.schedule import GPU, Plan, ScheduleConfig, assign_lanes, gpu_fraction_for, make_plan
from .inputs import ModelInputs, NodeInputs

GiB = 2**30
# overlap_backward: how much slower a CPU-lane subgroup's update (out-of-place kernel, half precision fused)
# runs while backward runs than unscale + CPU Adam + CPU conversion in the step, at the same thread count.
# Fitted to the H100 traces results/h100/halfgrads-gpt2-1.3b/tuned-clip0-*.json, since the kernel reads the bf16
# gradients in place: medians of 30.3-33.0 ms per 100M-element subgroup during backward against 30.8 ms predicted
# from the node profile at 16 threads (ratios 0.98-1.07). Reading fp32 gradients it had been 1.1-1.17
# (overlap-gpt2-1.3b/overlap-g43-clip0.json, tuned-clip0.json); on a busier machine 83-151 ms per 200M.
# With streaming stores in the kernel and 25M-element subgroups (results/h100/nt-gpt2-1.3b, ring-clip0 of the same
# session on another machine): 0.80 and 1.00; kept at 1.0, the machines differ more than that.
BACKWARD_CPU_SLOWDOWN = 1.0
# The share of DeepSpeed's step overhead that comes before the lanes can compute (releasing the parameters, the
# gradient norm): 86 of 98 ms in a torch.profiler trace of gpt2-1.3b on the H100 (scripts/device-trace.py). The
# GPU lane's first staging slots stream in meanwhile (the step prefetch).
STEP_PROLOGUE_SHARE = 0.85
# Of that prologue, the part that is DeepSpeed releasing the gathered parameters (57 of 98 ms in the same trace,
# results/h100/resident-gpt2-1.3b/trace-summary.txt). dostune computes the gradient norm before it, so the lanes
# (GPU Adam, write-backs, the CPU lane's last subgroups) run while the host releases the parameters.
STEP_RELEASE_SHARE = 0.58


@dataclass
class SimSpan:
    lane: str  # cpu, h2d, gpu, d2h, up
    subgroup: int
    start: float
    end: float
    gbps: float = 0.0  # PCIe traffic while it runs (copies only)


@dataclass
class StepPrediction:
    lanes_s: float  # from the first lane operation to the last
    overhead_s: float  # DeepSpeed's step prologue and epilogue (fitted, see ds_step_overhead)
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


def _dma_segments(spans: Sequence["SimSpan"], inp: "NodeInputs") -> list[tuple[float, float, float]]:
    """Piecewise-constant CPU slowdown from the DMA traffic of ``spans``: the profile measured CPU Adam
    ``contention`` times slower under ``contention_gbps`` of combined H2D+D2H traffic; the slowdown is
    taken to scale linearly with the traffic actually running."""
    edges = []
    for x in spans:
        if x.lane in ("h2d", "d2h", "up") and x.end > x.start:
            edges += [(x.start, x.gbps), (x.end, -x.gbps)]
    edges.sort()
    out, level, prev = [], 0.0, None
    for t, d in edges:
        if prev is not None and t > prev and level > 1e-9:
            slow = 1.0 + (inp.contention - 1.0) * min(1.0, level / inp.contention_gbps)
            out.append((prev, t, slow))
        level += d
        prev = t
    return out


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


def cpu_lane_seconds(size: int, inp: NodeInputs, threads: int, upload: str) -> float:
    """Host time of one CPU-lane subgroup, uncontended: unscale, DeepSpeedCPUAdam (and the CPU conversion
    when half precision is produced on the CPU)."""
    t = inp.unscale_cpu.t(size) + inp.cpu_adam[threads].t(size)
    if upload == "cpu_convert":
        t += inp.convert_cpu.t(size)
    return t


def simulate_step(sizes: Sequence[int], sched: ScheduleConfig, inp: NodeInputs, overhead_s: float = 0.0,
                  iterations: int = 4, backward_s: Optional[float] = None,
                  ready_fraction: Optional[Sequence[float]] = None, plan: Optional[Plan] = None) -> StepPrediction:
    """The step of ``sched`` over subgroups of ``sizes``, run as the optimizer runs ``plan`` (its lanes, order and
    staging chain; ``make_plan``'s by default).

    With ``overlap_backward`` and both the backward time ``backward_s`` and ``ready_fraction`` (how far into
    backward each subgroup's gradients are all final, 0..1) known, the CPU lane starts each subgroup at that moment
    (times before 0 are during backward, where CPU work runs ``BACKWARD_CPU_SLOWDOWN`` times slower), produces half
    precision itself and uploads 2 bytes per element; only what is left at 0 adds to the step.

    Time 0 is where DeepSpeed's step prologue ends (``STEP_PROLOGUE_SHARE`` of ``overhead_s``); the states of the
    GPU lane's first ``staging_buffers`` streamed subgroups start coming in at the step's start, before it, and the
    lanes may compute from where the gradient norm is known, before the parameter release that ends the prologue
    (``STEP_RELEASE_SHARE`` of ``overhead_s``); the step cannot end before the release does. The
    first ``resident_subgroups`` GPU-lane subgroups keep their states on the GPU: no copy in or out, and they go
    first."""
    threads = sched.cpu_threads or inp.default_threads
    if threads not in inp.cpu_adam:
        threads = min(inp.cpu_adam, key=lambda t: abs(t - threads))
    plan = plan or make_plan(len(sizes), sched)
    cpu = list(plan.cpu_order)
    nbuf = sched.staging_buffers
    in_bytes = STATE_BYTES + (0 if sched.grads_on_gpu else GRAD_BYTES)
    up_bytes = 4 if sched.upload == "gpu_convert" else 2

    overlap = bool(sched.overlap_backward and backward_s and ready_fraction is not None)
    bwd = backward_s if overlap else 0.0
    prologue = STEP_PROLOGUE_SHARE * overhead_s
    release = min(STEP_RELEASE_SHARE, STEP_PROLOGUE_SHARE) * overhead_s

    # GPU lane: independent of the CPU lane except through the copy engines' queues.
    spans: list[SimSpan] = []
    comp_free = d2h_free = -release
    for i in plan.resident:  # nothing to copy: their kernels go first
        t = inp.gpu_adam.t(sizes[i])
        spans.append(SimSpan("gpu", i, comp_free, comp_free + t))
        comp_free += t
    h2d_free = -prologue
    d2h_end: list[float] = []
    streamed = [gs.subgroup for gs in plan.gpu_slots]
    for k, i in enumerate(streamed):
        s = sizes[i]
        ready = d2h_end[k - nbuf] if k >= nbuf else -prologue
        start = max(h2d_free, ready, -prologue)
        rate = inp.h2d_duplex if k > 0 else inp.h2d  # the previous subgroup's write-back runs alongside
        end = start + rate.t(in_bytes * s)
        if end > start:
            spans.append(SimSpan("h2d", i, start, end, in_bytes * s / (end - start) / 1e9))
        h2d_free = end
        c0 = max(end, comp_free, -release)
        comp_free = c0 + inp.gpu_adam.t(s)
        spans.append(SimSpan("gpu", i, c0, comp_free))
        d0 = max(comp_free, d2h_free)
        last = k == len(streamed) - 1
        rate = inp.d2h if (last and not cpu) else inp.d2h_duplex
        d2h_free = d0 + rate.t(STATE_BYTES * s)
        d2h_end.append(d2h_free)
        spans.append(SimSpan("d2h", i, d0, d2h_free, STATE_BYTES * s / (d2h_free - d0) / 1e9))
    gpu_h2d_done = h2d_free

    # CPU lane and its uploads, iterated: CPU speed depends on when DMA runs, uploads on when the CPU ends.
    if overlap:  # the worker takes subgroups as backward finalises them: the last layers first
        cpu = sorted(cpu, key=lambda j: (ready_fraction[j], -j))
        up_bytes = 2
    bwd_segment = [(-bwd, 0.0, BACKWARD_CPU_SLOWDOWN)] if overlap else []
    slowdowns = _compose(bwd_segment, _dma_segments(spans, inp))
    cpu_spans: list[SimSpan] = []
    up_spans: list[SimSpan] = []
    for _ in range(max(1, iterations)):
        t = -bwd
        cpu_spans, up_spans = [], []
        free, free_bwd = gpu_h2d_done, -bwd
        for j in cpu:
            s = sizes[j]
            if overlap:
                t = max(t, bwd * (ready_fraction[j] - 1.0))
            end = _advance(t, cpu_lane_seconds(s, inp, threads, "cpu_convert" if overlap else sched.upload),
                           slowdowns)
            cpu_spans.append(SimSpan("cpu", j, t, end))
            t = end
            if end < 0:  # uploaded during backward, on an otherwise idle H2D direction
                u0 = max(free_bwd, end)
                u1 = u0 + inp.h2d.t(up_bytes * s)
                free_bwd = u1
                up_spans.append(SimSpan("up", j, u0, u1, up_bytes * s / max(u1 - u0, 1e-12) / 1e9))
                continue
            u0 = max(free, end)
            rate = inp.h2d_duplex if u0 < d2h_free else inp.h2d
            copy = rate.t(up_bytes * s)
            u1 = u0 + copy + (inp.convert_gpu.t(s) if sched.upload == "gpu_convert" and not overlap else 0.0)
            up_spans.append(SimSpan("up", j, u0, u1, up_bytes * s / copy / 1e9))
            free = u1
        slowdowns = _compose(bwd_segment, _dma_segments(spans + up_spans, inp))
    spans = spans + cpu_spans + up_spans
    lanes_s = max(0.0, max((x.end for x in spans), default=0.0))

    def busy(names):  # within the step (work hidden under backward does not count)
        return sum(b - a for a, b in _union([(max(0.0, x.start), x.end) for x in spans
                                             if x.lane in names and x.end > 0]))

    return StepPrediction(lanes_s=lanes_s, overhead_s=overhead_s, spans=sorted(spans, key=lambda x: x.start),
                          cpu_busy_s=busy({"cpu"}), h2d_busy_s=busy({"h2d", "up"}), d2h_busy_s=busy({"d2h"}))


def ds_offload_step_lanes(sizes: Sequence[int], inp: NodeInputs, threads: Optional[int] = None) -> float:
    """DeepSpeed 0.19.8's own offloaded step, subgroup after subgroup: unscale, CPU Adam, then
    ``fp16_partition.copy_(fp32_partition)``, which converts on the CPU and copies half precision from
    pageable memory, blocking."""
    threads = threads or inp.default_threads

    def upload(s):  # measured as DeepSpeed does it when the profile has it, else composed from its parts
        return inp.ds_upload.t(s) if inp.ds_upload is not None else inp.convert_cpu.t(s) + inp.h2d_pageable.t(2 * s)

    return sum(inp.unscale_cpu.t(s) + inp.cpu_adam[threads].t(s) + upload(s) for s in sizes)


def ds_step_overhead(m: ModelInputs, ds_sizes: Sequence[int], inp: NodeInputs) -> float:
    """Step time outside the per-subgroup work (gradient norm, loss-scale and bookkeeping): measured by the
    model profile when it has it, else fitted as what the measured ZeRO-Offload step leaves over after the
    modelled per-subgroup work. Never negative."""
    if m.step_overhead_s is not None:
        return max(0.0, m.step_overhead_s)
    if m.ds_step_s is None:
        return 0.0
    return max(0.0, m.ds_step_s - ds_offload_step_lanes(ds_sizes, inp))


@dataclass
class MemoryPrediction:
    peak_gpu_gib: Optional[float]  # None without a model profile
    extra_step_gib: float  # staging, kept gradients and upload buffers during the step
    extra_bwd_gib: float  # kept gradients already allocated at backward's peak
    pinned_host_gib: float


def predict_memory(sizes: Sequence[int], sched: ScheduleConfig, m: ModelInputs,
                   grad_alloc_fraction: Optional[Sequence[float]] = None,
                   plan: Optional[Plan] = None) -> MemoryPrediction:
    """The memory of ``plan`` (``make_plan``'s by default), with the optimizer's own footprints.
    ``grad_alloc_fraction[i]``: how far into backward (0..1) subgroup i's kept-gradient buffer is allocated
    (its first gradient). Backward's memory is taken to fall linearly from its peak at the start to its
    minimum at the end (as the measured timeline shows); the buffers add to it from their allocation on."""
    plan = plan or make_plan(len(sizes), sched)
    gpu = plan.gpu_subgroups
    extra_step = gpu_step_bytes(sizes, plan, sched) / GiB
    extra_bwd = 0.0
    if sched.grads_on_gpu and gpu and m.peak_bwd_gib is not None:
        fr = grad_alloc_fraction or [0.0] * len(sizes)  # unknown: assume allocated at backward's start
        base = m.peak_bwd_gib - (m.peak_step_gib or 0.0)  # what backward frees by its end
        extra_bwd = max(
            (m.peak_bwd_gib - base * phi) + sum(sizes[i] * GRAD_BYTES for i in gpu if fr[i] <= phi) / GiB
            - m.peak_bwd_gib for phi in sorted({0.0, *(fr[i] for i in gpu)}))
        extra_bwd = max(0.0, extra_bwd)
    resident = resident_bytes(sizes, plan) / GiB  # in every phase (and already in extra_step)
    peak = None
    if m.offload_peak_gib is not None:
        step_base = m.peak_step_gib or 0.0
        peak = max((m.peak_fwd_gib or 0.0) + resident, (m.peak_bwd_gib or 0.0) + extra_bwd + resident,
                   step_base + extra_step)
    return MemoryPrediction(peak_gpu_gib=peak, extra_step_gib=extra_step, extra_bwd_gib=extra_bwd,
                            pinned_host_gib=pinned_host_bytes(sizes, plan, sched) / GiB)


def best_gpu_fraction(total: int, inp: NodeInputs, threads: int, grads_on_gpu: bool = True,
                      upload: str = "gpu_convert", iterations: int = 3) -> float:
    """Closed form (docs/performance-model.md): the share f of elements for the GPU lane that balances the
    CPU lane against the busier PCIe direction in steady state.

        CPU:  (1 - f) N c k          c = seconds per element of unscale + CPU Adam (+ CPU convert)
                                     k = contention slowdown under the DMA traffic the step itself makes
        H2D:  N (f b_in + (1 - f) b_up) / B_h2d     b_in = 12 (+4 without kept gradients), b_up = 4 (or 2)
        D2H:  N f 12 / B_d2h

    The step is the largest of the three; CPU falls and the copies rise with f, so the best f is where the
    CPU line meets the higher copy line: f = min((c k - b_up/B_h2d) / (c k + (b_in - b_up)/B_h2d),
    c k / (c k + 12/B_d2h)). k depends on the traffic, i.e. on f: k = 1 + (K - 1) min(1, traffic / K_traffic)
    with the profiled slowdown K at K_traffic GB/s; starting from k = K, a few substitutions converge.
    """
    c = cpu_lane_seconds(total, inp, threads, upload) / total
    b_in = STATE_BYTES + (0 if grads_on_gpu else GRAD_BYTES)
    b_up = 4 if upload == "gpu_convert" else 2
    h2d, d2h = inp.h2d_duplex.rate, inp.d2h_duplex.rate
    k = inp.contention
    f = 0.0
    for _ in range(max(1, iterations)):
        ck = c * k
        f_h2d = (ck - b_up / h2d) / (ck + (b_in - b_up) / h2d)
        f_d2h = ck / (ck + STATE_BYTES / d2h)
        f = min(1.0, max(0.0, min(f_h2d, f_d2h)))
        step = max((1 - f) * ck, (f * b_in + (1 - f) * b_up) / h2d, f * STATE_BYTES / d2h)  # seconds per element
        traffic_gbps = (f * b_in + (1 - f) * b_up + f * STATE_BYTES) / step / 1e9
        k = 1.0 + (inp.contention - 1.0) * min(1.0, traffic_gbps / inp.contention_gbps)
    return f


def _profile_ready_edges(profile_sizes: Sequence[int], profile_ready: Sequence[Optional[float]],
                         backward_s: float) -> Optional[list[tuple[int, int, float]]]:
    """The model profile's subgroups as (first element, end, fraction of backward when all their gradients
    were final); None when the profile does not say."""
    if not profile_sizes or backward_s <= 0 or any(r is None for r in profile_ready):
        return None
    edges, pos = [], 0
    for ps, r in zip(profile_sizes, profile_ready):
        edges.append((pos, pos + ps, r / backward_s))
        pos += ps
    return edges


def _ready_at(edges: list[tuple[int, int, float]], pos: float) -> Optional[float]:
    return next((r for a, b, r in edges if a <= pos < b), None)


def grad_ready_fractions(sizes: Sequence[int], profile_sizes: Sequence[int],
                         profile_ready: Sequence[Optional[float]], backward_s: float) -> Optional[list[float]]:
    """How far into backward (0..1) each subgroup's gradients are all final: when the element at its start is,
    interpolated from the model profile's per-subgroup readiness at its own sub_group_size. None if unknown."""
    edges = _profile_ready_edges(profile_sizes, profile_ready, backward_s)
    if edges is None:
        return None
    out, acc = [], 0
    for s in sizes:
        r = _ready_at(edges, acc)
        out.append(1.0 if r is None else min(1.0, r))
        acc += s
    return out


def grad_alloc_fractions(sizes: Sequence[int], profile_sizes: Sequence[int],
                         profile_ready: Sequence[Optional[float]], backward_s: float) -> list[float]:
    """When (as a fraction of backward) each subgroup's first gradient arrives, interpolated by element position
    from the model profile's per-subgroup readiness at its own sub_group_size. A subgroup's first gradient comes
    when the subgroup after it (in element order) is complete."""
    edges = _profile_ready_edges(profile_sizes, profile_ready, backward_s)
    if edges is None:
        return [0.0] * len(sizes)
    out, acc = [], 0
    for s in sizes:
        r = _ready_at(edges, acc + s)
        out.append(min(1.0, edges[-1][2] if r is None else r) if acc + s < edges[-1][1] else 0.0)
        acc += s
    return out


@dataclass
class Prediction:
    schedule: ScheduleConfig
    plan: Plan  # the optimizer's plan of the schedule, which the prediction simulates
    sub_group_size: int
    sizes: list[int]
    step: StepPrediction
    memory: MemoryPrediction
    fwd_s: Optional[float]
    bwd_s: Optional[float]

    @property
    def step_s(self) -> float:
        return self.step.step_s

    @property
    def iter_s(self) -> Optional[float]:
        if self.fwd_s is None or self.bwd_s is None:
            return None
        return self.fwd_s + self.bwd_s + self.step_s

    @property
    def objective_s(self) -> float:
        return self.iter_s if self.iter_s is not None else self.step_s

    @property
    def update_gelem_s(self) -> float:
        return sum(self.sizes) / self.step_s / 1e9


def predict(sizes: Sequence[int], sub_group_size: int, sched: ScheduleConfig, node: NodeInputs, m: ModelInputs,
            overhead_s: float, grad_alloc: Optional[Sequence[float]] = None,
            grad_ready: Optional[Sequence[float]] = None) -> Prediction:
    plan = make_plan(len(sizes), sched)
    step = simulate_step(sizes, sched, node, overhead_s, backward_s=m.bwd_s, ready_fraction=grad_ready, plan=plan)
    return Prediction(schedule=sched, plan=plan, sub_group_size=sub_group_size, sizes=list(sizes), step=step,
                      memory=predict_memory(sizes, sched, m, grad_alloc, plan), fwd_s=m.fwd_s, bwd_s=m.bwd_s)


def gpu_count_for_share(sizes: Sequence[int], share: float, placement: str = "first") -> int:
    """The number of GPU-lane subgroups whose elements come closest to ``share`` of all elements (subgroups
    differ in size, e.g. the embedding's), for a placement."""
    total = sum(sizes)
    n = len(sizes)

    def elem_share(k: int) -> float:
        lanes = assign_lanes(n, gpu_fraction_for(k, n), placement)
        return sum(s for s, lane in zip(sizes, lanes) if lane == GPU) / total

    return min(range(n + 1), key=lambda k: abs(elem_share(k) - share))
