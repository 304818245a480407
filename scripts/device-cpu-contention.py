"""On the GPU machine: how CPU work on the other cores slows one host thread (backward's autograd thread is one,
and ZeRO-3's Python hooks pace backward). The main thread measures, alone and beside each load:
  * its clock: cycles of a loop of dependent integer adds (one per cycle) per second, in GHz;
  * a hook-like loop: tiny CUDA launches and Python bookkeeping, loops per second.
Loads, each on N threads (default 15) for the length of the measurement:
  alu     integer adds, no memory, no vector units;
  avx512  512-bit fused multiply-adds on registers, no memory;
  avx2    the same with 256-bit vectors;
  stream  torch multiply-add over 800 MB (memory bandwidth, torch's threads);
  adam    dostune's CPU-lane kernel (cpu_adam_oop.c) as dostune builds it (-march=native), 25M-element subgroups;
  adam256 the same source built for AVX2 only (-march=haswell), which keeps 512-bit instructions out.
Then a sibling scan: main thread pinned to CPU 0, one avx512 thread pinned to each other CPU in turn: a CPU that
shares a physical core with CPU 0 on the host shows as a large drop.
    python3 scripts/device-cpu-contention.py [THREADS] [LOAD ...]"""
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dostune.optim import cpu_kernel
from dostune.optim.kernels import AdamScalarShadow

PROBE_C = r"""
#include <immintrin.h>
#include <stdint.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
/* n dependent adds: about n cycles */
double clock_probe(long n) {
    double t0 = now(); long x = 0;
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0" : "+r"(x));
    return n / (now() - t0) / 1e9;
}
void alu_burn(volatile int *stop) {
    long x = 0, y = 0;
    while (!*stop) for (int i = 0; i < 100000; i++) { __asm__ volatile("add $1, %0\n\tadd $3, %1" : "+r"(x), "+r"(y)); }
}
__attribute__((target("avx512f"))) void avx512_burn(volatile int *stop) {
    __m512 a[8]; __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
    for (int k = 0; k < 8; k++) a[k] = _mm512_set1_ps((float)k);
    while (!*stop) for (int i = 0; i < 100000; i++) for (int k = 0; k < 8; k++) a[k] = _mm512_fmadd_ps(a[k], b, c);
    float s[16]; _mm512_storeu_ps(s, a[0]); if (s[0] == 12345.f) *stop = 2;
}
__attribute__((target("avx2,fma"))) void avx2_burn(volatile int *stop) {
    __m256 a[8]; __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
    for (int k = 0; k < 8; k++) a[k] = _mm256_set1_ps((float)k);
    while (!*stop) for (int i = 0; i < 100000; i++) for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(a[k], b, c);
    float s[8]; _mm256_storeu_ps(s, a[0]); if (s[0] == 12345.f) *stop = 2;
}
"""


def build(src: str, flags: list[str], out: Path) -> ctypes.CDLL:
    c = out.with_suffix(".c")
    c.write_text(src)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", *flags, str(c), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


def hook_like(x: torch.Tensor, seconds: float) -> float:
    n, t0, table = 0, time.perf_counter(), {}
    while time.perf_counter() - t0 < seconds:
        y = x.narrow(0, n % 64, 64).float().norm(2)
        table[n % 1000] = (y, [n] * 8)
        n += 1
    if x.is_cuda:
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def measure(probe, x) -> tuple[float, float]:
    ghz = statistics.median(probe.clock_probe(ctypes.c_long(50_000_000)) for _ in range(9))
    return ghz, hook_like(x, 1.0)


