"""One rank of a data-parallel world, as the performance model sees it (docs/multi-gpu.md).

Under DeepSpeed's launcher every rank runs the same ZeRO-3 step on its own partition (ceil(numel / world) elements
of each parameter, perfmodel/subgroups.py), and the ranks of one node run it at the same moment: the collectives
at the step's start (the gradient norm) line them up. So the model predicts one rank, on what its node leaves it
while every other rank of that node does the same work:

- CPU cores: each rank gets ``logical cores // ranks per node`` threads for CPU Adam.
- Host DRAM bandwidth: CPU Adam, the unscale and the CPU conversion are memory-bound loops. A rank runs no faster
  than it did alone at its thread count, nor faster than its share of the node: the rate the profile measured with
  that many processes at once (``cpu_adam.concurrent``), else the best single-process rate divided by the ranks
  (one process with every core is what the node's memory can feed).
- PCIe: GPUs copy at once. The rates the profile measured with that many GPUs copying together
  (``multi_gpu.copies``, the slowest GPU's) when it has them; else each GPU's own rates divided by how many of the
  node's ranks sit behind the same PCIe switch (``multi_gpu.common_ancestor``; 1 without a recorded topology).
- DMA slowing the CPU: the profile measured CPU Adam's slowdown under a node-wide DMA traffic; every rank makes
  the traffic its schedule makes, so one rank reaches that slowdown at 1/ranks of it.
- Pinned host memory: every rank pins its own states, shadows and staging; ranks per node times one rank's pinned
  memory must fit the node's memory (``host_memory_gib``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import ConfigError, DostuneError
from ..profile.record import NodeProfile
from .inputs import Cost, NodeInputs

#: Top-level key of an emitted DeepSpeed config that names the world it was tuned for. DeepSpeed ignores top-level
#: keys it does not know; the ``dostune`` section itself is the optimizer's schedule and admits no other keys.
WORLD_KEY = "dostune_world"

# NVML's common-ancestor levels (nvmlDeviceGetTopologyCommonAncestor) as the profile records them, nearest first.
# Two GPUs behind the same PCIe switch (one switch, or a tree of them) share that switch's uplink to the host.
TOPOLOGY_LEVELS = ("same_board", "switch", "switches", "host_bridge", "numa_node", "system")
SHARED_LINK_LEVELS = ("same_board", "switch", "switches")


@dataclass(frozen=True)
class World:
    """``nodes`` hosts with ``gpus_per_node`` ranks (one per GPU) each."""

    nodes: int = 1
    gpus_per_node: int = 1

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise DostuneError(f"a world needs at least 1 node and 1 GPU per node, got {self.nodes} node(s) x "
                               f"{self.gpus_per_node} GPU(s)")

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        gpus = f"{self.gpus_per_node} GPU{'s' if self.gpus_per_node > 1 else ''}"
        return f"{nodes} x {gpus} ({self.size} rank{'s' if self.size > 1 else ''})"

    def tune_flags(self) -> str:
        return f"--num-gpus {self.gpus_per_node} --nodes {self.nodes}"

    def as_config(self) -> dict:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node}

    @classmethod
    def of_run(cls, env: Optional[Mapping[str, str]] = None) -> "World":
        """The world this process runs in, from what the launcher set: WORLD_SIZE and the ranks of this node
        (DeepSpeed's launcher: LOCAL_SIZE; torchrun: LOCAL_WORLD_SIZE). Without them, a world of one."""
        env = os.environ if env is None else env
        try:
            size = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or size)
        except ValueError:
            raise DostuneError(f"WORLD_SIZE / LOCAL_SIZE are not numbers: {env.get('WORLD_SIZE')!r}, "
                               f"{env.get('LOCAL_SIZE') or env.get('LOCAL_WORLD_SIZE')!r}") from None
        if size < 1 or local < 1 or size % local:
            raise DostuneError(f"the launcher's world is inconsistent: WORLD_SIZE {size} with {local} rank(s) on "
                               "this node")
        return cls(nodes=size // local, gpus_per_node=local)

    @classmethod
    def from_config(cls, ds_config: dict, source: str = "the DeepSpeed config") -> Optional["World"]:
        """The world a config was tuned for (None when it does not say)."""
        section = ds_config.get(WORLD_KEY)
        if section is None:
            return None
        ok = isinstance(section, dict) and set(section) == {"nodes", "gpus_per_node"} and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in section.values())
        if not ok:
            raise ConfigError(f"{source}: '{WORLD_KEY}' must be {{\"nodes\": M, \"gpus_per_node\": N}} with M, N >= 1, "
                              f"got {section!r}")
        return cls(nodes=section["nodes"], gpus_per_node=section["gpus_per_node"])


