"""Helpers of tests/test_multi_*.py: a model whose parameter sizes do not divide by the world, and the per-rank
script of the multi-node test.

Run as a script (by DeepSpeed's launcher, once per rank): train CONFIG's model with the config as it is (dostune's
optimizer), then with plain DeepSpeed ZeRO-3 offload, in the same process, and write each run's per-step losses to
OUT.rank<RANK>.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn


class OddLM(nn.Module):
    """Every parameter has an odd number of elements, so ZeRO-3 pads each partition on 2 ranks."""

    def __init__(self, vocab: int = 257, hidden: int = 33, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return F.cross_entropy(self.out(x).float().flatten(0, 1), labels.flatten())


def odd_factory():
    def batch(micro_batch: int, seq: int, generator: torch.Generator, device) -> dict:
        tokens = torch.randint(0, 257, (micro_batch, seq + 1), generator=generator)
        return {"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)}

    return OddLM(), batch


def _train_both(config: str, model: str, steps: int, seq: int, out: str) -> None:
    from pathlib import Path

    from dostune.train.loop import TrainOptions, train

    losses = {}
    for plain in (False, True):
        summary = train(TrainOptions(config=Path(config), model=model, steps=steps, seq=seq, metrics=None,
                                     plain_deepspeed=plain))
        losses["plain" if plain else "dostune"] = summary.losses
        losses["optimizer" + ("_plain" if plain else "")] = summary.optimizer
    Path(f"{out}.rank{os.environ['RANK']}.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    _train_both(args[0], args[1], int(args[2]), int(args[3]), args[4])