class Load:
    def __init__(self, kind: str, threads: int, probe, adam_libs: dict, data):
        self.stop = ctypes.c_int(0)
        self.flag = False
        self.ths = []
        if kind in ("alu", "avx512", "avx2"):
            fn = getattr(probe, f"{kind}_burn")
            self.ths = [threading.Thread(target=fn, args=(ctypes.byref(self.stop),)) for _ in range(threads)]
        elif kind == "stream":
            self.ths = [threading.Thread(target=self._stream, args=(threads,))]
        else:
            self.ths = [threading.Thread(target=self._adam, args=(adam_libs[kind], threads, data))]
        for t in self.ths:
            t.start()
        time.sleep(0.3)

    def _stream(self, threads):
        torch.set_num_threads(threads)
        a, b = torch.ones(100_000_000), torch.ones(100_000_000)
        while not self.flag:
            a.mul_(0.999).add_(b)

    def _adam(self, lib, threads, data):
        ins, outs, sc = data
        saved, cpu_kernel._lib = cpu_kernel._lib, lib
        k = 0
        while not self.flag:
            (p, m, v, g), (po, mo, vo, h) = ins[k % len(ins)], outs[k % len(outs)]
            cpu_kernel.adam_out_of_place(p, g, m, v, po, mo, vo, sc, half_out=h, threads=threads, nontemporal=True)
            k += 1
        cpu_kernel._lib = saved

    def close(self):
        self.stop.value = 1
        self.flag = True
        for t in self.ths:
            t.join()


def adam_variant(march: str) -> ctypes.CDLL:
    """The CPU-lane kernel built with -march=``march`` (dostune builds it with native)."""
    saved, saved_lib = cpu_kernel._FLAGS, cpu_kernel._lib
    try:
        cpu_kernel._FLAGS = [f if f != "-march=native" else f"-march={march}" for f in saved]
        cpu_kernel._lib = None
        return cpu_kernel.load()
    finally:
        cpu_kernel._FLAGS, cpu_kernel._lib = saved, saved_lib


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    kinds = sys.argv[2:] or ["alu", "avx512", "avx2", "stream", "adam", "adam256"]
    tmp = Path(tempfile.mkdtemp())
    probe = build(PROBE_C, [], tmp / "probe.so")
    probe.clock_probe.restype = ctypes.c_double
    probe.clock_probe.argtypes = [ctypes.c_long]
    libs = {"adam": adam_variant("native"), "adam256": adam_variant("haswell")}
    n = 25_000_000
    s = AdamScalarShadow(0.9, 0.95)
    s.increment(1, 0.9, 0.95)
    sc = s.scalars(1e-4, 1e-8, 0.01, True, True)
    pin = (lambda t: t.pin_memory()) if torch.cuda.is_available() else (lambda t: t)
    ins = [[pin(torch.randn(n)) for _ in range(3)] + [pin(torch.randn(n).bfloat16())] for _ in range(6)]
    outs = [[pin(torch.empty(n)) for _ in range(3)] + [pin(torch.empty(n, dtype=torch.bfloat16))]
            for _ in range(6)]
    x = torch.randn(1 << 16, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
    print(f"cpus {sorted(os.sched_getaffinity(0))}; {threads} load threads", flush=True)
    base = measure(probe, x)
    print(f"alone        : clock {base[0]:.2f} GHz, hook-like loop {base[1]:,.0f}/s", flush=True)
    for kind in kinds:
        load = Load(kind, threads, probe, libs, (ins, outs, sc))
        got = measure(probe, x)
        load.close()
        again = measure(probe, x)
        print(f"{kind:13s}: clock {got[0]:.2f} GHz ({got[0] / base[0]:.2f} of alone), hook-like loop {got[1]:,.0f}/s "
              f"({base[1] / got[1]:.2f}x slower); alone right after: {again[0]:.2f} GHz, {again[1]:,.0f}/s", flush=True)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})
        row = []
        for j in cpus[1:]:
            stop = ctypes.c_int(0)

            def pinned(j=j, stop=stop):
                os.sched_setaffinity(0, {j})
                probe.avx512_burn(ctypes.byref(stop))

            th = threading.Thread(target=pinned)
            th.start()
            time.sleep(0.1)
            ghz = statistics.median(probe.clock_probe(ctypes.c_long(50_000_000)) for _ in range(5))
            stop.value = 1
            th.join()
            row.append(f"{j}:{ghz:.2f}")
        os.sched_setaffinity(0, set(cpus))
        print(f"sibling scan, clock of CPU {cpus[0]} (GHz) with one avx512 thread on CPU j: " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
