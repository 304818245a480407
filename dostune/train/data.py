"""Training data: a seeded synthetic token stream, or a local text corpus tokenised on the fly.

Every micro-batch is a pure function of (seed, global micro-step, data-parallel rank), so a run resumed
from a checkpoint sees exactly the batches the uninterrupted run would have seen, without saving a data
loader's state.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Protocol

import torch

from ..errors import DostuneError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".tex"}


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255): no vocabulary file, works for any model with a vocabulary >= 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizersFile:
    """A ``tokenizers`` JSON file (optional dependency)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise DostuneError("--tokenizer needs the 'tokenizers' package (pip install tokenizers)") from None
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:
            raise DostuneError(f"--tokenizer {path}: not a tokenizers JSON file ({e})") from None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids


def _batch_generator(seed: int, micro_step: int, rank: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{micro_step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class SyntheticData:
    def __init__(self, batch_fn, seed: int):
        self.batch_fn, self.seed = batch_fn, seed
        self.description = f"synthetic tokens (seed {seed})"

    def batch(self, micro_step: int, micro_batch: int, seq: int, device, rank: int = 0) -> dict:
        return self.batch_fn(micro_batch, seq, _batch_generator(self.seed, micro_step, rank), device)


class TextCorpus:
    """All text files under a path, tokenised once into one token stream; a micro-batch takes windows of
    seq+1 tokens at seeded random offsets."""

    def __init__(self, path: Path, tokenizer: Tokenizer, vocab: int, seed: int, max_bytes: int = 1 << 30):
        path = Path(path)
        if not path.exists():
            raise DostuneError(f"--data {path} does not exist")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                     and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DostuneError(f"--data {path}: no text files found (looked for {', '.join(sorted(TEXT_SUFFIXES))})")
        if tokenizer.vocab_size > vocab:
            raise DostuneError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has "
                               f"only {vocab}")
        ids, size = [], 0
        for f in files:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                raise DostuneError(f"--data: cannot read {f} ({e})") from None
            size += len(text)
            ids.extend(tokenizer.encode(text))
            if size > max_bytes:
                break
        self.tokens = torch.tensor(ids, dtype=torch.long)
        self.seed = seed
        self.description = f"{len(files)} file(s) under {path}, {len(self.tokens):,} tokens"

    def batch(self, micro_step: int, micro_batch: int, seq: int, device, rank: int = 0) -> dict:
        n = len(self.tokens)
        if n < seq + 2:
            raise DostuneError(f"--data has {n} tokens, fewer than one sequence of {seq + 1}")
        g = _batch_generator(self.seed, micro_step, rank)
        starts = torch.randint(0, n - seq - 1, (micro_batch,), generator=g)
        windows = torch.stack([self.tokens[s:s + seq + 1] for s in starts.tolist()])
        return {"input_ids": windows[:, :-1].to(device), "labels": windows[:, 1:].to(device)}


def make_data(spec, data: Optional[Path], tokenizer: Optional[Path], seed: int):
    if data is None:
        if tokenizer is not None:
            raise DostuneError("--tokenizer needs --data")
        return SyntheticData(spec.batch, seed)
    vocab = spec.config.get("vocab")
    if vocab is None:
        raise DostuneError(f"--data needs a model with a known vocabulary; {spec.name} does not declare one")
    tok = HFTokenizersFile(tokenizer) if tokenizer is not None else ByteTokenizer()
    return TextCorpus(data, tok, vocab, seed)
