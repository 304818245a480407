"""A short, human summary of a node profile: the figures the performance model leans on."""
from __future__ import annotations

from dataclasses import dataclass

from .record import NodeProfile, Series


@dataclass
class Row:
    what: str
    value: str
    detail: str


def fmt_size(size: int, unit: str) -> str:
    if unit == "bytes":
        return f"{size / 2**30:g} GiB" if size >= 2**30 else f"{size / 2**20:g} MiB"
    return f"{size / 1e6:g}M elem" if size >= 1e6 else f"{size / 1e3:g}K elem"


def _largest(series: Series):
    return max(series.points, key=lambda p: p.size)


def _rate_row(what: str, series: Series, scale: float, unit: str) -> Row:
    big = _largest(series)
    rate = big.rate / scale
    lo = big.size / big.seconds.hi / scale
    hi = big.size / big.seconds.lo / scale
    fit = series.fit
    size = fmt_size(big.size, series.unit)
    return Row(what, f"{rate:.2f} {unit}",
               f"at {size}: {lo:.2f}-{hi:.2f}; fit {fit.rate_per_s / scale:.2f} {unit} + {fit.overhead_s * 1e6:.0f} us/op")


def summary_rows(p: NodeProfile) -> list[Row]:
    rows = [Row("host", p.host.cpu_model, f"{p.host.logical_cores} cores, {p.host.numa_nodes} NUMA node(s), "
                f"{p.host.ram_gib:.0f} GiB; torch {p.host.torch}, DeepSpeed {p.host.deepspeed}")]
    if p.gpu is not None:
        link = p.gpu.pcie
        rows.append(Row("GPU", p.gpu.name, f"{p.gpu.memory_gib:.0f} GiB, driver {p.gpu.driver}, "
                        f"CUDA {p.host.cuda_runtime}"))
        if link is not None:
            rows.append(Row("PCIe link", f"Gen{link.max_generation} x{link.max_width}",
                            f"now Gen{link.current_generation} x{link.current_width}; theoretical "
                            f"{link.theoretical_gbps_max:.1f} GB/s per direction"))
    if p.copies is not None:
        c = p.copies
        for what, s in (("H2D pinned", c.h2d), ("D2H pinned", c.d2h), ("duplex H2D", c.duplex_h2d),
                        ("duplex D2H", c.duplex_d2h), ("H2D pageable", c.h2d_pageable)):
            rows.append(_rate_row(what, s, 1e9, "GB/s"))
        if c.d2h_pageable is not None:
            rows.append(_rate_row("D2H pageable", c.d2h_pageable, 1e9, "GB/s"))
    best = p.cpu_adam.best_threads
    for t, s in sorted(p.cpu_adam.by_threads.items()):
        r = _rate_row(f"CPU Adam {t} thr" + (" (best)" if t == best else ""), s, 1e9, "G elem/s")
        rows.append(r)
    for n, s in sorted(p.cpu_adam.concurrent.items()):
        rows.append(_rate_row(f"CPU Adam x{n} processes", s, 1e9, "G elem/s each"))
    if p.multi_gpu is not None:
        mg = p.multi_gpu
        shared = sorted({lvl for row in mg.common_ancestor for lvl in row if lvl not in (None, "self")})
        rows.append(Row(f"{len(mg.gpus)} GPUs together", ", ".join(mg.names),
                        f"NUMA nodes {mg.numa_node}; nearest common PCIe ancestors: {', '.join(shared) or 'unknown'}"))
        for what, s in (("H2D pinned, all GPUs", mg.copies.h2d), ("D2H pinned, all GPUs", mg.copies.d2h),
                        ("duplex H2D, all GPUs", mg.copies.duplex_h2d), ("duplex D2H, all GPUs", mg.copies.duplex_d2h)):
            rows.append(_rate_row(what, s, 1e9, "GB/s each"))
    if p.gpu_adam is not None:
        rows.append(_rate_row("GPU lane Adam (Triton)", p.gpu_adam, 1e9, "G elem/s"))
    rows.append(_rate_row(f"fp32->{p.convert.dtype} CPU", p.convert.cpu, 1e9, "G elem/s"))
    if p.convert.gpu is not None:
        rows.append(_rate_row(f"fp32->{p.convert.dtype} GPU", p.convert.gpu, 1e9, "G elem/s"))
    if p.unscale is not None:
        rows.append(_rate_row("grad unscale CPU", p.unscale, 1e9, "G elem/s"))
    if p.ds_upload is not None:
        rows.append(_rate_row("DeepSpeed half upload", p.ds_upload, 1e9, "G elem/s"))
    if p.contention is not None:
        k = p.contention
        rows.append(Row("CPU Adam under DMA", f"x{k.slowdown:.2f} slower",
                        f"{k.elements / 1e6:.0f}M elem, {k.threads} thr: {k.alone_s.median * 1e3:.0f} -> "
                        f"{k.with_dma_s.median * 1e3:.0f} ms while DMA ran at {k.dma_gbps_during:.1f} GB/s per direction"
                        + (f" on {k.gpus} GPUs together" if k.gpus > 1 else "")))
    return rows
