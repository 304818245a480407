"""Optimizer-side throughputs: DeepSpeedCPUAdam, the GPU lane's fused Adam, fp32->half conversion,
and CPU Adam slowed down by concurrent PCIe DMA."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ..optim.kernels import AdamScalarShadow, load_cpu_adam_op, triton_adam_
from ..stats import Stat, upper_middle
from .copy_load import DuplexCopies
from .record import ContentionProfile, ConvertProfile, CpuAdamProfile, Sample, Series, fit_series
from .timing import NullProgress, ProgressSink, time_cpu, time_cuda

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _threads:
    """Set torch's (and so DeepSpeedCPUAdam's OpenMP) thread count for a block."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.prev)


class CpuAdamBench:
    """DeepSpeedCPUAdam on one flat fp32 tensor, as the offloaded ZeRO-3 optimizer calls it per subgroup."""

    _next_id = 10_000  # clear of the ids DeepSpeedCPUAdam hands out to real optimizers

    def __init__(self, elements: int):
        self.op = load_cpu_adam_op()
        self.opt_id = CpuAdamBench._next_id
        CpuAdamBench._next_id += 1
        self.op.create_adam(self.opt_id, 1e-4, 0.9, 0.999, 1e-8, 0.01, True, False)
        gen = torch.Generator().manual_seed(0)
        self.p = torch.randn(elements, generator=gen)
        self.g = torch.randn(elements, generator=gen) * 1e-3
        self.m = torch.zeros(elements)
        self.v = torch.zeros(elements)
        self.step_no = 0

    def step(self, n: Optional[int] = None) -> None:
        self.step_no += 1
        sl = slice(0, n)
        self.op.adam_update(self.opt_id, self.step_no, 1e-4, 0.9, 0.999, 1e-8, 0.01, True,
                            self.p[sl], self.g[sl], self.m[sl], self.v[sl])

    def close(self) -> None:
        self.op.destroy_adam(self.opt_id)


