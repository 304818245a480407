"""Where the shipped profiles live: package data (dostune/profiles/), so an installed wheel has them too."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ProfileError

#: The node profile used when none is given on a machine without a GPU (measured on an H100 PCIe Gen5 node).
SHIPPED_NODE = "h100-pcie5.json"


def profiles_dir() -> Path:
    """dostune's own profiles/ folder, installed with the package, or $DOSTUNE_PROFILES."""
    env = os.environ.get("DOSTUNE_PROFILES")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "profiles"


def shipped_profile(name: str = SHIPPED_NODE) -> Path:
    path = profiles_dir() / name
    if not path.exists():
        raise ProfileError(f"shipped profile {path} not found",
                           hint="pass --profile, or set DOSTUNE_PROFILES to a folder holding dostune's profiles")
    return path