def gather_ranks(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` outside a world of several."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank() -> int:
    """This process's rank (0 outside the launcher)."""
    return int(os.environ.get("RANK", "0"))


def check_world(ds_config: dict, source: str, model: str, run: Optional[World] = None) -> Optional[World]:
    """Refuse, before the engine is built, a config tuned for another world than the one it runs in: its subgroups
    are another partition's and its threads another share of the node. Returns the config's world (None when it
    does not say which)."""
    run = World.of_run() if run is None else run
    tuned = World.from_config(ds_config, source)
    if tuned is not None and tuned != run:
        raise ConfigError(f"{source} was tuned for {tuned.describe()} but runs on {run.describe()}",
                          hint=f"re-tune for this world: dostune tune --model {model} {run.tune_flags()} "
                               "(with that world's profiles)")
    return tuned


def check_local_gpus(run: Optional[World] = None, env: Optional[Mapping[str, str]] = None,
                     device_count: Optional[int] = None) -> None:
    """Refuse a rank whose GPU does not exist (the launcher was told more GPUs per node than this node has).
    Checkable only where CUDA sees GPUs; ``device_count`` None: ask torch."""
    env = os.environ if env is None else env
    run = World.of_run(env) if run is None else run
    if device_count is None:
        import torch

        if not torch.cuda.is_available():
            return
        device_count = torch.cuda.device_count()
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if local_rank >= device_count or run.gpus_per_node > device_count:
        raise DostuneError(f"{run.gpus_per_node} ranks were launched on this node but it has {device_count} GPU(s)",
                           hint=f"launch with --num_gpus {device_count} or fewer (and tune for that world)")


def read_hostfile(text: str, path: str = "the hostfile") -> list[tuple[str, int]]:
    """(host, slots) of each line of an MPI-style hostfile (``worker-0 slots=4``), as DeepSpeed's launcher reads it."""
    hosts = []
    for k, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+slots=(\d+)\s*$", line)
        if m is None:
            raise DostuneError(f"{path} line {k}: expected 'HOST slots=N', got {line!r}")
        if any(h == m.group(1) for h, _ in hosts):
            raise DostuneError(f"{path} names {m.group(1)} twice")
        hosts.append((m.group(1), int(m.group(2))))
    if not hosts:
        raise DostuneError(f"{path} names no host")
    return hosts


def world_of_hostfile(text: str, path: str = "the hostfile", resolve=None) -> World:
    """The world a hostfile describes: every host with the same number of slots (one rank per GPU), every host
    name known to this machine's resolver (a name it cannot resolve is a node the launcher cannot reach either)."""
    import socket

    resolve = resolve or socket.getaddrinfo
    hosts = read_hostfile(text, path)
    for host, _ in hosts:
        try:
            resolve(host, None)
        except (socket.gaierror, UnicodeError):
            raise DostuneError(f"{path} names node '{host}', which does not resolve from here",
                               hint="fix the name or remove the line; every node must be reachable under its name")
    slots = {s for _, s in hosts}
    if len(slots) != 1 or 0 in slots:
        raise DostuneError(f"{path}: every node needs the same number of GPUs (slots) for one tuned config, got "
                           + ", ".join(f"{h} {s}" for h, s in hosts))
    return World(nodes=len(hosts), gpus_per_node=slots.pop())


def shared_link_group(profile: NodeProfile, ranks: int) -> int:
    """How many of the node's first ``ranks`` GPUs (the launcher's [0:N)) share a PCIe switch with the GPU that
    shares with the most: the divisor of that GPU's copy rates. 1 when the profile records no topology."""
    mg = profile.multi_gpu
    if mg is None or not mg.common_ancestor:
        return 1
    n = min(ranks, len(mg.common_ancestor))
    return max(sum(1 for j in range(n) if j == i or mg.common_ancestor[i][j] in SHARED_LINK_LEVELS)
               for i in range(n))


def _scaled(c: Cost, share: float) -> Cost:
    return Cost(overhead_s=c.overhead_s, rate=c.rate / share)


def _capped(c: Cost, rate: float) -> Cost:
    return Cost(overhead_s=c.overhead_s, rate=min(c.rate, rate))


def rank_inputs(profile: NodeProfile, world: World,
                details: Optional[list[str]] = None) -> tuple[NodeInputs, list[str]]:
    """The node profile's inputs for one rank of ``world`` (see the module's docstring), and notes that say which
    figures were derived because the profile did not measure them; ``details``, if given, gets a line for each figure
    that was measured with the node's GPUs or processes together."""
    node = NodeInputs.from_profile(profile)
    n = world.gpus_per_node
    if n == 1:
        return node, []
    notes, details = [], details if details is not None else []
    cores = max(1, profile.host.logical_cores // n)
    # CPU Adam: this rank's threads, at most its share of what the node's memory feeds
    concurrent = profile.cpu_adam.concurrent.get(n)
    if concurrent is not None:
        share = concurrent.fit.rate_per_s
        details.append(f"CPU Adam: {n} processes at once measured at {share / 1e9:.2f} G elem/s each")
    else:
        share = node.cpu_adam[node.best_threads].rate / n
        notes.append(f"CPU Adam: the node profile did not measure {n} processes at once; each rank is given 1/{n} of "
                     f"the node's best rate ({share / 1e9:.2f} G elem/s), a derivation: profile the node with this "
                     "dostune to measure it")
    threads = {t: _capped(c, share) for t, c in node.cpu_adam.items() if t <= cores} or \
        {min(node.cpu_adam): _capped(node.cpu_adam[min(node.cpu_adam)], share)}
    best = max(threads, key=lambda t: threads[t].rate)
    # the other memory-bound host loops (measured alone) slow down as much as CPU Adam's best rate does
    mem_share = max(1.0, node.cpu_adam[node.best_threads].rate / share)
    # PCIe
    mg = profile.multi_gpu
    if mg is not None and len(mg.gpus) == n:
        c = mg.copies
        h2d, d2h = Cost.of(c.h2d.fit), Cost.of(c.d2h.fit)
        h2d_duplex, d2h_duplex = Cost.of(c.duplex_h2d.fit), Cost.of(c.duplex_d2h.fit)
        pageable_share = max(1.0, node.h2d.rate / h2d.rate)  # pageable copies slowed as much as pinned ones
        details.append(f"PCIe: copy rates measured with {n} GPUs copying at once (the slowest GPU's)")
    else:
        link = shared_link_group(profile, n)
        h2d, d2h = _scaled(node.h2d, link), _scaled(node.d2h, link)
        h2d_duplex, d2h_duplex = _scaled(node.h2d_duplex, link), _scaled(node.d2h_duplex, link)
        pageable_share = link
        if mg is None:
            notes.append(f"PCIe: the node profile measured one GPU; each of the {n} GPUs is taken to have a link of "
                         f"its own: profile the node with {n} GPUs visible to measure them copying together")
        elif link > 1:
            notes.append(f"PCIe: {link} of the {n} GPUs share a PCIe switch: each gets 1/{link} of its link's rates, "
                         f"a derivation: profile the node with {n} GPUs visible to measure them copying together")
    return node.model_copy(update=dict(
        cpu_adam=threads, best_threads=best,
        default_threads=min(threads, key=lambda t: abs(t - cores)),
        unscale_cpu=_scaled(node.unscale_cpu, mem_share), convert_cpu=_scaled(node.convert_cpu, mem_share),
        h2d=h2d, d2h=d2h, h2d_duplex=h2d_duplex, d2h_duplex=d2h_duplex,
        h2d_pageable=_scaled(node.h2d_pageable, pageable_share),
        d2h_pageable=_scaled(node.d2h_pageable, pageable_share),
        ds_upload=_scaled(node.ds_upload, pageable_share) if node.ds_upload is not None else None,
        contention_gbps=node.contention_gbps / n)), notes


def host_memory_gib(profile: NodeProfile) -> float:
    """Host memory the ranks of one node may pin together: what was available when the node was profiled (the
    node's total in profiles that did not record it)."""
    return profile.host.available_gib if profile.host.available_gib is not None else profile.host.ram_gib


def node_pinned_gib(rank_pinned_gib: float, world: World) -> float:
    return rank_pinned_gib * world.gpus_per_node