def default_thread_counts(cores: int) -> list[int]:
    return sorted({max(1, c) for c in (1, cores // 4, cores // 2, (3 * cores) // 4, cores)})


def measure_cpu_adam(sizes: Sequence[int], threads: Sequence[int], repeats: int,
                     progress: Optional[ProgressSink] = None) -> CpuAdamProfile:
    progress = progress or NullProgress()
    progress.start("building/loading DeepSpeed CPU Adam (first build takes about a minute)", 1)
    bench = CpuAdamBench(max(sizes))
    progress.advance()
    progress.start("DeepSpeedCPUAdam over sizes and threads", len(sizes) * len(threads) * repeats)
    by_threads: dict[int, Series] = {}
    try:
        for t in threads:
            pts = []
            with _threads(t):
                for n in sizes:
                    pts.append(Sample(size=n, threads=t, seconds=time_cpu(lambda: bench.step(n), repeats,
                                                                          progress=progress)))
            by_threads[t] = fit_series("elements", pts)
    finally:
        bench.close()
    best = max(by_threads, key=lambda t: by_threads[t].fit.rate_per_s)
    return CpuAdamProfile(by_threads=by_threads, best_threads=best)


def measure_gpu_adam(sizes: Sequence[int], repeats: int, device: int = 0, half_dtype: str = "bf16",
                     progress: Optional[ProgressSink] = None) -> Series:
    """The GPU lane's kernel as the optimizer runs it: unscale, DeepSpeed-exact AdamW on fp32 state, and
    the half-precision copy of the new params, in one pass."""
    progress = progress or NullProgress()
    progress.start("GPU lane Adam (Triton, DeepSpeed-exact)", len(sizes) * repeats)
    dev = torch.device("cuda", device)
    top = max(sizes)
    p, g = torch.randn(top, device=dev), torch.randn(top, device=dev) * 1e-3
    m, v = torch.zeros(top, device=dev), torch.zeros(top, device=dev)
    half = torch.empty(top, device=dev, dtype=HALF[half_dtype])
    shadow = AdamScalarShadow(0.9, 0.999)
    shadow.increment(1, 0.9, 0.999)
    scalars = shadow.scalars(1e-4, 1e-8, 0.01, True, True)
    pts = []
    for n in sizes:
        def run():
            triton_adam_(p[:n], g[:n], m[:n], v[:n], half[:n], 1.0, scalars)
        pts.append(Sample(size=n, seconds=time_cuda(run, repeats, inner=max(1, (64 << 20) // n),
                                                    progress=progress)))
    del p, g, m, v, half
    torch.cuda.empty_cache()
    return fit_series("elements", pts)


def measure_convert(sizes: Sequence[int], repeats: int, dtype: str, cpu_threads: int, device: Optional[int],
                    progress: Optional[ProgressSink] = None) -> ConvertProfile:
    progress = progress or NullProgress()
    half = HALF[dtype]
    progress.start(f"fp32 -> {dtype} conversion", len(sizes) * repeats * (2 if device is not None else 1))
    top = max(sizes)
    src = torch.randn(top)
    dst = torch.empty(top, dtype=half)
    with _threads(cpu_threads):
        cpu = fit_series("elements", [Sample(size=n, threads=cpu_threads, seconds=time_cpu(
            lambda: dst[:n].copy_(src[:n]), repeats, progress=progress)) for n in sizes])
    gpu = None
    if device is not None:
        dev = torch.device("cuda", device)
        gsrc, gdst = src.to(dev), dst.to(dev)
        gpu = fit_series("elements", [Sample(size=n, seconds=time_cuda(
            lambda: gdst[:n].copy_(gsrc[:n]), repeats, inner=max(1, (64 << 20) // n), progress=progress))
            for n in sizes])
        del gsrc, gdst
        torch.cuda.empty_cache()
    return ConvertProfile(dtype=dtype, cpu=cpu, gpu=gpu)


def measure_ds_upload(sizes: Sequence[int], repeats: int, dtype: str, device: int = 0,
                      progress: Optional[ProgressSink] = None) -> Series:
    """DeepSpeed's own way of refreshing a subgroup's half-precision GPU partition after CPU Adam:
    ``fp16_partition.copy_(fp32_partition)`` from pageable memory, blocking (torch converts on the CPU into
    a fresh temporary, then copies it through the driver's staging buffer)."""
    progress = progress or NullProgress()
    progress.start("DeepSpeed's fp32 -> half GPU upload (pageable, blocking)", len(sizes) * repeats)
    src = torch.randn(max(sizes))
    dst = torch.empty(max(sizes), dtype=HALF[dtype], device=torch.device("cuda", device))

    def run(n):
        dst[:n].copy_(src[:n])
        torch.cuda.synchronize(device)

    return fit_series("elements", [Sample(size=n, seconds=time_cpu(lambda: run(n), repeats, progress=progress))
                                   for n in sizes])


def measure_unscale(sizes: Sequence[int], repeats: int, threads: int,
                    progress: Optional[ProgressSink] = None) -> Series:
    """DeepSpeed's CPU-side unscale/clip of an offloaded fp32 gradient: ``grad.mul_(1 / combined_scale)``."""
    progress = progress or NullProgress()
    progress.start("CPU gradient unscale (grad *= 1/scale)", len(sizes) * repeats)
    g = torch.randn(max(sizes))
    inv = torch.tensor(1.0 / 1.37)
    with _threads(threads):
        return fit_series("elements", [Sample(size=n, threads=threads, seconds=time_cpu(
            lambda: g[:n].mul_(inv), repeats, progress=progress)) for n in sizes])


def rate_under_load(chunk_ends: Sequence[float], busy_from: float, busy_to: float) -> Optional[float]:
    """Equal chunks copied back to back from time 0, given their end times: the rate of the chunks that ran entirely
    within [busy_from, busy_to] (while the host computed) over the rate of those that ran entirely after it. None
    with fewer than two of either."""
    starts = [0.0, *chunk_ends[:-1]]
    during = [e - s for s, e in zip(starts, chunk_ends) if s >= busy_from and e <= busy_to]
    after = [e - s for s, e in zip(starts, chunk_ends) if s >= busy_to]
    if len(during) < 2 or len(after) < 2:
        return None
    return (len(during) / sum(during)) / (len(after) / sum(after))


def measure_contention(elements: int, threads: int, repeats: int, device: int = 0,
                       chunk_bytes: int = 256 << 20, progress: Optional[ProgressSink] = None,
                       devices: Optional[Sequence[int]] = None) -> ContentionProfile:
    """CPU Adam alone, then with both PCIe directions streaming pinned memory underneath it, on ``device`` or on
    every GPU of ``devices`` at once (the traffic the ranks of one node make together). The copies outlast the step,
    so the same window also shows the host-to-device copies slowed by CPU Adam (``h2d_under_cpu``): both stream
    through host memory.

    The copies are queued ahead on each GPU (copy_load.py): DeepSpeedCPUAdam holds the GIL, so no Python thread could
    feed them during its step."""
    progress = progress or NullProgress()
    devs = [torch.device("cuda", d) for d in (devices or [device])]
    progress.start("CPU Adam under concurrent PCIe traffic" + (f" ({len(devs)} GPUs)" if len(devs) > 1 else ""),
                   2 * repeats)
    bench = CpuAdamBench(elements)
    copies = [DuplexCopies(dev, chunk_bytes) for dev in devs]
    try:
        with _threads(threads):
            alone = time_cpu(bench.step, repeats, progress=progress)
            samples, rates, ratios = [], [], []
            for _ in range(repeats):
                queued = [c.queue(alone.median) for c in copies]
                time.sleep(0.002)  # let the DMA engines get going before the CPU step starts
                t0 = time.perf_counter()
                bench.step()
                t1 = time.perf_counter()
                samples.append(t1 - t0)
                h2d_ends = [q.chunk_ends()[0] for q in queued]
                # every GPU's host-to-device rate added up
                rates.append(sum(len(ends) * chunk_bytes / ends[-1] / 1e9 for ends in h2d_ends))
                for q, ends in zip(queued, h2d_ends):
                    r = rate_under_load(ends, t0 - q.t_queue, t1 - q.t_queue)
                    if r is not None:
                        ratios.append(r)
                progress.advance()
    finally:
        bench.close()
        del copies
        torch.cuda.empty_cache()
    return ContentionProfile(elements=elements, threads=threads, alone_s=alone, with_dma_s=Stat.of(samples),
                             dma_gbps_during=round(upper_middle(rates), 2), gpus=len(devs),
                             h2d_under_cpu=round(upper_middle(ratios), 3) if ratios else None)
