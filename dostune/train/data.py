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


def _is_binary(raw: bytes) -> bool:
    """A NUL byte, or more than one byte in ten that is not UTF-8: not text (a tokenised or compressed corpus, an
    image), which would train on noise without a word."""
    if b"\0" in raw:
        return True
    text = raw.decode("utf-8", errors="replace")
    return text.count("\ufffd") > len(text) / 10


TEXT_HINT = "give a UTF-8 text file, or a folder of them (" + ", ".join(sorted(TEXT_SUFFIXES)) + ")"


class TextCorpus:
    """All text files under a path, tokenised once into one token stream; a micro-batch takes windows of
    seq+1 tokens at seeded random offsets. Refused at construction (before any engine is built): a corpus that is
    not text, or too short for one window."""

    def __init__(self, path: Path, tokenizer: Tokenizer, vocab: int, seed: int, seq: int,
                 max_bytes: int = 1 << 30):
        path = Path(path)
        if not path.exists():
            raise DostuneError(f"--data {path} does not exist", hint=TEXT_HINT)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                     and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise DostuneError(f"--data {path}: no text files found (looked for {', '.join(sorted(TEXT_SUFFIXES))})",
                               hint=TEXT_HINT)
        if tokenizer.vocab_size > vocab:
            raise DostuneError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has "
                               f"only {vocab}", hint="give a tokenizer made for this model, or a model with a "
                                                     "larger vocabulary")
        ids, size = [], 0
        for f in files:
            try:
                raw = f.read_bytes()
            except OSError as e:
                raise DostuneError(f"--data: cannot read {f} ({e.strerror or e})", hint=TEXT_HINT) from None
            if _is_binary(raw):
                raise DostuneError(f"--data {f} is not text (it holds binary data)", hint=TEXT_HINT)
            text = raw.decode("utf-8", errors="replace")
            size += len(text)
            ids.extend(tokenizer.encode(text))
            if size > max_bytes:
                break
        if len(ids) < seq + 2:
            what = "is empty" if not ids else f"holds {len(ids):,} tokens, fewer than one sequence of {seq + 1}"
            raise DostuneError(f"--data {path} {what}",
                               hint=f"give more text, or a shorter --seq (at most {max(len(ids) - 2, 1)} here)"
                               if ids else TEXT_HINT)
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


def make_data(spec, data: Optional[Path], tokenizer: Optional[Path], seed: int, seq: int):
    """The batches of a run: seeded synthetic tokens, or the corpus at ``data`` (checked here, before any engine)."""
    if data is None:
        if tokenizer is not None:
            raise DostuneError("--tokenizer needs --data", hint="give --data the text to tokenise, or drop --tokenizer")
        return SyntheticData(spec.batch, seed)
    vocab = spec.config.get("vocab")
    if vocab is None:
        raise DostuneError(f"--data needs a model with a known vocabulary; {spec.name} does not declare one",
                           hint="use a model preset with --data, or run without --data (seeded synthetic tokens)")
    tok = HFTokenizersFile(tokenizer) if tokenizer is not None else ByteTokenizer()
    return TextCorpus(data, tok, vocab, seed, seq)
