"""On the GPU machine: where one iteration's time goes, per method, from a torch.profiler trace.
    python3 scripts/device-trace.py OUTDIR LABEL=CONFIG [LABEL=CONFIG ...]
Each CONFIG is a DeepSpeed config (a `dostune` section switches dostune's optimizer on; the keyword `no-offload` or
`zero-offload` builds the bench's baseline). gpt2-1.3b, bf16, micro-batch 8, seq 1024, clipping off. The last of
WARMUP+1 iterations is profiled; OUTDIR gets LABEL.trace.json.gz and the summary (scripts/trace_summary.py) is
printed. The phases are marked with record_function ranges `phase:fwd|bwd|step`."""
import gzip
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from trace_summary import summarise  # noqa: E402

from dostune.dsconfig import OffloadSettings, TrainSettings, deepspeed_config  # noqa: E402
from dostune.models.registry import loss_of, resolve_model  # noqa: E402
from dostune.train.engine import build_engine  # noqa: E402

WARMUP = 4


def config_for(what: str) -> tuple[dict, bool]:
    train = TrainSettings(micro_batch=8, grad_accum=1, clip=0.0, precision="bf16")
    if what == "no-offload":
        return deepspeed_config(train, OffloadSettings(sub_group_size=100_000_000, ratio=0.0)), False
    if what == "zero-offload":
        return deepspeed_config(train, OffloadSettings(sub_group_size=100_000_000, ratio=1.0)), False
    cfg = json.load(open(what))
    cfg["gradient_clipping"] = 0.0
    return cfg, "dostune" in cfg


def run(label: str, what: str, outdir: str) -> None:
    cfg, use_dostune = config_for(what)
    spec = resolve_model("gpt2-1.3b")
    engine = build_engine(spec, cfg, seed=0, use_dostune=use_dostune)
    gen = torch.Generator().manual_seed(1)
    times = []
    for k in range(WARMUP + 1):
        batch = spec.batch(8, 1024, gen, engine.device)
        torch.cuda.synchronize()
        prof = None
        if k == WARMUP:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA], with_stack=True)
            prof.__enter__()
        t0 = time.perf_counter()
        with torch.profiler.record_function("phase:fwd"):
            loss = loss_of(engine(**batch))
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with torch.profiler.record_function("phase:bwd"):
            engine.backward(loss)
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        with torch.profiler.record_function("phase:step"):
            engine.step()
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        times.append((t1 - t0, t2 - t1, t3 - t2))
        if prof is not None:
            prof.__exit__(None, None, None)
            raw = os.path.join(outdir, f"{label}.trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
            print(f"== {label} ({what}): unprofiled iteration before: fwd {times[-2][0]:.3f} bwd {times[-2][1]:.3f} "
                  f"step {times[-2][2]:.3f}; profiled: fwd {t1 - t0:.3f} bwd {t2 - t1:.3f} step {t3 - t2:.3f}; "
                  f"trace {os.path.getsize(raw + '.gz') / 2**20:.1f} MiB gz", flush=True)
            print(summarise(json.load(open(raw))), flush=True)
            os.remove(raw)
    engine.destroy()
    del engine
    torch.cuda.empty_cache()


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for arg in sys.argv[2:]:
        label, what = arg.split("=", 1)
        run(label, what, out)
