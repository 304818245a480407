"""On the GPU machine: dostune's out-of-place CPU Adam (the CPU lane during backward) with ordinary and with streaming
(non-temporal) stores, alone and while the main thread runs a Python loop of small CUDA launches like backward's
hooks, to see how much each slows the other.
    python3 scripts/device-cpu-kernel.py [ELEMENTS] [THREADS ...]
MARCH=haswell builds the kernel with -march=haswell (no 512-bit instructions) instead of -march=native."""
import os
import sys
import threading
import time

import torch

from dostune.optim import cpu_kernel
from dostune.optim.kernels import AdamScalarShadow


def hooks_loop(x: torch.Tensor, seconds: float) -> float:
    """Python-heavy work like ZeRO-3's backward hooks: many tiny launches and bookkeeping; returns loops/s."""
    n, t0 = 0, time.perf_counter()
    table = {}
    while time.perf_counter() - t0 < seconds:
        y = x.narrow(0, n % 64, 64).float().norm(2)
        table[n % 1000] = (y, [n] * 8)
        n += 1
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def lane(ins, outs, sc, threads: int, nt: bool, result: list) -> None:
    """CPU Adam over the subgroups in turn for 3 s; appends G elements/s."""
    t0, k, n = time.perf_counter(), 0, ins[0][0].numel()
    while time.perf_counter() - t0 < 3.0:
        (p, m, v, g), (po, mo, vo, h) = ins[k % len(ins)], outs[k % len(outs)]
        cpu_kernel.adam_out_of_place(p, g, m, v, po, mo, vo, sc, half_out=h, threads=threads, nontemporal=nt)
        k += 1
    result.append(k * n / (time.perf_counter() - t0) / 1e9)


def main() -> None:
    n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 25_000_000
    thread_counts = [int(t) for t in sys.argv[2:]] or [15]
    if os.environ.get("MARCH"):
        cpu_kernel._FLAGS = [f if f != "-march=native" else f"-march={os.environ['MARCH']}" for f in cpu_kernel._FLAGS]
        print(f"kernel built with {cpu_kernel._FLAGS}", flush=True)
    s = AdamScalarShadow(0.9, 0.95)
    s.increment(1, 0.9, 0.95)
    sc = s.scalars(1e-4, 1e-8, 0.01, True, True)
    subgroups = 8  # distinct buffers, so the caches cannot hold the working set
    ins = [[torch.randn(n).pin_memory() for _ in range(3)] + [torch.randn(n).bfloat16().pin_memory()]
           for _ in range(subgroups)]
    outs = [[torch.empty(n).pin_memory() for _ in range(3)] + [torch.empty(n, dtype=torch.bfloat16).pin_memory()]
            for _ in range(subgroups)]
    x = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    print(f"cpus {sorted(os.sched_getaffinity(0))}", flush=True)
    alone = hooks_loop(x, 2.0)
    print(f"hook-like loop alone: {alone:,.0f}/s", flush=True)
    for threads in thread_counts:
        for nt in (False, True, False, True):
            res: list = []
            th = threading.Thread(target=lane, args=(ins, outs, sc, threads, nt, res))
            th.start()
            time.sleep(0.3)
            loops = hooks_loop(x, 2.0)
            th.join()
            print(f"threads {threads:2d} nontemporal {nt!s:5}: CPU Adam {res[0]:.2f} G el/s, "
                  f"hook-like loop {loops:,.0f}/s ({alone / loops:.2f}x slower than alone)", flush=True)


if __name__ == "__main__":
    main()
