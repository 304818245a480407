"""A model's transformer blocks as ZeRO-3 leaf modules: DeepSpeed then fetches, releases and reduces each block's
parameters as one unit instead of submodule by submodule and parameter by parameter.

Why: ZeRO-3 hooks every submodule (a fetch before it runs, a release after) and every parameter (its gradient's
reduction), in Python on the thread that runs forward and backward. On one H100 those hooks, not the GPU, set the
pace of forward and backward for models of about 1B parameters, and their pace wanders with the host's
(docs/findings.md, finding 15). With each block a leaf (``deepspeed.utils.set_z3_leaf_modules``), gpt2_1_16b's
coordinator made 1,008-1,176 fetches per bench process instead of 7,920-8,360; dostune's iteration went from
0.415-0.438 s to 0.343-0.354 s on its tuned schedule and ZeRO-Offload's from 1.380-1.441 s to 1.251-1.323 s, with the
same peak GPU memory. The updates are the same (bit for bit on one rank, tests/test_leaf_blocks.py): a
block's gradients reach the same places of the same flat partitions, only together, in forward order, when its
backward ends; a model profile records when each subgroup's gradients are final as this engine makes them.

Every engine dostune builds flags its blocks (train/engine.py: bench's methods, the profiles, training and the gate
alike), so a profile measures the engine that training runs; ``dostune.initialize`` flags them before DeepSpeed hooks
the model. Engines built elsewhere (the Hugging Face Trainer, Accelerate's ``prepare``) run as profiled when
``mark_leaf_blocks(model)`` is called on the model first.
"""
from __future__ import annotations

from typing import Optional

from torch import nn


def block_class(model: nn.Module) -> Optional[type]:
    """The class of ``model``'s transformer blocks: that of the modules of its longest ``nn.ModuleList`` whose modules
    are all of one class and hold parameters (a decoder's layers); None where it has no such list."""
    best: Optional[nn.ModuleList] = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1 \
                and next(m[0].parameters(), None) is not None and (best is None or len(m) > len(best)):
            best = m
    return type(best[0]) if best is not None else None


def mark_leaf_blocks(model: nn.Module) -> Optional[type]:
    """Flag ``model``'s transformer blocks (``block_class``) as ZeRO-3 leaf modules, before DeepSpeed builds its
    engine around the model. A model with leaf modules flagged already is left as its author flagged it. Returns the
    flagged class, or None where nothing was flagged."""
    from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules

    cls = block_class(model)
    if cls is None or get_z3_leaf_modules(model):
        return None
    set_z3_leaf_modules(model, [cls])
    return cls
