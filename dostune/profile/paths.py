"""Where profiles live.

Measured profiles: `dostune profile` writes them to ``profiles/`` in the current folder, and `dostune tune` looks for
them there, so the two commands meet without a path given.

Shipped profiles: measured node and model profiles that come with dostune, so that `dostune tune` has a GPU node to
tune for on a machine without one. In the repository they are the top-level ``profiles/`` folder; the wheel carries
them as package data (``dostune/profiles/``, pyproject.toml). An installed wheel finds them inside the package, a
checkout (run in place or installed editable, which imports the checkout's own package) beside it.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ProfileError

#: The node profile used when none is given on a machine without a GPU (measured on an H200 PCIe Gen5 node).
SHIPPED_NODE = "h200-pcie5.json"

#: The folder `dostune profile` writes to and `dostune tune` reads from by default, relative to the current folder.
MEASURED = Path("profiles")


def node_profile_path(name: str) -> Path:
    """The default file of the node profile named ``name``."""
    return MEASURED / f"{name}.json"


def measured_node_profile() -> Path:
    """This machine's node profile where `dostune profile` writes it by default (profiles/NODE.json, NODE the name it
    gives this node); a one-line error when it is not there."""
    from .identity import gpu_info, node_name

    name = node_name(gpu_info(0))
    path = node_profile_path(name)
    if not path.is_file():
        raise ProfileError(f"no --profile given, and no {path} here: `dostune profile` writes this node's profile "
                           "there",
                           hint="measure this node first with `dostune profile` (in this folder), or pass --profile "
                                "with the node profile to tune from")
    return path


def profiles_dir() -> Path:
    """The folder of the shipped profiles: $DOSTUNE_PROFILES, else the package's own (a wheel), else the checkout's
    top-level profiles/ beside the package."""
    env = os.environ.get("DOSTUNE_PROFILES")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]
    installed = package / "profiles"
    # a wheel carries the node profile there; a checkout has at most a stray folder (caches, a partial copy)
    return installed if (installed / SHIPPED_NODE).is_file() else package.parent / "profiles"


def shipped_profile(name: str = SHIPPED_NODE) -> Path:
    path = profiles_dir() / name
    if not path.exists():
        raise ProfileError(f"shipped profile {path} not found",
                           hint="pass --profile, or set DOSTUNE_PROFILES to a folder holding dostune's profiles")
    return path
