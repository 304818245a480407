"""What `dostune profile --model` watches its iterations with, beside the clock: the memory at module boundaries
(forward hooks, and gradient hooks in backward), when each optimizer subgroup's gradients become final in backward
(a wrapper on DeepSpeed's ``partition_grads``), and the PCIe traffic of each phase from NVML's counters.

measure_model (model.py) sets the phase they file their readings under. The memory samples and the gradients' marks
are taken in the one iteration it records, not a timed one, as their hooks slow it; the PCIe counters are read from
the first iteration until that one. Profiling only: measure_model removes every hook and wrapper before it destroys
the engine.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from . import identity
from .model_record import MemorySample, PcieTraffic

GiB = 2**30


class MemoryReader:
    """Memory readings: the CUDA caching allocator on a GPU, the process's RSS on a CPU machine."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if not cuda:
            import psutil

            self._proc = psutil.Process()

    def read(self) -> tuple[float, float]:
        if self.cuda:
            return torch.cuda.memory_allocated() / GiB, torch.cuda.memory_reserved() / GiB
        rss = self._proc.memory_info().rss / GiB
        return rss, rss


class MemoryRecorder:
    """Collects labelled memory samples for the iteration being recorded."""

    def __init__(self, mem: MemoryReader):
        self.mem = mem
        self.active = False
        self.phase = "fwd"
        self.t0 = 0.0
        self.samples: list[MemorySample] = []
        self.lock = threading.Lock()

    def start(self):
        self.samples, self.t0, self.active = [], time.perf_counter(), True

    def sample(self, where: str):
        if not self.active:
            return
        a, r = self.mem.read()
        with self.lock:
            self.samples.append(MemorySample(t=time.perf_counter() - self.t0, phase=self.phase,
                                             allocated_gib=round(a, 4), reserved_gib=round(r, 4), where=where))


def install_memory_hooks(model: torch.nn.Module, rec: MemoryRecorder) -> list:
    handles = []
    for name, mod in model.named_modules():
        if not any(True for _ in mod.parameters(recurse=False)):
            continue
        label = name or "<model>"
        handles.append(mod.register_forward_pre_hook(lambda *_a, _l=label: rec.sample(f"{_l}:enter")))
        handles.append(mod.register_forward_hook(lambda *_a, _l=label: rec.sample(f"{_l}:exit")))
    for name, p in model.named_parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda _p, _l=name: rec.sample(f"{_l}:grad")))
    return handles


class GradReadiness:
    """Wraps this optimizer instance's ``partition_grads`` (profiling only) to time when each parameter's
    gradient is partitioned, i.e. final for the step."""

    def __init__(self, opt, cuda: bool):
        self.opt, self.cuda, self.marks, self.start = opt, cuda, {}, None
        self._orig = opt.partition_grads
        opt.partition_grads = self._wrapped

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self):
        self.marks, self.start = {}, self._now()

    def _wrapped(self, params_to_release, grad_partitions):
        out = self._orig(params_to_release, grad_partitions)
        if self.start is not None:
            now = self._now()
            for p in params_to_release:
                self.marks[p.ds_id] = now
        return out

    def restore(self):
        self.opt.partition_grads = self._orig

    def per_subgroup(self) -> list[Optional[float]]:
        def secs(m):
            return self.start.elapsed_time(m) / 1e3 if self.cuda else m - self.start

        out = []
        for group in self.opt.fp16_groups:
            ts = [secs(self.marks[p.ds_id]) for p in group if p.ds_id in self.marks]
            out.append(max(ts) if ts else None)
        return out


class PcieSampler(threading.Thread):
    def __init__(self, device: int, phase_of):
        super().__init__(daemon=True)
        self.phase_of, self.stop_flag, self.samples = phase_of, threading.Event(), []
        self.device = device

    def run(self):
        with identity.nvml() as nv:
            if nv is None:
                return
            try:
                h = identity.nvml_handle(nv, self.device)
                while not self.stop_flag.is_set():
                    tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)  # KB/s, 20 ms window
                    rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
                    self.samples.append((self.phase_of(), tx * 1e3 / 1e9, rx * 1e3 / 1e9))
                    time.sleep(0.02)
            except nv.NVMLError:
                return

    def summary(self) -> Optional[dict[str, PcieTraffic]]:
        out = {}
        for ph in ("fwd", "bwd", "step"):
            s = [(tx, rx) for p, tx, rx in self.samples if p == ph]
            if s:
                out[ph] = PcieTraffic(tx_gbps=round(sum(x for x, _ in s) / len(s), 3),
                                      rx_gbps=round(sum(y for _, y in s) / len(s), 3), samples=len(s))
        return out or None
