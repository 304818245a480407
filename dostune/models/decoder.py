"""GPT-2- and LLaMA-style decoder-only transformers on plain torch, with random weights.

Everything is initialised inside constructors (no post-hoc ``model.apply``), so the models can be built
under ``deepspeed.zero.Init``, which partitions each module's parameters as soon as its constructor
returns: a 13B model never materialises whole on one device.

``gradient_checkpointing_enable()`` (the name Hugging Face models use, so every model kind is switched the
same way) recomputes each block's forward in backward instead of keeping its activations, through
``torch.utils.checkpoint`` without reentrancy: the recompute runs inside the same backward graph task, so
ZeRO-3's module hooks gather the block's parameters again for it.

The GPT-2 LM head is tied to the token embedding. Rather than touching the embedding's weight from the
top-level forward (ZeRO-3 would then not have gathered it), the embedding module itself computes the
logits when called with ``project=True``, so ZeRO-3's per-module hooks gather it both times.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

INIT_STD = 0.02


@dataclass(frozen=True)
class DecoderConfig:
    family: str  # "gpt2" or "llama"
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_positions: int
    ffn: Optional[int] = None  # llama: gated MLP width; gpt2: 4*hidden
    kv_heads: Optional[int] = None  # llama grouped-query attention; default = heads

    def __post_init__(self):
        if self.family not in ("gpt2", "llama"):
            raise ValueError(f"family must be gpt2 or llama, got {self.family!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    def as_dict(self) -> dict:
        return asdict(self)


def count_parameters(cfg: DecoderConfig) -> int:
    """Analytic parameter count, to check the built modules against."""
    h, L, V = cfg.hidden, cfg.layers, cfg.vocab
    if cfg.family == "gpt2":
        per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h)
        return V * h + cfg.max_positions * h + L * per_layer + 2 * h  # tied head
    kv = (cfg.kv_heads or cfg.heads) * (h // cfg.heads)
    per_layer = h + (h * h + 2 * h * kv + h * h) + h + 3 * h * cfg.ffn_width
    return V * h + L * per_layer + h + V * h  # untied head


class _Linear(nn.Linear):
    """nn.Linear with GPT-style N(0, 0.02) weights and zero bias, set in the constructor."""

    def __init__(self, fan_in: int, fan_out: int, bias: bool, std: float = INIT_STD):
        self._std = std
        super().__init__(fan_in, fan_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self._std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class TokenEmbedding(nn.Module):
    """Embedding that can also project hidden states back onto the vocabulary (the tied LM head)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))
        nn.init.normal_(self.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor, project: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if project else F.embedding(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h = cfg.hidden
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads or cfg.heads
        self.head_dim = h // cfg.heads
        self.rope = cfg.family == "llama"
        bias = cfg.family == "gpt2"
        kv = self.kv_heads * self.head_dim
        self.qkv = _Linear(h, h + 2 * kv, bias=bias)
        # GPT-2 scales residual projections by 1/sqrt(2*layers) at init.
        self.proj = _Linear(h, h, bias=bias, std=INIT_STD / math.sqrt(2 * cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = _rope(q), _rope(k)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, f = cfg.hidden, cfg.ffn_width
        self.gated = cfg.family == "llama"
        bias = not self.gated
        self.up = _Linear(h, 2 * f if self.gated else f, bias=bias)
        self.down = _Linear(f, h, bias=bias, std=INIT_STD / math.sqrt(2 * cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        norm = (lambda: nn.LayerNorm(cfg.hidden)) if cfg.family == "gpt2" else (lambda: RMSNorm(cfg.hidden))
        self.norm1, self.attn, self.norm2, self.mlp = norm(), Attention(cfg), norm(), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderLM(nn.Module):
    """forward(input_ids, labels) -> mean next-token cross-entropy loss."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.embed = TokenEmbedding(cfg.vocab, cfg.hidden)
        if cfg.family == "gpt2":
            self.pos = nn.Parameter(torch.empty(cfg.max_positions, cfg.hidden))
            nn.init.normal_(self.pos, std=0.01)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden) if cfg.family == "gpt2" else RMSNorm(cfg.hidden)
        self.head = None if cfg.family == "gpt2" else _Linear(cfg.hidden, cfg.vocab, bias=False)
        self.checkpoint_kwargs: Optional[dict] = None  # None: keep every block's activations

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[dict] = None) -> None:
        """Checkpoint every block: ``gradient_checkpointing_kwargs`` go to torch.utils.checkpoint.checkpoint
        (non-reentrant unless they say otherwise)."""
        self.checkpoint_kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}

    def gradient_checkpointing_disable(self) -> None:
        self.checkpoint_kwargs = None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        if s > self.config.max_positions:
            raise ValueError(f"sequence length {s} exceeds the model's {self.config.max_positions} positions")
        x = self.embed(input_ids)
        if self.head is None:
            x = x + self.pos[:s]
        # without autograd there is nothing to recompute: run the blocks plainly
        ckpt = self.checkpoint_kwargs is not None and torch.is_grad_enabled()
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, **self.checkpoint_kwargs) if ckpt else block(x)
        x = self.norm(x)
        logits = self.embed(x, project=True) if self.head is None else self.head(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_batch(micro_batch: int, seq: int, vocab: int, generator: torch.Generator,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random tokens; labels are the inputs shifted by one."""
    tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=generator)
    return {"input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)}
