"""`dostune profile` for the node: run every measurement and assemble a NodeProfile."""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Optional

import torch

from .._version import __version__
from ..host_steal import StealMeter, steal_note
from ..invocation import invocation
from . import identity
from .copies import measure_copies
from .record import NODE_SCHEMA_VERSION, MultiGpuProfile, NodeMode, NodeProfile
from .throughput import (default_thread_counts, measure_contention, measure_convert, measure_cpu_adam, measure_ds_upload,
                         measure_gpu_adam, measure_unscale)
from .timing import NullProgress, ProgressSink
from .together import measure_copies_together, measure_cpu_adam_concurrent

MiB = 1 << 20
M = 1_000_000


# Timed repeats of each measurement, by mode: "standard" (the default) keeps every figure the tuner reads, each the
# median of three; "thorough" (for validation work) takes five, the default before the modes existed.
NODE_REPEATS = {"standard": 3, "thorough": 5}


@dataclass
class NodeProfileOptions:
    """What to measure. The defaults are the standard mode's, what `dostune profile` measures; ``thorough()`` takes
    more repeats, ``tiny()`` seconds on any machine."""

    name: Optional[str] = None
    mode: NodeMode = "standard"
    repeats: int = NODE_REPEATS["standard"]
    device: int = 0
    copy_sizes_bytes: list[int] = field(default_factory=lambda: [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB])
    cpu_adam_elements: Optional[list[int]] = None  # default depends on GPU/no GPU, see measure_node
    cpu_adam_threads: Optional[list[int]] = None
    gpu_adam_elements: list[int] = field(default_factory=lambda: [4 * M, 16 * M, 64 * M, 256 * M])
    convert_elements: list[int] = field(default_factory=lambda: [4 * M, 16 * M, 64 * M, 256 * M])
    half_dtype: str = "bf16"
    contention: bool = True
    # how many ranks of this node to measure together (CPU Adam in that many processes, GPUs [0:N) copying at
    # once, the contention with all of them streaming); None: the GPUs torch sees (1 without a GPU)
    ranks_per_node: Optional[int] = None

    @classmethod
    def thorough(cls) -> "NodeProfileOptions":
        """More repeats of every measurement: for validation work, where the profile's own spread should not count."""
        return cls(mode="thorough", repeats=NODE_REPEATS["thorough"])

    @classmethod
    def tiny(cls) -> "NodeProfileOptions":
        """Seconds instead of minutes: for tests and smoke runs, not a profile to tune from."""
        return cls(mode="quick", repeats=2, copy_sizes_bytes=[1 * MiB, 4 * MiB], cpu_adam_elements=[100_000, 400_000],
                   cpu_adam_threads=[1], gpu_adam_elements=[1 * M, 4 * M], convert_elements=[100_000, 400_000])

    def validate(self) -> None:
        from ..errors import DostuneError

        if self.mode not in ("quick", "standard", "thorough"):
            raise DostuneError(f"unknown profile mode {self.mode!r}: quick, standard or thorough")
        if self.repeats < 1:
            raise DostuneError(f"--repeats must be at least 1, got {self.repeats}")
        for label, sizes in (("copy sizes", self.copy_sizes_bytes), ("GPU Adam sizes", self.gpu_adam_elements),
                             ("conversion sizes", self.convert_elements),
                             ("CPU Adam sizes", self.cpu_adam_elements or [1])):
            if not sizes or any(s <= 0 for s in sizes):
                raise DostuneError(f"{label} must be positive, got {sizes}")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise DostuneError(f"--ranks-per-node must be at least 1, got {self.ranks_per_node}")
        if self.half_dtype not in ("bf16", "fp16"):
            raise DostuneError(f"--dtype must be bf16 or fp16, got {self.half_dtype!r}")


