"""On the GPU machine: forward/backward/step of gpt2-1.3b (bf16, micro-batch 8, seq 1024, no clipping) under a
dostune config and variants of its schedule, all in one process (machines differ by +-0.05 s between processes).
    python3 scripts/device-profile-backward.py CONFIG [PATCH ...]
PATCH is JSON merged into the config's dostune section, e.g. '{"backward_gpu_subgroups": 2}' (a key starting with
"_" sets that attribute of the optimizer's private state instead, e.g. '{"_step_prefetch": false}', or of one of its
members, e.g. '{"_overlap.nontemporal": true}'); the config runs as is first. ALT='{"_early_norm": false}' applies
private settings on every other iteration of each engine and reports both halves (an A/B without the drift between
engines built one after another); its key "!march" instead swaps in the CPU lane's kernel built with -march=VALUE
(e.g. haswell: no 512-bit instructions) for -march=native. BLOCK=K alternates in blocks of K iterations instead
and times the last K-1 of each (the first lets adaptive_swing, which learns from the previous step, adapt).
ITERS=N times N iterations (each way with ALT) instead of 8.
With PROFILE=1 the first run's last iteration is recorded with torch.profiler and its top host-side CUDA calls and
GPU operations are printed. Each run also reports the time Python's garbage collector
took per phase (median ms per iteration); GCFREEZE=1 calls gc.freeze() once the engine is built, so the collector
no longer walks the objects that exist by then."""
import gc
import json
import os
import statistics
import sys
import time

import torch

from dostune.models.registry import loss_of, resolve_model
from dostune.train.engine import build_engine

ITERS, WARMUP = int(os.environ.get("ITERS", "8")), 3


class GcClock:
    """Seconds the garbage collector ran, added to the phase named in ``phase``."""

    def __init__(self):
        self.phase, self.spent, self._t0 = None, {}, None
        gc.callbacks.append(self._cb)

    def _cb(self, what, info):
        if what == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None and self.phase is not None:
            self.spent[self.phase] = self.spent.get(self.phase, 0.0) + time.perf_counter() - self._t0

    def take(self) -> dict:
        out, self.spent = self.spent, {}
        return out

    def close(self):
        gc.callbacks.remove(self._cb)


def set_private(engine, key: str, value, read: bool = False):
    """Set (or with ``read`` return) an attribute of the optimizer's private state; "a.b" is attribute b of its
    member a (e.g. overlap.nontemporal)."""
    obj = engine.optimizer._dos
    *path, name = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    if read:
        return getattr(obj, name)
    setattr(obj, name, value)


def kernel_for(march: str):
    """The CPU lane's kernel library built with -march=``march`` (the production build is -march=native)."""
    from dostune.optim import cpu_kernel
    saved, saved_lib = cpu_kernel._FLAGS, cpu_kernel._lib
    try:
        cpu_kernel._FLAGS = [f if f != "-march=native" else f"-march={march}" for f in saved]
        cpu_kernel._lib = None
        return cpu_kernel.load()
    finally:
        cpu_kernel._FLAGS, cpu_kernel._lib = saved, saved_lib


def use_kernel(lib) -> None:
    from dostune.optim import cpu_kernel
    cpu_kernel._lib = lib  # the worker calls load(), which returns this one


def run(cfg: dict, profile: bool, label: str) -> None:
    spec = resolve_model("gpt2-1.3b")
    # Keys starting with "_" set attributes of the optimizer's private state (A/B toggles such as _step_prefetch).
    private = {k[1:]: cfg["dostune"].pop(k) for k in list(cfg.get("dostune", {})) if k.startswith("_")}
    engine = build_engine(spec, cfg, seed=0, use_dostune=True)
    for k, v in private.items():
        set_private(engine, k, v)
    if os.environ.get("GCFREEZE") == "1":
        gc.collect()
        gc.freeze()
    clock = GcClock()
    gcs, alt_gcs = [], []
    # ALT: private settings applied on every other iteration of the same engine, the cleanest A/B on a noisy machine
    alt = {k.lstrip("_"): v for k, v in json.loads(os.environ.get("ALT", "{}")).items()}
    libs, march = None, alt.pop("!march", None)
    if march is not None:
        from dostune.optim import cpu_kernel
        libs = [cpu_kernel.load(), kernel_for(march)]
    alt_default = {k: set_private(engine, k, None, read=True) for k in alt}
    alternate = bool(alt) or libs is not None
    gen = torch.Generator().manual_seed(1)
    times, alt_times = [], []
    prof = None
    block = int(os.environ.get("BLOCK", "1"))
    total = WARMUP + ITERS
    if alternate:  # ITERS timed iterations each way
        total = WARMUP + 2 * ITERS if block == 1 else WARMUP + 2 * block * -(-ITERS // (block - 1))
    for k in range(total):
        odd = (k - WARMUP) // block % 2 if k >= WARMUP else k % 2
        settle = block > 1 and k >= WARMUP and (k - WARMUP) % block == 0
        if libs is not None:
            use_kernel(libs[odd])
        for key in alt:
            set_private(engine, key, alt[key] if odd else alt_default[key])
        batch = spec.batch(8, 1024, gen, engine.device)
        torch.cuda.synchronize()
        if profile and k == WARMUP + ITERS - 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        clock.take()
        t0 = time.perf_counter()
        clock.phase = "fwd"
        loss = loss_of(engine(**batch))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        clock.phase = "bwd"
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        clock.phase = "step"
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        clock.phase = None
        if k >= WARMUP and not settle:
            (alt_times if alternate and odd else times).append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
            (alt_gcs if alternate and odd else gcs).append(clock.take())
    clock.close()
    if libs is not None:
        use_kernel(libs[0])
    if prof is not None:
        prof.__exit__(None, None, None)
    alt_label = f"{alt}" + (f", CPU-lane kernel built with -march={march}" if march is not None else "")
    for name, ts, gs in ((label, times, gcs), (f"{label}, alternate iterations with {alt_label}", alt_times, alt_gcs)):
        if ts:
            med = [statistics.median(t[j] for t in ts) for j in range(4)]
            gc_ms = " ".join(f"{ph} {1e3 * statistics.median(g.get(ph, 0.0) for g in gs):.1f}"
                             for ph in ("fwd", "bwd", "step"))
            print(f"== {name}: median fwd {med[0]:.3f} bwd {med[1]:.3f} step {med[2]:.3f} iter {med[3]:.3f} s "
                  f"({len(ts)} iterations; gc ms {gc_ms}); overlap stats {engine.optimizer.dostune_overlap_stats}; "
                  f"swing {engine.optimizer.dostune_swing_stats}",
                  flush=True)
    if prof is not None:
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
        print(ka.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50))
    engine.destroy()
    del engine
    torch.cuda.empty_cache()


if __name__ == "__main__":
    base = json.load(open(sys.argv[1]))
    base["gradient_clipping"] = 0.0  # as `dostune bench --clip 0`: speculative updates are committed
    run(base, os.environ.get("PROFILE") == "1", f"{sys.argv[1]} as is")
    for patch in sys.argv[2:]:
        cfg = json.loads(json.dumps(base))
        cfg["dostune"].update(json.loads(patch))
        run(cfg, False, patch)
