"""Bring your own model to dostune: a factory returning (module, batch_fn).

    dostune profile --model examples.custom_model:factory --micro-batch 4 --seq 128
    dostune bench   --model examples.custom_model:factory --micro-batch 4 --seq 128

(run from the repository root, or put this file's folder on PYTHONPATH). ``model(**batch)`` must return a
scalar loss, or an object with a ``.loss`` (Hugging Face style). Build parameters in constructors only, so
the model can be built under ``deepspeed.zero.Init`` and partitioned as it is built.
"""
import torch
import torch.nn.functional as F
from torch import nn


class TinyMLPLM(nn.Module):
    def __init__(self, vocab: int = 1000, hidden: int = 256, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                                  nn.Linear(4 * hidden, hidden)) for _ in range(layers))
        self.out = nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return F.cross_entropy(self.out(x).float().flatten(0, 1), labels.flatten())


def factory():
    vocab = 1000

    def batch(micro_batch: int, seq: int, generator: torch.Generator, device) -> dict:
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=generator)
        return {"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)}

    return TinyMLPLM(vocab), batch
