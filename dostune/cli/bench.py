"""`dostune bench`: every offload method on the same model, batch and seed, in one run."""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..bench.record import BenchResult
from ..bench.report import COLUMNS, ceiling_lines, markdown, plot_timeline, rank_lines, rows, set_aside_lines
from ..bench.run import METHODS, BenchOptions, Variant, check_bench_options, is_dostune, node_label, run_bench
from ..dsconfig import DEFAULT_SUB_GROUP_SIZE, activation_checkpointing as config_checkpoints
from ..errors import ConfigError, DostuneError
from ..optim.schedule import ScheduleConfig
from ..perfmodel.world import World, rank
from ..profile.timing import NullProgress
from ..records import atomic_write_text, check_writable, read_json_record, save_record
from ..tune.refit import TunedConfig
from .common import (err_console, flag, handle_errors, need_deepspeed, print_json, progress_display, quiet_stdout,
                     stop_code, stop_signal, stop_signals)


def render_bench(res: BenchResult) -> Table:
    t = Table(title=f"{res.model} on {res.node} ({res.precision}, micro-batch {res.micro_batch}, seq {res.seq})")
    for c in COLUMNS:
        t.add_column(c, justify="left" if c == "method" else "right")
    for r in rows(res):
        t.add_row(*r)
    return t


def _read_config(config: Path) -> tuple[ScheduleConfig, Optional[int], Optional[World]]:
    tuned = TunedConfig.read(read_json_record(config, "DeepSpeed config"), str(config))
    if tuned.schedule is None:
        raise ConfigError(f"{config} has no 'dostune' section; run `dostune tune` to emit one",
                          hint="name the ds_config.json that `dostune tune` wrote, or give the schedule as --schedule")
    return tuned.schedule, tuned.sub_group_size if tuned.sub_group_size_given else None, tuned.world


def config_label(path: Path) -> str:
    """A short name for a config in method names: its file name without .json, or its folder's name for the
    ds_config.json that `dostune tune` writes."""
    name = path.parent.name if path.stem in ("ds_config", "config") and path.parent.name else path.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "config"


def _variants(configs: list[Path], sub_group_size: Optional[int]) -> list[Variant]:
    """The configs after the first, each a further dostune schedule; labels made distinct by a suffix.
    ``sub_group_size`` (--dostune-sub-group-size) replaces each config's own."""
    out, used = [], {config_label(configs[0])}
    for path in configs[1:]:
        sched, sgs, world = _read_config(path)
        sgs = sub_group_size or sgs
        label, k = config_label(path), 2
        while label in used:
            label, k = f"{config_label(path)}-{k}", k + 1
        used.add(label)
        out.append(Variant(label=label, schedule=sched, sub_group_size=sgs, source=str(path), world=world))
    return out


def _schedule_from(config: Optional[Path], schedule_json: Optional[str]) \
        -> tuple[Optional[ScheduleConfig], Optional[int], Optional[World]]:
    if config is not None and schedule_json is not None:
        raise DostuneError("give either --config or --schedule, not both",
                           hint="--config reads the schedule from a tuned config; --schedule gives it inline")
    if config is not None:
        return _read_config(config)
    if schedule_json is not None:
        try:
            section = json.loads(schedule_json)
        except json.JSONDecodeError as e:
            raise DostuneError(f"--schedule is not valid JSON: {e.msg}",
                               hint="quote it for the shell, e.g. --schedule '{\"gpu_fraction\": 0.3}'") from None
        return ScheduleConfig.from_ds_config({"dostune": section}), None, None
    return None, None, None


