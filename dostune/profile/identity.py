"""Who the machine is: host, GPU and PCIe link (through NVML)."""
from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Iterator, Optional

import torch

from .record import GpuInfo, HostInfo, PcieLink

# Per-lane payload bandwidth in GB/s (1e9 bytes/s) per direction, after line encoding:
# Gen1/2 use 8b/10b, Gen3-5 128b/130b, Gen6 PAM4 with 242/256 FLIT efficiency.
_PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.9846, 4: 1.9692, 5: 3.9385, 6: 7.5625}


def pcie_theoretical_gbps(generation: int, width: int) -> float:
    return round(_PCIE_LANE_GBPS.get(generation, 0.0) * width, 2)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))


def _ram_gib() -> float:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # psutil comes with DeepSpeed; stay useful without it
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def _available_gib() -> Optional[float]:
    try:
        import psutil

        return round(psutil.virtual_memory().available / 2**30, 1)
    except ImportError:
        return None


def _physical_cores() -> Optional[int]:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except ImportError:
        return None


def deepspeed_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:
        return None


def host_info() -> HostInfo:
    return HostInfo(
        cpu_model=_cpu_model(),
        logical_cores=os.cpu_count() or 1,
        physical_cores=_physical_cores(),
        numa_nodes=_numa_nodes(),
        ram_gib=_ram_gib(),
        os=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        deepspeed=deepspeed_version(),
        cuda_runtime=torch.version.cuda,
        available_gib=_available_gib(),
        gpus=torch.cuda.device_count() if cuda_available() else 0,
    )


def node_name(gpu: Optional[GpuInfo]) -> str:
    """The name a node's profiles take when none is given: the GPU's short name and PCIe generation (h100-pcie5), or
    cpu-<cores>c on a machine without a GPU. The node profile, the model profiles measured on the node and the default
    node profile `dostune tune` looks for all take it."""
    if gpu is None:
        return f"cpu-{os.cpu_count()}c"
    short = gpu.name.replace("NVIDIA ", "").split()[0].lower()
    if gpu.pcie is not None:
        return f"{short}-pcie{gpu.pcie.max_generation}"
    return short


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@contextlib.contextmanager
def nvml() -> Iterator[Optional[object]]:
    """Yield the pynvml module initialised, or None when NVML is missing (no GPU driver)."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound on machines without a driver
        yield None
        return
    try:
        yield pynvml
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def nvml_handle(nv, device_index: int):
    """NVML handle for a torch device index. Matches by PCI bus id, since CUDA_VISIBLE_DEVICES can
    renumber devices for torch but not for NVML."""
    props = torch.cuda.get_device_properties(device_index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        dom = getattr(props, "pci_domain_id", 0)
        dev = getattr(props, "pci_device_id", 0)
        with contextlib.suppress(nv.NVMLError):
            return nv.nvmlDeviceGetHandleByPciBusId(f"{dom:08x}:{bus:02x}:{dev:02x}.0".encode())
    return nv.nvmlDeviceGetHandleByIndex(device_index)


def _pcie_link(nv, handle) -> Optional[PcieLink]:
    try:
        cg = nv.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        mg = nv.nvmlDeviceGetMaxPcieLinkGeneration(handle)
        cw = nv.nvmlDeviceGetCurrPcieLinkWidth(handle)
        mw = nv.nvmlDeviceGetMaxPcieLinkWidth(handle)
    except nv.NVMLError:
        return None
    return PcieLink(current_generation=cg, max_generation=mg, current_width=cw, max_width=mw,
                    theoretical_gbps_current=pcie_theoretical_gbps(cg, cw),
                    theoretical_gbps_max=pcie_theoretical_gbps(mg, mw))


def gpu_info(device_index: int = 0) -> Optional[GpuInfo]:
    if not cuda_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    driver, pcie = None, None
    with nvml() as nv:
        if nv is not None:
            with contextlib.suppress(nv.NVMLError):
                d = nv.nvmlSystemGetDriverVersion()
                driver = d.decode() if isinstance(d, bytes) else d
            with contextlib.suppress(nv.NVMLError):
                pcie = _pcie_link(nv, nvml_handle(nv, device_index))
    return GpuInfo(index=device_index, name=props.name, memory_gib=round(props.total_memory / 2**30, 2),
                   compute_capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                   driver=driver, pcie=pcie)


# NVML's nvmlGpuTopologyLevel_t, by the names perfmodel/world.py TOPOLOGY_LEVELS gives them
_TOPOLOGY_NAMES = {"NVML_TOPOLOGY_INTERNAL": "same_board", "NVML_TOPOLOGY_SINGLE": "switch",
                   "NVML_TOPOLOGY_MULTIPLE": "switches", "NVML_TOPOLOGY_HOSTBRIDGE": "host_bridge",
                   "NVML_TOPOLOGY_NODE": "numa_node", "NVML_TOPOLOGY_SYSTEM": "system"}


def _numa_node(nv, handle) -> Optional[int]:
    """The host NUMA node a GPU hangs off: NVML's answer, else the kernel's for its PCI device."""
    with contextlib.suppress(nv.NVMLError, AttributeError):
        return int(nv.nvmlDeviceGetNumaNodeId(handle))
    with contextlib.suppress(nv.NVMLError, OSError, ValueError, AttributeError):
        bus = nv.nvmlDeviceGetPciInfo(handle).busId
        bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()
        node = int(Path(f"/sys/bus/pci/devices/{bus[-12:]}/numa_node").read_text())
        return node if node >= 0 else None
    return None


def gpu_topology(devices: list[int], nv=None) -> tuple[list[Optional[int]], list[list[Optional[str]]]]:
    """For each GPU its host NUMA node, and for each pair their nearest common ancestor in the PCIe tree ("self" on
    the diagonal; None where NVML cannot say, or on a machine without NVML). ``nv``: an initialised pynvml (tests
    pass a stand-in); None: open NVML here."""
    if nv is None:
        with nvml() as opened:
            if opened is None:
                n = len(devices)
                return [None] * n, [["self" if i == j else None for j in range(n)] for i in range(n)]
            return gpu_topology(devices, opened)
    names = {getattr(nv, k): v for k, v in _TOPOLOGY_NAMES.items() if hasattr(nv, k)}
    handles = [nvml_handle(nv, d) for d in devices]
    matrix: list[list[Optional[str]]] = []
    for i, a in enumerate(handles):
        row: list[Optional[str]] = []
        for j, b in enumerate(handles):
            level = None
            if i == j:
                level = "self"
            else:
                with contextlib.suppress(nv.NVMLError):
                    level = names.get(nv.nvmlDeviceGetTopologyCommonAncestor(a, b))
            row.append(level)
        matrix.append(row)
    return [_numa_node(nv, h) for h in handles], matrix


def no_gpu_reason() -> str:
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build"
        return "torch sees no CUDA device"
    return "no CUDA device"
