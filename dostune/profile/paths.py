"""Where shipped profiles live."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ProfileError

#: The node profile used when none is given on a machine without a GPU (measured on the lent H100).
SHIPPED_NODE = "h100-pcie5.json"


def profiles_dir() -> Path:
    """The repository's profiles/ folder (an editable install or a checkout), or $DOSTUNE_PROFILES."""
    env = os.environ.get("DOSTUNE_PROFILES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "profiles"


def shipped_profile(name: str = SHIPPED_NODE) -> Path:
    path = profiles_dir() / name
    if not path.exists():
        raise ProfileError(f"shipped profile {path} not found; pass --profile or set DOSTUNE_PROFILES "
                           "to the folder holding dostune's profiles/")
    return path