@handle_errors
def bench(
    model: str = typer.Option("gpt2-1.3b", help="Model preset or package.module:factory."),
    micro_batch: int = typer.Option(8, min=1, help="Micro-batch size per GPU."),
    seq: int = typer.Option(1024, min=1, help="Sequence length."),
    precision: str = typer.Option("bf16", help="bf16, fp16 or fp32."),
    clip: float = typer.Option(1.0, min=0.0, help="Gradient clipping (max global norm) for every method; 0 "
                               "disables it. Matters for overlap_backward, whose speculative updates are "
                               "recomputed on steps that clip."),
    iters: int = typer.Option(8, min=1, help="Timed iterations per method (medians are reported)."),
    warmup: int = typer.Option(3, min=0, help="Untimed iterations first."),
    rounds: int = typer.Option(1, min=1, help="Measure every method this many times, in reverse order every other "
                               "round (A B, B A, ...), each time on a fresh engine; medians pool all rounds. Use 2 "
                               "or more on a machine whose speed drifts over minutes."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated subset of: " + ", ".join(METHODS)
                                          + ". Default: all on a GPU; zero-offload,dostune on a CPU."),
    config: Optional[list[Path]] = typer.Option(None, help="dostune's schedule and sub_group_size from a tuned "
                                                "ds_config.json (dostune tune). Repeat it to compare schedules in one "
                                                "run: the first is `dostune`, each further one `dostune:<label>` (its "
                                                "file name, or its folder's for a ds_config.json), measured in the "
                                                "same round order.", metavar="<path>"),
    schedule: Optional[str] = typer.Option(None, help='dostune\'s schedule as JSON, e.g. \'{"gpu_fraction": 0.3}\'.'),
    sub_group_size: int = typer.Option(DEFAULT_SUB_GROUP_SIZE, min=1, help="sub_group_size for DeepSpeed's methods."),
    dostune_sub_group_size: Optional[int] = typer.Option(None, min=1, help="sub_group_size for dostune, every "
                                                         "--config (default: each --config's, else "
                                                         "--sub-group-size)."),
    node: Optional[str] = typer.Option(None, help="Node label in the result (default: the GPU name)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Result JSON; a .md and a timeline "
                                          "PNG are written beside it. Default: results/<node>/bench-<model>.json"),
    seed: int = typer.Option(0, help="Seed for weights and batches (the same for every method)."),
    activation_checkpointing: bool = flag(False, "--activation-checkpointing", help="Every method's model "
                                                  "checkpoints each transformer block (recomputes its activations "
                                                  "in backward). On too when a --config has the section."),
    json_out: bool = flag(False, "--json", help="Print the result JSON on stdout."),
):
    """Train one model under each offload method and compare them.

    Same model, batch and seed for DeepSpeed ZeRO-Offload (ratio 1.0), Twin-Flow (ratio 0.5, and the ratio
    that fits dostune's GPU memory or, where the host cannot hold that, the largest it holds), SuperOffload,
    no offload (the ceiling) and dostune. Reports forward, backward, step and iteration time (medians), update
    rate, peak GPU memory, each method's measured host peak
    (its process's peak RSS, and the host memory page-locked for it) and the final loss. A method whose host memory
    would not fit this host is not started: its row says what it needs and what there is (`dostune plan` shows
    that for every method beforehand).

    Example: dostune bench --model gpt2-1.3b --micro-batch 8 --seq 1024 --config ds_config.json

    Several GPUs or nodes: under DeepSpeed's launcher every rank runs every method, and the result shows the
    slowest rank's phases and every rank's peak memory (docs/multi-gpu.md):
      deepspeed --num_gpus 2 --module dostune.bench --model gpt2-1.3b --config ds_config.json

    Two schedules against no offload, drift cancelled (A B C, C B A):
    dostune bench --methods no-offload,dostune --rounds 2 --config a/ds_config.json --config b/ds_config.json
    """
    configs = list(config or [])
    sched, sgs, tuned_world = _schedule_from(configs[0] if configs else None, schedule)
    variants = _variants(configs, dostune_sub_group_size) if len(configs) > 1 else []
    opts = BenchOptions(model=model, micro_batch=micro_batch, seq=seq, precision=precision, clip=clip, iters=iters,
                        warmup=warmup, rounds=rounds, seed=seed, sub_group_size=sub_group_size, schedule=sched,
                        dostune_sub_group_size=dostune_sub_group_size or sgs, dostune_world=tuned_world, node=node,
                        variants=variants,
                        methods=[m.strip() for m in methods.split(",") if m.strip()] if methods else None,
                        activation_checkpointing=activation_checkpointing
                        or any(config_checkpoints(read_json_record(c, "DeepSpeed config")) for c in configs))
    check_bench_options(opts)  # bad names, shapes, schedules that do not fit the model: before any work
    path = output or Path("results") / node_label(opts).lower().replace(" ", "-") / f"bench-{model}.json"
    if path.suffix in (".md", ".png"):
        raise DostuneError(f"--output {path} names the result JSON; the .md and the timeline PNG go beside it",
                           hint="give a path ending in .json")
    for p in (path, path.with_suffix(".md"), path.with_name(f"{path.stem}-timeline.png")):
        check_writable(p, "--output")
    need_deepspeed("dostune bench")

    def keep(partial: BenchResult) -> None:
        # after every method: what finished is on disk whatever happens to the rest
        save_record(partial, path)
        atomic_write_text(path.with_suffix(".md"), markdown(partial))

    # under the launcher rank 0 alone shows progress and writes the result, which holds every rank's figures
    shown = progress_display() if rank() == 0 else contextlib.nullcontext(NullProgress())
    # A world of one measures each method in a process of its own, which a SIGTERM must stop too (stop_signals makes
    # it a KeyboardInterrupt that bench/isolate.py passes on). A launcher's ranks measure in place and keep the
    # default SIGTERM: a rank waiting in a collective for a dead peer would not run a Python handler until it timed out.
    stops = stop_signals() if World.of_run().size == 1 else contextlib.nullcontext([])
    try:
        with shown as progress, quiet_stdout(), stops as got:
            res = run_bench(opts, progress, on_result=keep)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the methods that finished are on disk (keep)
        err_console.print(f"[yellow]stopped[/] ({stop_signal(got).name}): {path} holds the methods that finished",
                          highlight=False)
        raise typer.Exit(stop_code(got))
    if rank() != 0:
        return
    keep(res)
    pngs = []
    for name, m in res.methods.items():
        if is_dostune(name) and m.timeline:
            v = opts.variant(name)
            suffix = "" if v is None else "-" + v.label
            pngs.append(plot_timeline(m.timeline, path.with_name(f"{path.stem}-timeline{suffix}.png"),
                                      f"{name} update timeline: {model} on {res.node}"))
    png = ", ".join(str(x) for x in pngs if x) or None
    err_console.print(render_bench(res))
    for line in rank_lines(res) + set_aside_lines(res) + ceiling_lines(res):
        err_console.print(line, highlight=False, soft_wrap=True)
    failed = [n for n, m in res.methods.items() if not m.ran]
    if failed:
        err_console.print(f"[yellow]note:[/] {len(failed)} method(s) did not run: {', '.join(failed)} (the reason is "
                          "in each row and in the .md)", highlight=False, soft_wrap=True)
    err_console.print(f"results written to [bold]{path}[/] and {path.with_suffix('.md')}"
                      + (f"; timeline {png}" if png else ""), soft_wrap=True)
    if json_out:
        print_json(res)
