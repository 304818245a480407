"""Every coefficient of the performance model for one node and model, each from a profile (docs/performance-model.md,
"Inputs"): the node profile's rates, with CPU Adam and the unscale at the rates the model's own ZeRO-Offload engine
ran them; where in DeepSpeed's step overhead the lanes may start; how fast the CPU lane runs during backward and how
much it slows backward; backward's compute without the offload's gradient copies.

A profile older than schema 3 lacks some of these measurements: the fallback below stands in for each, ``notes`` say
which, and ``lacking`` names the profiles that lacked any (re-profiling with this dostune measures them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..optim.footprint import grad_buffer_bytes
from .backward import BackwardInputs, copy_seconds, zero_offload_grad_traffic
from .inputs import Cost, ModelInputs, NodeInputs
from .zero_offload import ds_offload_step_lanes

# Fallbacks for profiles that did not measure a coefficient, each the value the model used before it was measured
# and what it was measured from (none of them from the benches the model is checked against,
# tests/test_model_check.py):
# - the share of DeepSpeed's step overhead before the lanes can compute, and of it the parameter release: 86 and 57
#   of 98 ms in a torch.profiler trace of gpt2-1.3b's step on an H100;
FALLBACK_PROLOGUE_SHARE = 0.85
FALLBACK_RELEASE_SHARE = 0.58
# - how many times slower a CPU-lane update runs during backward than unscale + CPU Adam + CPU conversion at the
#   node profile's rates: medians of 30.3-33.0 ms per 100M-element subgroup of gpt2-1.3b during backward against
#   30.8 ms from the node profile, in traced H100 steps of gpt2-1.3b;
FALLBACK_LANE_BACKWARD_SLOWDOWN = 1.0
# - how many times slower backward runs while the CPU lane works beside it: gpt2-1.3b's backward 265.3 ms with
#   overlap_backward, 178.4 ms without, one engine after the other in one process on an H100.
FALLBACK_BACKWARD_SLOWDOWN = 265.3 / 178.4


@dataclass(frozen=True)
class StepShape:
    """Where the interleaved step's lanes may start within DeepSpeed's step overhead, and how fast the CPU lane runs
    during backward."""

    prologue_share: float = FALLBACK_PROLOGUE_SHARE  # of the overhead, before the lanes' time 0
    release_share: float = FALLBACK_RELEASE_SHARE  # of the overhead, the parameter release the lanes may run under
    # overlap_backward's CPU lane (dostune's out-of-place kernel) against unscale + CPU Adam + CPU conversion at the
    # node's rates and the same threads: during backward, and alone (its subgroups left to the step; the step-lane
    # probe's reading where the model profile has it, else the backward probes')
    lane_backward_slowdown: float = FALLBACK_LANE_BACKWARD_SLOWDOWN
    lane_step_slowdown: float = 1.0
    # whether lane_backward_slowdown already holds backward's gradient copies to the host: the fallback does (timed in
    # training), the model profile's probe does not (it drops the copies), and the model then adds them as traffic
    lane_backward_with_copies: bool = True
    # (slowdown, combined GB/s): how much slower the lane ran in the step beside copies both ways at that traffic, from
    # the model profile's step-lane probe; None: the step's lane takes the node's contention (DeepSpeed's CPU Adam)
    lane_step_contention: Optional[tuple[float, float]] = None


@dataclass(frozen=True)
class Coefficients:
    node: NodeInputs  # the node's rates, CPU Adam and the unscale as the model's engine ran them where measured
    overhead_s: float  # DeepSpeed's step outside the per-subgroup updates
    shape: StepShape
    backward: Optional[BackwardInputs]  # None without a model profile
    notes: tuple[str, ...] = field(default=())
    lacking: tuple[str, ...] = field(default=())  # the profiles that lacked a measurement the model stood in for

    @classmethod
    def of(cls, node: NodeInputs, m: ModelInputs, ds_sizes: Sequence[int]) -> "Coefficients":
        """From one rank's node inputs and the model profile's; ``ds_sizes``: ZeRO-Offload's subgroups at the
        profiled sub_group_size."""
        notes, missing = list(node.notes), []
        lacking = [f"node profile '{node.node}'"] if node.notes else []
        node = in_situ(node, m, notes, missing)
        overhead = ds_step_overhead(m, ds_sizes, node)
        shape = step_shape(node, m, missing)
        backward = backward_inputs(node, m, sum(ds_sizes), missing)
        if missing:
            notes.append(f"the model profile of {m.model} (schema {m.profile_schema}) did not measure "
                         + ", ".join(what for what, _ in missing) + "; the model takes "
                         + "; ".join(instead for _, instead in missing) + ": re-profile the model with this dostune "
                         "to measure them")
            lacking.append(f"model profile of {m.model}")
        return cls(node=node, overhead_s=overhead, shape=shape, backward=backward, notes=tuple(notes),
                   lacking=tuple(lacking))


def _ratio(series, reference: Cost) -> float:
    """How many times longer the series' points took than ``reference`` predicts at their sizes."""
    return sum(p.seconds.median for p in series.points) / sum(reference.t(p.size) for p in series.points)