def measure_node(opts: NodeProfileOptions, progress: Optional[ProgressSink] = None,
                 command: Optional[str] = None) -> NodeProfile:
    opts.validate()
    progress = progress or NullProgress()
    host = identity.host_info()
    has_gpu = identity.cuda_available()
    notes: list[str] = []
    if has_gpu and opts.device >= torch.cuda.device_count():
        from ..errors import DostuneError

        raise DostuneError(f"--device {opts.device} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
    ranks = opts.ranks_per_node or (torch.cuda.device_count() if has_gpu else 1)
    if has_gpu and ranks > torch.cuda.device_count():
        from ..errors import DostuneError

        raise DostuneError(f"--ranks-per-node {ranks} is more than the {torch.cuda.device_count()} GPU(s) torch sees",
                           hint="one rank per GPU: give at most that many")
    together = list(range(ranks)) if has_gpu and ranks > 1 else []
    gpu = identity.gpu_info(opts.device) if has_gpu else None
    if not has_gpu:
        notes.append(f"GPU measurements not available: {identity.no_gpu_reason()}. Only the CPU side (CPU Adam, "
                     "conversions) was measured; `dostune tune` needs GPU and PCIe figures, so profile the GPU "
                     "machine you will train on (without a GPU, tune uses the shipped H200 profile)")
    elif gpu.pcie is None:
        notes.append("NVML did not report the PCIe link (no NVML library, or the driver does not answer the query): "
                     "the copies were measured all the same; the default name leaves out the PCIe generation")
    cores = host.logical_cores
    threads = opts.cpu_adam_threads or default_thread_counts(cores)
    cpu_sizes = opts.cpu_adam_elements or ([8 * M, 32 * M, 128 * M] if has_gpu else [4 * M, 16 * M, 64 * M])

    steal = StealMeter()
    steal.start()
    copies = measure_copies(opts.copy_sizes_bytes, opts.repeats, opts.device, progress) if has_gpu else None
    cpu_adam = measure_cpu_adam(cpu_sizes, threads, opts.repeats, progress)
    if ranks > 1:
        # as the ranks of this node run it: one process each, the node's cores split between them
        series = measure_cpu_adam_concurrent(cpu_sizes, ranks, max(1, cores // ranks), opts.repeats, progress)
        cpu_adam = cpu_adam.model_copy(update={"concurrent": {ranks: series}})
    multi_gpu = None
    if together:
        numa, ancestors = identity.gpu_topology(together)
        multi_gpu = MultiGpuProfile(gpus=together, names=[torch.cuda.get_device_name(d) for d in together],
                                    numa_node=numa, common_ancestor=ancestors,
                                    copies=measure_copies_together(opts.copy_sizes_bytes, opts.repeats, together,
                                                                   progress))
    gpu_adam = (measure_gpu_adam(opts.gpu_adam_elements, opts.repeats, opts.device, opts.half_dtype, progress)
                if has_gpu else None)
    convert = measure_convert(opts.convert_elements, opts.repeats, opts.half_dtype, cpu_adam.best_threads,
                              opts.device if has_gpu else None, progress)
    unscale = measure_unscale(opts.convert_elements, opts.repeats, cpu_adam.best_threads, progress)
    ds_upload = (measure_ds_upload(opts.convert_elements, opts.repeats, opts.half_dtype, opts.device, progress)
                 if has_gpu else None)
    contention = None
    if has_gpu and opts.contention:
        contention = measure_contention(max(cpu_sizes), cpu_adam.best_threads, opts.repeats, opts.device,
                                        chunk_bytes=min(256 * MiB, max(opts.copy_sizes_bytes)), progress=progress,
                                        devices=together or None)
    steal.stop()
    note = steal_note(steal.share, "this node was measured")
    if note:
        notes.append(note)
    return NodeProfile(
        schema_version=NODE_SCHEMA_VERSION,
        name=opts.name or identity.node_name(gpu),
        mode=opts.mode,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=command or invocation(),
        dostune_version=__version__,
        repeats=opts.repeats,
        host=host,
        gpu=gpu,
        notes=notes,
        copies=copies,
        cpu_adam=cpu_adam,
        gpu_adam=gpu_adam,
        convert=convert,
        unscale=unscale,
        ds_upload=ds_upload,
        contention=contention,
        multi_gpu=multi_gpu,
        steal=steal.share,
    )
