"""On the GPU machine: where does backward's time go with a given dostune schedule? Builds gpt2-1.3b (bf16, micro-batch
8, seq 1024) under the config, runs warm-up iterations, then records one iteration with torch.profiler and prints
the host-side CUDA calls and the GPU kernels/copies that took longest, with forward/backward/step times.
    python3 scripts/device-profile-backward.py CONFIG [backward_gpu_subgroups ...]
Each extra argument re-runs with the dostune section's backward_gpu_subgroups set to it (timings only)."""
import json
import sys
import time

import torch

from dostune.models.registry import loss_of, resolve_model
from dostune.train.engine import build_engine


def run(cfg: dict, profile: bool, label: str) -> None:
    spec = resolve_model("gpt2-1.3b")
    engine = build_engine(spec, cfg, seed=0, use_dostune=True)
    gen = torch.Generator().manual_seed(1)
    times = []
    for k in range(6):
        batch = spec.batch(8, 1024, gen, engine.device)
        torch.cuda.synchronize()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if (profile and k == 5) else None
        if prof:
            prof.__enter__()
        t0 = time.perf_counter()
        loss = loss_of(engine(**batch))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if prof:
            prof.__exit__(None, None, None)
        times.append((t1 - t0, t2 - t1, t3 - t2))
    print(f"== {label}: fwd/bwd/step of the last 3 iterations:", [tuple(round(x, 3) for x in t) for t in times[-3:]])
    print("   overlap stats:", engine.optimizer.dostune_overlap_stats)
    if profile:
        ka = prof.key_averages()
        print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(ka.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
    engine.destroy()
    del engine
    torch.cuda.empty_cache()


if __name__ == "__main__":
    base = json.load(open(sys.argv[1]))
    run(base, True, f"{sys.argv[1]} as is")
    for k in sys.argv[2:]:
        cfg = json.loads(json.dumps(base))
        cfg["dostune"]["backward_gpu_subgroups"] = int(k)
        run(cfg, False, f"backward_gpu_subgroups={k}")