def in_situ(node: NodeInputs, m: ModelInputs, notes: list[str], missing: list[tuple[str, str]]) -> NodeInputs:
    """The node's CPU Adam (every thread count) and unscale scaled to the rates ZeRO-Offload's step ran them at in
    the model profile: its own buffers, on the machine and at the moment the model was profiled."""
    if m.ds_cpu_adam is None:
        if m.profile_schema is not None:
            missing.append(("CPU Adam in its own engine", "CPU Adam at the node profile's rates"))
        return node
    threads = m.ds_cpu_adam.points[0].threads or node.default_threads
    k = _ratio(m.ds_cpu_adam, node.cpu_adam[node.threads_near(threads)])
    update = {"cpu_adam": {t: Cost(overhead_s=c.overhead_s * k, rate=c.rate / k) for t, c in node.cpu_adam.items()}}
    text = f"CPU Adam ran at {1 / k:.2f}x the node profile's rate in {m.model}'s ZeRO-Offload step ({threads} threads)"
    if m.ds_unscale is not None:
        u = _ratio(m.ds_unscale, node.unscale_cpu)
        update["unscale_cpu"] = Cost(overhead_s=node.unscale_cpu.overhead_s * u, rate=node.unscale_cpu.rate / u)
        text += f", the gradient unscale at {1 / u:.2f}x"
    notes.append(text + ": the model uses those rates")
    return node.model_copy(update=update)


def ds_step_overhead(m: ModelInputs, ds_sizes: Sequence[int], inp: NodeInputs) -> float:
    """Step time outside the per-subgroup work (gradient norm, loss-scale and bookkeeping): measured by the
    model profile when it has it, else fitted as what the measured ZeRO-Offload step leaves over after the
    modelled per-subgroup work. Never negative."""
    if m.step_overhead_s is not None:
        return max(0.0, m.step_overhead_s)
    if m.ds_step_s is None:
        return 0.0
    return max(0.0, m.ds_step_s - ds_offload_step_lanes(ds_sizes, inp))


