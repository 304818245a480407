"""How much CPU the CPU lane's OpenMP threads burn after the kernel returns (libgomp keeps a team's workers
spinning for GOMP_SPINCOUNT iterations before they sleep, 300,000 by default). Runs anywhere, no GPU:
    python3 scripts/omp-spin.py [THREADS] [ELEMENTS]
Compare with OMP_WAIT_POLICY=PASSIVE or GOMP_SPINCOUNT=0 in the environment (read when libgomp loads)."""
import os
import resource
import sys
import time

import torch

from dostune.optim import cpu_kernel
from dostune.optim.kernels import AdamScalarShadow


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else (os.cpu_count() or 2)
    n = int(float(sys.argv[2])) if len(sys.argv) > 2 else 4_000_000
    s = AdamScalarShadow(0.9, 0.95)
    s.increment(1, 0.9, 0.95)
    sc = s.scalars(1e-4, 1e-8, 0.01, True, True)
    p, m, v, po, mo, vo = (torch.randn(n) for _ in range(6))
    g, h = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    env = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    print(f"{threads} threads, {n:g} elements, {env or 'libgomp defaults'}", flush=True)
    for _ in range(3):
        t0 = time.perf_counter()
        cpu_kernel.adam_out_of_place(p, g, m, v, po, mo, vo, sc, half_out=h, threads=threads, nontemporal=True)
        call = time.perf_counter() - t0
        c0, t1 = cpu_seconds(), time.perf_counter()
        time.sleep(0.2)  # the calling thread sleeps: any CPU time now is the team's other threads
        print(f"call {1e3 * call:.1f} ms; then {1e3 * (cpu_seconds() - c0):.1f} ms of CPU in "
              f"{1e3 * (time.perf_counter() - t1):.0f} ms with the caller asleep", flush=True)


if __name__ == "__main__":
    main()
