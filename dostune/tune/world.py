"""The world `dostune tune` tunes for, and the profiles that belong to it (docs/multi-gpu.md).

The tuner predicts one rank of ``--nodes M`` nodes with ``--num-gpus N`` GPUs each (or of the world a DeepSpeed
hostfile describes). Its node inputs are that rank's share of the node (perfmodel/world.py); its model inputs must
come from a model profile measured in the same world under DeepSpeed's launcher, since ZeRO-3's partition and
collectives change forward, backward and memory per rank.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..errors import DostuneError, ProfileError
from ..optim.footprint import HOST_BASE_BYTES, HOST_USABLE_SHARE
from ..perfmodel.world import World, host_memory_gib, world_of_hostfile
from ..profile.model_record import ModelProfile
from ..profile.record import NodeProfile


def resolve_world(num_gpus: Optional[int], nodes: Optional[int], hostfile: Optional[Path]) -> World:
    """--num-gpus and --nodes (default 1 each), or the world of --hostfile (which they must agree with)."""
    if hostfile is None:
        return World(nodes=nodes or 1, gpus_per_node=num_gpus or 1)
    path = Path(hostfile)
    what = "check the path: DeepSpeed's hostfile is text, one 'HOST slots=N' line per node"
    if not path.is_file():
        problem = "does not exist" if not path.exists() else "is not a file"
        raise DostuneError(f"--hostfile {path} {problem}", hint=what)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DostuneError(f"--hostfile {path} is not a text file (it holds binary data)", hint=what) from None
    except OSError as e:
        raise DostuneError(f"cannot read --hostfile {path}: {e.strerror or e}", hint="check the file's permissions") \
            from None
    world = world_of_hostfile(text, str(path))
    for flag, given, found in (("--num-gpus", num_gpus, world.gpus_per_node), ("--nodes", nodes, world.nodes)):
        if given is not None and given != found:
            raise DostuneError(f"{flag} {given} disagrees with --hostfile {path}, which gives {found}",
                               hint="leave the flag out: the hostfile says how many")
    return world


def find_model_profile(node: NodeProfile, node_path: Path, model: str, micro_batch: Optional[int],
                       seq: Optional[int], world: World, notes: list[str], details: list[str]) -> Optional[Path]:
    """profiles/<node>-<model>-b<B>-s<S>[-MxN].json beside the node profile, the names `dostune profile --model`
    gives (-MxN: measured under the launcher on M nodes of N GPUs), for this world; None without one. ``notes`` get
    a line when a profile of another world is passed over, ``details`` the path of the one found."""
    pattern = re.compile(rf"^{re.escape(node.name)}-{re.escape(model)}-b(\d+)-s(\d+)(?:-(\d+)x(\d+))?\.json$")
    found = [(c, pattern.match(c.name)) for c in sorted(node_path.parent.glob(f"{node.name}-*.json"))]
    found = [(c, m) for c, m in found if m is not None and (micro_batch is None or int(m.group(1)) == micro_batch)
             and (seq is None or int(m.group(2)) == seq)]
    here = [c for c, m in found if World(int(m.group(3) or 1), int(m.group(4) or 1)) == world]
    if here:
        details.append(f"model profile: {here[0]}")
        return here[0]
    if found:
        notes.append(f"{found[0][0]} was measured in another world than {world.describe()}: not used (forward, "
                     "backward and memory per rank depend on the world); profile the model under the launcher in "
                     "this world and pass --model-profile (docs/multi-gpu.md)")
    return None


def check_model_profile_world(model_p: ModelProfile, model_path: Path, world: World, node_name: str) -> None:
    measured = World(model_p.world.nodes, model_p.world.gpus_per_node)
    if measured != world:
        raise ProfileError(f"{model_path} was measured on {measured.describe()}, the tune is for {world.describe()}: "
                           "ZeRO-3's partition and collectives per rank differ",
                           hint=f"profile the model in that world: deepspeed --num_gpus {world.gpus_per_node} --module "
                                f"dostune.profile --model {model_p.model} --name {node_name}"
                                + (" (and a hostfile naming the nodes)" if world.nodes > 1 else ""))


def check_node_gpus(node: NodeProfile, node_path: Path, world: World) -> None:
    """A node profile that counted the node's GPUs (schema 2) bounds --num-gpus."""
    gpus = node.host.gpus
    if gpus and world.gpus_per_node > gpus:
        raise ProfileError(f"--num-gpus {world.gpus_per_node} is more than the {gpus} GPU(s) of the profiled node "
                           f"'{node.name}' ({node_path})",
                           hint="tune for at most that many GPUs per node, or profile a node that has them")


def host_budget(text: str, node: NodeProfile, ranks: int = 1) -> float:
    """--host-memory-budget: GiB, or 'auto': what the node profile found available, less what the optimizer leaves
    free at start-up (footprint.HOST_USABLE_SHARE) and each of the node's ``ranks`` processes' own (HOST_BASE_BYTES).
    Taking it whole, the tuner picked a llama 4.5B schedule that pinned 125.0 of 125.0 GiB, which the optimizer then
    refused at start-up (82.9 GiB more needed, 81.2 available)."""
    if text == "auto":
        return HOST_USABLE_SHARE * host_memory_gib(node) - ranks * HOST_BASE_BYTES / 2**30
    try:
        value = float(text)
    except ValueError:
        raise DostuneError(f"--host-memory-budget must be 'auto' or a number of GiB, got {text!r}") from None
    if not value > 0:
        raise DostuneError(f"--host-memory-budget must be positive, got {value}")
    return value
