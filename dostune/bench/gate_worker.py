"""One side of the CPU gate (bench/gate.py starts two of these with ``python -m dostune.bench.gate worker``): build
the engines, then step them as the parent asks and report each optimizer step's CPU and wall time; and the test-only
switch that makes this tree's CPU lane slower.

Why CPU time, one thread, and retained heap. On a 2-core machine shared with other jobs a step's wall time
mostly measures how long the process waited for a core; the CPU time of the process during the step (all its
threads: the host and the lane worker) does not count waiting. Every thread count is one, so no thread waits for
a sibling that was preempted. Each step on a CPU device allocates fresh staging memory; the page faults that
follow cost kernel time that depends on the machine's memory pressure (about 20 ms of a 55 ms step, 3x apart
between processes, on the CI machine), so the workers ask glibc to keep freed memory for reuse.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import sys
import time
from typing import Callable

from ..errors import ConfigError

# The test-only switch that makes this tree's CPU lane slower, to prove the gate catches such a slowdown
# (docs/ci-gate.md): 0.2 makes every CPU-lane update of a subgroup take 20% longer, as a slower kernel would. Read by
# this tree's worker, which hands the engine the slower update (optim.cpu_lane.CpuLaneSeams); the pinned commit's
# worker never sees it.
SLOW_CPU_LANE_ENV = "DOSTUNE_TEST_SLOW_CPU_LANE"


def keep_freed_memory() -> bool:
    """Ask glibc to serve allocations up to 32 MiB from the heap and never give freed heap back to the kernel, so
    the staging memory each step allocates is reused instead of mapped and page-faulted anew. False where the C
    library is not glibc (the gate then runs without it)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def cpu_lane_slowdown() -> float:
    """The fraction by which the environment asks the CPU lane to be slower; 0 when unset."""
    text = os.environ.get(SLOW_CPU_LANE_ENV, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 10:
        raise ConfigError(f"{SLOW_CPU_LANE_ENV} must be a fraction between 0 and 10 (0.2: 20% slower), got {text!r}",
                          hint=f"unset {SLOW_CPU_LANE_ENV}: it is a test-only switch")
    return value


def slowed(update: Callable, fraction: float) -> Callable:
    """``update``, each call followed by busy work for ``fraction`` of that call's own duration (the thread keeps its
    CPU busy, so the extra time is CPU time too); ``update`` itself when ``fraction`` is 0."""
    if not fraction:
        return update

    @functools.wraps(update)
    def slower(*args, **kwargs):
        t0 = time.perf_counter()
        out = update(*args, **kwargs)
        t1 = time.perf_counter()
        end = t1 + fraction * (t1 - t0)
        while time.perf_counter() < end:
            pass
        return out

    return slower


def cpu_lane_seams():
    """The seams this tree's engines are built with: the CPU lane slowed as the environment asks (unset: none)."""
    from ..optim.cpu_lane import CpuLaneSeams

    fraction = cpu_lane_slowdown()
    return CpuLaneSeams(wrap_update=functools.partial(slowed, fraction=fraction) if fraction else None)


def worker(settings_json: str) -> int:
    """One side of the gate: build the engine, then answer the parent's lines on stdin ("step 0" untimed, "step 1"
    timed, "end") with one JSON line each on the original stdout; everything else printed goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    keep_freed_memory()
    import torch

    from ..dsconfig import OffloadSettings, TrainSettings, deepspeed_config
    from ..models.registry import loss_of, resolve_model
    from ..optim.schedule import ScheduleConfig
    from ..train.engine import build_engine
    from .gate import PROTOCOL, GateSettings

    s = GateSettings.model_validate_json(settings_json)
    torch.set_num_threads(s.threads)
    spec = resolve_model(s.model)
    train = TrainSettings(micro_batch=s.micro_batch, precision=s.precision, clip=s.clip)
    cfg = deepspeed_config(train, OffloadSettings(sub_group_size=s.sub_group_size,
                                                  schedule=ScheduleConfig(**s.schedule)))
    seams = cpu_lane_seams()
    engines = [build_engine(spec, cfg, seed=s.seed, seams=seams) for _ in range(s.engines)]
    gens = [torch.Generator().manual_seed(s.seed + 1) for _ in engines]
    proto.write(json.dumps({"protocol": PROTOCOL, "lanes": list(engines[0].optimizer.dostune_plan.lanes),
                            "slow_cpu_lane": cpu_lane_slowdown()}) + "\n")
    k = 0
    for line in sys.stdin:
        if line.strip() == "end":
            spec_updates = sum(e.optimizer.dostune_overlap_stats["speculative"] for e in engines)
            proto.write(json.dumps({"speculative": spec_updates}) + "\n")
            break
        engine, gen = engines[k % len(engines)], gens[k % len(engines)]
        k += 1
        engine.backward(loss_of(engine(**spec.batch(s.micro_batch, s.seq, gen, engine.device))))
        c0, t0 = time.process_time(), time.perf_counter()
        engine.step()
        t1, c1 = time.perf_counter(), time.process_time()
        proto.write(json.dumps({"cpu": c1 - c0, "wall": t1 - t0}) + "\n")
    for e in engines:
        e.destroy()
    return 0
