"""On the GPU machine: where backward's host time goes, per ZeRO-3 hook, for gpt2-1.3b (bf16, micro-batch 8,
seq 1024, no clipping) under several methods in one process.
    python3 scripts/device-backward-hooks.py METHOD [METHOD ...]
METHOD is no-offload, zero-offload, or a dostune ds_config path, optionally followed by "+" and JSON setting private
attributes as in device-profile-backward.py (e.g. 'CONFIG+{"overlap.speculate": false}'); a key that starts with "@"
sets an attribute of the ZeRO-3 optimizer itself (e.g. 'no-offload+{"@max_param_reduce_events": 8}'), one that
starts with "%" a key of the config's dostune section before the engine is built
(e.g. 'CONFIG+{"%overlap_backward": false}'). Probes of what slows backward under offload: no-offload+burn keeps every CPU core busy with streaming
arithmetic for ~0.3 s after each step (as CPU Adam does), no-offload+d2h also copies every gradient partition to
pinned host memory in backward (as the offload path does), no-offload+burnbwdN keeps N cores (default: all but one)
busy that way during backward (as the CPU lane does under overlap_backward). Each run also prints the CPU time the
hypervisor stole during backward and the CUDA caching allocator's counters (device allocations and frees, retries)
per backward; the host's waits (Event/Stream.synchronize) are timed by thread.
Forward, step and the synchronisation between phases are as in `dostune bench`; during backward the host time
spent inside each wrapped DeepSpeed / dostune method (inclusive of what it calls, so nested entries overlap) is
added up and printed per iteration (median over the timed iterations) with its call count. Backward runs on the
autograd thread, which these wrappers time as well as the main one."""
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config
from dostune.models.registry import loss_of, resolve_model
from dostune.train.engine import build_engine

ITERS, WARMUP = 8, 3
MODEL = os.environ.get("MODEL", "gpt2-1.3b")  # a smaller preset for a smoke test on a CPU machine
Z3 = "_DeepSpeedZeroOptimizer_Stage3__"
OPTIMIZER_METHODS = ("reduce_ready_partitions_and_remove_grads", Z3 + "add_grad_to_ipg_bucket",
                     Z3 + "reduce_and_partition_ipg_grads", "partition_grads", "_offload_grad_partition_at_boundary",
                     "_dostune_grad_final", "independent_gradient_partition_epilogue", "_dostune_record_norm",
                     "_dostune_add_partial_norm", "_dostune_gpu_backward_tick", "_dostune_prefetch_tick",
                     Z3 + "avg_scatter_contiguous_grads")
OFFLOAD_METHODS = ("pre_sub_module_backward_function", "post_sub_module_backward_function")
COORDINATOR_METHODS = ("fetch_sub_module", "release_sub_module")
# Where the host waits for the GPU (DeepSpeed throttles on its reduce events; dostune's worker waits on its own).
WAITS = ((torch.cuda.Event, "synchronize", "Event.synchronize"), (torch.cuda.Stream, "synchronize",
                                                                   "Stream.synchronize"))


class HookClock:
    def __init__(self):
        self.on = False
        self.spent = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, obj, name: str, short: str = "", by_thread: bool = False):
        """Time obj.name while on; returns what it replaced (None if obj has no such attribute). by_thread
        appends the calling thread's name, to tell backward's own waits from a worker's."""
        fn = getattr(obj, name, None)
        if fn is None:
            return None
        short = short or name.replace(Z3, "")

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            key = f"{short} [{threading.current_thread().name}]" if by_thread else short
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[key] += time.perf_counter() - t0
                self.calls[key] += 1

        setattr(obj, name, timed)
        return fn

    def take(self) -> tuple[dict, dict]:
        out = dict(self.spent), dict(self.calls)
        self.spent.clear()
        self.calls.clear()
        return out


