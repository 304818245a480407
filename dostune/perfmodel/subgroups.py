"""ZeRO-3 subgroup sizes for any sub_group_size, reproduced from the model's parameter sizes the way
DeepSpeed 0.19.8 forms them (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``): walk the
trainable parameters in order, each contributing its partition (ceil(numel / world)), and close a subgroup
once it holds at least sub_group_size elements (or at the last parameter)."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import DostuneError
from ..models.registry import ModelSpec


def subgroup_sizes(param_numels: Sequence[int], sub_group_size: int, world_size: int = 1) -> list[int]:
    if sub_group_size < 1:
        raise ValueError("sub_group_size must be positive")
    parts = [math.ceil(n / world_size) for n in param_numels]
    total = sum(parts)
    if sub_group_size >= total:
        return [total] if parts else []
    sizes, acc = [], 0
    for k, n in enumerate(parts):
        acc += n
        if acc >= sub_group_size or k == len(parts) - 1:
            sizes.append(acc)
            acc = 0
    return sizes


def param_numels(spec: ModelSpec) -> list[int]:
    """Trainable parameter sizes in module order, from a build on the meta device (no memory, no init)."""
    try:
        with torch.device("meta"):
            model = spec.build()
    except Exception as e:  # a user factory that cannot build on meta
        raise DostuneError(f"cannot build {spec.name} on the meta device to size its subgroups ({e})") from None
    return [p.numel() for p in model.parameters() if p.requires_grad]
