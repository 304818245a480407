"""Whether a host's speed wanders in time or sits per process: ZeRO-Offload's forward and backward with the gradient
copies dropped and no step (the model profile's backward probe, backward_probes.py), back to back for a number of
seconds, one JSON line per iteration with its wall-clock time. Run it once long and a few times short on one host,
then set the long run's windows beside the short runs (docs/experiments.md, section 25):

    python -m dostune.profile.host_epochs time examples.validation_shapes:llama_1_2b --seconds 150 -o long.jsonl
    python -m dostune.profile.host_epochs time examples.validation_shapes:llama_1_2b --seconds 25 -o short1.jsonl
    python -m dostune.profile.host_epochs windows long.jsonl short1.jsonl --window 15

Run `time` as a single process (the engine starts its own one-rank world, train/engine.py). Each line is written as
its iteration ends, so a run cut short keeps the iterations it finished.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from ..errors import DostuneError

WARMUP = 3  # iterations left out of `windows`: the first ones build ZeRO-3's parameter trace and allocator pools


def time_passes(model: str, seconds: float, micro_batch: int, seq: int) -> Iterator[dict]:
    """Forward and backward (copies dropped, no step) of ``model`` under ZeRO-Offload, for ``seconds``."""
    import torch

    from ..bench.run import BenchOptions, method_offload, train_settings
    from ..dsconfig import deepspeed_config
    from ..models.registry import resolve_model
    from ..train.engine import build_engine
    from .backward_probes import drop_gradient_copies
    from .timing import iteration_phases

    opts = BenchOptions(model=model, micro_batch=micro_batch, seq=seq, clip=0.0)
    cfg = deepspeed_config(train_settings(opts), method_offload("zero-offload", opts, None))
    spec = resolve_model(model)
    engine = build_engine(spec, cfg, seed=opts.seed, use_dostune=False)
    opt = engine.optimizer
    opt.partition_grads = drop_gradient_copies(opt)
    gen = torch.Generator().manual_seed(opts.seed + 1)
    start, k = time.time(), 0
    try:
        while time.time() - start < seconds:
            _, fwd, bwd, _ = iteration_phases(engine, spec.batch(micro_batch, seq, gen, engine.device), step=False)
            opt.zero_grad()  # no step follows: the next pass starts as a fresh iteration
            yield {"pid": os.getpid(), "k": k, "t": round(time.time(), 3), "fwd": round(fwd, 5), "bwd": round(bwd, 5)}
            k += 1
    finally:
        engine.destroy()


def windows(paths: list[Path], window_s: float) -> list[dict]:
    """Per file, the medians of its iterations in each ``window_s`` of wall-clock time (the first file's start is 0),
    the first WARMUP iterations of each left out; and per file, all of them."""
    runs = []
    for p in paths:
        try:
            rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()][WARMUP:]
        except (OSError, ValueError) as e:
            raise DostuneError(f"{p}: not the JSON lines of `host_epochs time` ({str(e).splitlines()[0]})") from None
        if not rows:
            raise DostuneError(f"{p}: no iterations after the first {WARMUP}")
        runs.append((p.name, rows))
    t0 = runs[0][1][0]["t"]
    out = []
    for name, rows in runs:
        groups: dict[int, list[dict]] = {}
        for r in rows:
            groups.setdefault(int((r["t"] - t0) // window_s), []).append(r)
        for w, g in sorted(groups.items()) + [(None, rows)]:
            out.append({"file": name, "from_s": None if w is None else w * window_s, "n": len(g),
                        "fwd_ms": 1000 * statistics.median(r["fwd"] for r in g),
                        "bwd_ms": 1000 * statistics.median(r["bwd"] for r in g)})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dostune.profile.host_epochs", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time", help="time the passes, one JSON line per iteration")
    t.add_argument("model", help="a preset or package.module:factory")
    t.add_argument("--seconds", type=float, default=60.0)
    t.add_argument("--micro-batch", type=int, default=8)
    t.add_argument("--seq", type=int, default=1024)
    t.add_argument("--output", "-o", type=Path, required=True, help="the JSON lines (DeepSpeed prints on stdout)")
    w = sub.add_parser("windows", help="medians per window of wall-clock time, per file")
    w.add_argument("files", nargs="+", type=Path)
    w.add_argument("--window", type=float, default=15.0, help="seconds (default 15)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "windows":
            if args.window <= 0:
                raise DostuneError("--window must be positive")
            for r in windows(args.files, args.window):
                when = "all" if r["from_s"] is None else f"{r['from_s']:.0f}-{r['from_s'] + args.window:.0f} s"
                print(f"{r['file']:24s} {when:>12s}  n={r['n']:4d}  forward {r['fwd_ms']:7.1f} ms  "
                      f"backward {r['bwd_ms']:7.1f} ms")
            return 0
        if args.seconds <= 0 or args.micro_batch < 1 or args.seq < 1:
            raise DostuneError("--seconds, --micro-batch and --seq must be positive")
        if not args.output.parent.is_dir():
            raise DostuneError(f"cannot write {args.output}: no folder {args.output.parent}")
        # opened at the first iteration: a model that cannot be built leaves no empty file behind
        out = None
        try:
            for row in time_passes(args.model, args.seconds, args.micro_batch, args.seq):
                out = out or open(args.output, "w")
                out.write(json.dumps(row) + "\n")
                out.flush()
        finally:
            if out is not None:
                out.close()
        return 0
    except DostuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
