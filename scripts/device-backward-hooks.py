"""On the GPU machine: where backward's host time goes, per ZeRO-3 hook, for gpt2-1.3b (bf16, micro-batch 8,
seq 1024, no clipping) under several methods in one process.
    python3 scripts/device-backward-hooks.py METHOD [METHOD ...]
METHOD is no-offload, zero-offload, or a dostune ds_config path, optionally followed by "+" and JSON setting
private attributes as in device-profile-backward.py (e.g. 'CONFIG+{"overlap.speculate": false}'). Two probes of
what slows backward under offload: no-offload+burn keeps every CPU core busy with streaming arithmetic for ~0.3 s
after each step (as CPU Adam does), no-offload+d2h also copies every gradient partition to pinned host memory in
backward (as the offload path does). Each run also prints the CPU time the hypervisor stole during backward.
Forward, step and the synchronisation between phases are as in `dostune bench`; during backward the host time
spent inside each wrapped DeepSpeed / dostune method (inclusive of what it calls, so nested entries overlap) is
added up and printed per iteration (median over the timed iterations) with its call count. Backward runs on the
autograd thread, which these wrappers time as well as the main one."""
import gc
import json
import os
import statistics
import sys
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
                     "_dostune_grad_final", "independent_gradient_partition_epilogue")
OFFLOAD_METHODS = ("pre_sub_module_backward_function", "post_sub_module_backward_function")


class HookClock:
    def __init__(self):
        self.on = False
        self.spent = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        short = name.replace(Z3, "")

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[short] += time.perf_counter() - t0
                self.calls[short] += 1

        setattr(obj, name, timed)

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
    if method.split("+")[0] in ("no-offload", "zero-offload"):
        train = TrainSettings(clip=0.0)
        return deepspeed_config(train, OffloadSettings(ratio=0.0 if method.startswith("no-offload") else 1.0)), \
            {}, False
    path, _, patch = method.partition("+")
    cfg = json.load(open(path))
    cfg["gradient_clipping"] = 0.0
    return cfg, json.loads(patch) if patch else {}, True


def run(method: str) -> None:
    spec = resolve_model(MODEL)
    cfg, private, dos = config_of(method)
    engine = build_engine(spec, cfg, seed=0, use_dostune=dos)
    if method.endswith("+d2h"):
        add_d2h_copies(engine)
    burn_bufs = [] if method.endswith("+burn") else None
    torch.set_num_threads(os.cpu_count() or 1)
    for key, value in private.items():
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
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    gen = torch.Generator().manual_seed(1)
    bwd, per_iter, steal = [], [], []
    for k in range(WARMUP + ITERS):
        batch = spec.batch(8, min(1024, spec.config["max_positions"]), gen, engine.device)
        sync()
        loss = loss_of(engine(**batch))
        sync()
        clock.take()
        clock.on = True
        s0 = stolen_ticks()
        t0 = time.perf_counter()
        engine.backward(loss)
        sync()
        t1 = time.perf_counter()
        clock.on = False
        s1 = stolen_ticks()
        spent, calls = clock.take()
        engine.step()
        sync()
        if burn_bufs is not None:
            burn(0.3, burn_bufs)
        if k >= WARMUP:
            bwd.append(t1 - t0)
            steal.append(s1 - s0)
            per_iter.append((spent, calls))
    print(f"== {method}: backward median {statistics.median(bwd) * 1e3:.1f} ms over {ITERS} iterations; stolen "
          f"{statistics.median(steal)} ticks of {os.sysconf('SC_CLK_TCK')}/s per CPU", flush=True)
    for name in sorted({n for s, _ in per_iter for n in s}, key=lambda n: -statistics.median(
            s.get(n, 0.0) for s, _ in per_iter)):
        ms = statistics.median(s.get(name, 0.0) for s, _ in per_iter) * 1e3
        n = statistics.median(c.get(name, 0) for _, c in per_iter)
        print(f"   {name:45s} {ms:8.1f} ms  {n:6.0f} calls  {1e3 * ms / max(n, 1):7.1f} us/call", flush=True)
    engine.destroy()
    del engine
    gc.collect()  # the d2h probe's wrapper refers to the optimizer that holds it
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for m in sys.argv[1:]:
        run(m)