def stolen_ticks() -> int:
    """Clock ticks (all CPUs) the hypervisor ran something else while this VM's CPUs wanted to run."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def burn(seconds: float, bufs: list) -> None:
    """Every core streams through memory (multiply-add on large fp32 tensors) for about ``seconds``."""
    if not bufs:
        bufs += [torch.ones(100_000_000), torch.ones(100_000_000)]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        bufs[0].mul_(0.999).add_(bufs[1])


def add_d2h_copies(engine) -> None:
    opt = engine.optimizer
    fn = opt.partition_grads
    host = {}

    def partition_grads(params, partitions):
        for p, g in zip(params, partitions):
            dst = host.get(p.ds_id)
            if dst is None:
                dst = host[p.ds_id] = torch.empty(g.numel(), dtype=g.dtype, pin_memory=torch.cuda.is_available())
            dst.copy_(g.reshape(-1), non_blocking=True)
        return fn(params, partitions)

    opt.partition_grads = partition_grads


def config_of(method: str) -> tuple[dict, dict, bool]:
    path, _, patch = method.partition("+")
    private = json.loads(patch) if patch.startswith("{") else {}
    if path in ("no-offload", "zero-offload"):
        train = TrainSettings(clip=0.0)
        return deepspeed_config(train, OffloadSettings(ratio=0.0 if path == "no-offload" else 1.0)), private, False
    cfg = json.load(open(path))
    cfg["gradient_clipping"] = 0.0
    for key in [k for k in private if k.startswith("%")]:
        cfg["dostune"][key[1:]] = private.pop(key)
    return cfg, private, True


class BackwardBurn:
    """A thread that streams arithmetic over torch's threads while ``on`` (set around backward)."""

    def __init__(self):
        self.on, self.stop = threading.Event(), False
        self.bufs = [torch.ones(100_000_000), torch.ones(100_000_000)]
        self.thread = threading.Thread(target=self._loop, daemon=True, name="burn")
        self.thread.start()

    def _loop(self):
        while not self.stop:
            self.on.wait()
            self.bufs[0].mul_(0.999).add_(self.bufs[1])

    def close(self):
        self.stop = True
        self.on.set()
        self.thread.join()


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def alloc_counters() -> dict:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: stats.get(k, 0) for k in ALLOC_KEYS}


def run(method: str) -> None:
    spec = resolve_model(MODEL)
    cfg, private, dos = config_of(method)
    engine = build_engine(spec, cfg, seed=0, use_dostune=dos)
    if method.endswith("+d2h"):
        add_d2h_copies(engine)
    burn_bufs = [] if method.endswith("+burn") else None
    torch.set_num_threads(os.cpu_count() or 1)
    tail = method.rpartition("+")[2]
    bwd_burn = BackwardBurn() if tail.startswith("burnbwd") else None
    if bwd_burn is not None:
        torch.set_num_threads(int(tail[len("burnbwd"):] or max(1, (os.cpu_count() or 2) - 1)))
    for key, value in private.items():
        if key.startswith("@"):
            setattr(engine.optimizer, key[1:], value)
            continue
        obj = engine.optimizer._dos
        *path, name = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, name, value)
    clock = HookClock()
    for name in OPTIMIZER_METHODS:
        clock.wrap(engine.optimizer, name)
    for name in OFFLOAD_METHODS:
        clock.wrap(engine.optimizer.parameter_offload, name)
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    for name in COORDINATOR_METHODS:
        clock.wrap(coordinator, name)
    originals = [(cls, name, clock.wrap(cls, name, short, by_thread=True)) for cls, name, short in WAITS]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    bwd, per_iter, steal, allocs = [], [], [], []
    for k in range(WARMUP + ITERS):
        batch = spec.batch(8, min(1024, spec.config["max_positions"]), gen, engine.device)
        sync()
        loss = loss_of(engine(**batch))
        sync()
        clock.take()
        clock.on = True
        s0, a0 = stolen_ticks(), alloc_counters()
        if bwd_burn is not None:
            bwd_burn.on.set()
        t0 = time.perf_counter()
        engine.backward(loss)
        sync()
        t1 = time.perf_counter()
        clock.on = False
        if bwd_burn is not None:
            bwd_burn.on.clear()
        s1, a1 = stolen_ticks(), alloc_counters()
        spent, calls = clock.take()
        engine.step()
        sync()
        if burn_bufs is not None:
            burn(0.3, burn_bufs)
        if k >= WARMUP:
            bwd.append(t1 - t0)
            steal.append(s1 - s0)
            allocs.append({k: a1[k] - a0[k] for k in ALLOC_KEYS})
            per_iter.append((spent, calls))
    print(f"== {method}: backward median {statistics.median(bwd) * 1e3:.1f} ms over {ITERS} iterations; stolen "
          f"{statistics.median(steal)} ticks of {os.sysconf('SC_CLK_TCK')}/s per CPU; allocator per backward: "
          + ", ".join(f"{k} {statistics.median(a[k] for a in allocs):g}" for k in ALLOC_KEYS), flush=True)
    for name in sorted({n for s, _ in per_iter for n in s}, key=lambda n: -statistics.median(
            s.get(n, 0.0) for s, _ in per_iter)):
        ms = statistics.median(s.get(name, 0.0) for s, _ in per_iter) * 1e3
        n = statistics.median(c.get(name, 0) for _, c in per_iter)
        print(f"   {name:45s} {ms:8.1f} ms  {n:6.0f} calls  {1e3 * ms / max(n, 1):7.1f} us/call", flush=True)
    if bwd_burn is not None:
        bwd_burn.close()
    for cls, name, fn in originals:
        setattr(cls, name, fn)
    engine.destroy()
    del engine
    gc.collect()  # the d2h probe's wrapper refers to the optimizer that holds it
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for m in sys.argv[1:]:
        run(m)
