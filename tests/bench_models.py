"""Models for bench tests, as `--model bench_models:FACTORY` (tests/ is on sys.path under pytest, and the bench's
method processes inherit it)."""
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
KILL_ONCE = "DOSTUNE_TEST_KILL_ONCE"  # a file: the first batch asked for while it exists removes it and dies


class TinyLM(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.out = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        return F.cross_entropy(self.out(x + self.mlp(x)).float().flatten(0, 1), labels.flatten())


def _batch(micro_batch, seq, generator, device):
    tokens = torch.randint(0, VOCAB, (micro_batch, seq + 1), generator=generator)
    return {"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)}


def factory():
    return TinyLM(), _batch


def dies_once():
    """Like factory(), but the process that asks for a batch while the KILL_ONCE file exists is SIGKILLed, as
    the out-of-memory killer would end it."""

    def batch(micro_batch, seq, generator, device):
        marker = os.environ.get(KILL_ONCE)
        if marker and os.path.exists(marker):
            os.unlink(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        return _batch(micro_batch, seq, generator, device)

    return TinyLM(), batch