def step_shape(node: NodeInputs, m: ModelInputs, missing: list[tuple[str, str]]) -> StepShape:
    shares = m.step_shares
    if shares is None and m.profile_schema is not None:
        missing.append(("DeepSpeed's step by part", f"the lanes' start {FALLBACK_PROLOGUE_SHARE:.0%} and "
                        f"{FALLBACK_RELEASE_SHARE:.0%} into the step overhead (gpt2-1.3b's H100 trace)"))
    prologue, release = shares if shares is not None else (FALLBACK_PROLOGUE_SHARE, FALLBACK_RELEASE_SHARE)
    lane, alone = FALLBACK_LANE_BACKWARD_SLOWDOWN, 1.0
    if m.lane_beside_s_per_elem is not None and m.lane_threads is not None:
        composed = node.cpu_lane_per_element(m.lane_threads)
        alone = m.lane_alone_s_per_elem / composed if m.lane_alone_s_per_elem else 1.0
        # Beside backward the lane is taken no faster than alone. The probe's updates run back to back on one scratch
        # subgroup in a thread that never waits; in training the lane updates each subgroup once, as its gradients
        # arrive. Over 30 traced H100 rows of 12 held-out models the lane ran in backward 1.07-1.90x slower than the
        # probe's rate beside it (median 1.36x), at or below its alone rate in 26, and the probe read beside faster
        # than alone in 11 of the 12 profiles.
        lane = m.lane_beside_s_per_elem / composed
        if m.lane_alone_s_per_elem:
            lane = max(lane, alone)
    elif m.profile_schema is not None:
        missing.append(("the CPU lane beside backward", f"the CPU lane at {FALLBACK_LANE_BACKWARD_SLOWDOWN:g}x the "
                        "node profile's CPU-lane time"))
    contention = None
    if m.lane_step_s_per_elem is not None and m.lane_step_threads is not None:
        # The step's lane as the step-lane probe read it: from memory, at the step's threads, and slowed beside copies
        # by its own measure instead of DeepSpeed's CPU Adam's, which slows differently beside copies. Backward keeps
        # the backward probes' readings above.
        alone = m.lane_step_s_per_elem / node.cpu_lane_per_element(m.lane_step_threads)
        contention = (max(1.0, m.lane_step_copies_slowdown), m.lane_step_copies_gbps)
    elif m.profile_schema is not None and m.profile_schema < 10:
        # a schema-10 profile without it was measured without a GPU (or its kernel did not build), which its notes say
        missing.append(("the CPU lane as the step runs it", "the step's lane at the cached lane probe's rate and DeepSpeed's "
                        "CPU Adam's slowdown beside copies"))
    return StepShape(prologue_share=prologue, release_share=min(release, prologue), lane_backward_slowdown=lane,
                     lane_step_slowdown=alone, lane_backward_with_copies=m.lane_beside_s_per_elem is None,
                     lane_step_contention=contention)


def backward_inputs(node: NodeInputs, m: ModelInputs, elements: int,
                    missing: list[tuple[str, str]]) -> Optional[BackwardInputs]:
    """Backward's compute and what adds to it (backward.py), from the model profile; ``elements``: one rank's
    parameters."""
    if m.bwd_s is None:
        return None
    grad_bytes = grad_buffer_bytes(m.precision)
    accounted = zero_offload_grad_traffic(elements, grad_bytes)
    if m.bwd_no_copy_s is not None:
        compute = m.bwd_no_copy_s
        # the share of page-locked copies' time that backward showed: measured with such copies alone where the
        # profile has that probe, else in ZeRO-Offload's backward where it ran pinned; profiled pageable, its copies
        # say nothing of page-locked ones, and dostune's are then taken whole
        visible = 1.0
        if m.bwd_pinned_copy is not None and m.bwd_pinned_copy[1] > 0:
            seconds, nbytes = m.bwd_pinned_copy
            visible = min(1.0, max(0.0, (seconds - compute) / copy_seconds(node, nbytes, 0, pinned=True)))
        elif m.offload_pinned:
            visible = min(1.0, max(0.0, (m.bwd_s - compute) / copy_seconds(node, *accounted, pinned=True)))
    else:
        # ZeRO-Offload's backward less its gradient copies: the bytes NVML counted (else those its code path moves)
        # at the rates of the memory it copied into
        traffic = m.bwd_traffic_bytes or accounted
        compute = max(m.fwd_s or 0.0, m.bwd_s - copy_seconds(node, *traffic, pinned=m.offload_pinned))
        visible = 1.0
        missing.append(("backward without its gradient copies", f"backward's compute as ZeRO-Offload's backward less "
                        f"its copies at the node's {'pinned' if m.offload_pinned else 'pageable'} rates ({compute:.3f} "
                        f"of {m.bwd_s:.3f} s)"))
    slowdown = FALLBACK_BACKWARD_SLOWDOWN
    if m.bwd_beside_lane_s is not None and m.bwd_no_copy_s:
        slowdown = max(1.0, m.bwd_beside_lane_s / m.bwd_no_copy_s)
    elif m.profile_schema is not None:
        missing.append(("backward beside the CPU lane", f"backward {FALLBACK_BACKWARD_SLOWDOWN:.2f}x slower while the "
                        "CPU lane works (gpt2-1.3b on the H100)"))
    return BackwardInputs(compute_s=compute, slowdown=slowdown, visible=visible, grad_bytes=grad_bytes,
                          fp16=m.precision == "fp16", zo_bwd_s=m.bwd_s, zo_pinned=m.offload_pinned,
                          zo_traffic=m.bwd_traffic_bytes or accounted)
