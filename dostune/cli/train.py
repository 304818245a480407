"""`dostune train`: train with a DeepSpeed config and its dostune schedule, one GPU or many."""
from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..train.checkpoint import read_latest
from ..train.loop import Interrupted, TrainOptions, check_options, train as run_train
from ..bench.report import describe_ranks
from .common import err_console, flag, handle_errors, need_deepspeed, print_json, quiet_stdout


def _gather_rank_figures(records: list) -> list:
    """Every rank's median step figures (after the first step, which builds and warms up) and peak GPU memory.
    Every rank of several takes part (one with no steps sends nothing), else the others would wait for it."""
    import statistics

    from ..bench.record import RankFigures
    from ..perfmodel.world import World, gather_ranks, rank

    if World.of_run().size == 1:
        return []
    timed = records[1:] or records
    mine = RankFigures(rank=rank(), **{k: statistics.median(getattr(r, k) for r in timed)
                                       for k in ("iter_s", "fwd_s", "bwd_s", "step_s")},
                       peak_gpu_gib=max((r.gpu_mem_gib for r in records if r.gpu_mem_gib is not None), default=None)) \
        if records else None
    return sorted((f for f in gather_ranks(mine) if f is not None), key=lambda r: r.rank)


@handle_errors
def train(
    ctx: typer.Context,
    config: Path = typer.Option(..., help="DeepSpeed config (ZeRO-3, offload_optimizer to cpu), e.g. the one "
                                "`dostune tune` wrote. Its 'dostune' section selects the interleaved optimizer; "
                                "without one this is plain DeepSpeed."),
    model: str = typer.Option("gpt2-1.3b", help="Model preset, hf:config.json, or package.module:factory."),
    steps: int = typer.Option(100, min=1, help="Optimizer steps to reach (a resumed run continues up to it)."),
    seq: int = typer.Option(1024, min=1, help="Sequence length."),
    data: Optional[Path] = typer.Option(None, exists=True, help="A text file or a folder of text files (tokenised "
                                        "with a byte-level tokenizer, or --tokenizer). Default: seeded synthetic "
                                        "tokens."),
    tokenizer: Optional[Path] = typer.Option(None, exists=True, dir_okay=False,
                                             help="A `tokenizers` JSON file for --data."),
    seed: int = typer.Option(0, help="Seed for the weights and the batches."),
    save_dir: Optional[Path] = typer.Option(None, help="Checkpoint folder (DeepSpeed's format, one tag per save)."),
    save_every: int = typer.Option(0, min=0, help="Save every N steps (0: only at the end and on Ctrl-C)."),
    resume: bool = flag(False, "--resume", help="Continue from the latest checkpoint in --save-dir, bit-exactly."),
    log_every: int = typer.Option(10, min=1, help="Print a line every N steps (the progress bar updates always)."),
    metrics: Optional[Path] = typer.Option(None, help="Metrics JSONL, one line per step. Default: "
                                           "SAVE_DIR/metrics.jsonl, or runs/train/MODEL/metrics.jsonl."),
    plain_deepspeed: bool = flag(False, "--plain-deepspeed", help="Ignore the dostune section: DeepSpeed's own "
                                 "ZeRO-Offload, all optimizer state offloaded."),
    deterministic: bool = flag(False, "--deterministic", help="PyTorch's deterministic kernels (strict mode). On a GPU some backward "
                                       "kernels (flash attention's) accumulate in a varying order, so without "
                                       "this a resumed run drifts from an uninterrupted one in the last bits; "
                                       "with it the H100 reproduced 100 resumed steps of gpt2-1.3b bit for bit. "
                                       "On a CPU runs are exact anyway."),
    activation_checkpointing: bool = flag(False, "--activation-checkpointing", help="Checkpoint every "
                                                  "transformer block (recompute its activations in backward) even "
                                                  "if the config has no activation_checkpointing section (with one, "
                                                  "it is on anyway)."),
    rank_timeout: Optional[float] = typer.Option(None, min=1, envvar="DOSTUNE_RANK_TIMEOUT",
                                                 help="Seconds after which a rank stops when another has died or "
                                                 "hangs (exit 3; must exceed the longest step). Default: "
                                                 "DeepSpeed's collective timeout, 10 minutes. See docs/faults.md."),
    json_out: bool = flag(False, "--json", help="Print a JSON summary on stdout at the end."),
):
    """Train a model with DeepSpeed ZeRO-3 and dostune's interleaved optimizer.

    Progress shows loss, tokens/s, iteration time and its forward/backward/step split, and GPU memory.
    Ctrl-C, SIGTERM and SIGUSR1 finish the current step, save a checkpoint and exit with 128 + the signal's
    number (130, 143, 138), printing the command that resumes; --resume continues from it with the
    same batches and the same optimizer state, bit for bit: on a CPU the loss sequence equals an
    uninterrupted run's; on a GPU that needs --deterministic too (otherwise nondeterministic backward
    kernels make it drift in the last bits). Checkpoints are DeepSpeed's own and load into plain DeepSpeed ZeRO-3 (and vice versa).

    Several GPUs or nodes: run it under DeepSpeed's launcher, e.g.
      deepspeed --num_gpus 2 --module dostune.train --config ds_config.json --model gpt2-1.3b --steps 200
    with a config tuned for that world (dostune tune --num-gpus 2); one tuned for another world stops before the
    engine is built. At the end rank 0 shows the slowest rank's phases and every rank's peak memory.

    Example: dostune train --config runs/tune/gpt2-1.3b/ds_config.json --model gpt2-1.3b --steps 200 --data corpus/
    """
    rank0 = os.environ.get("RANK", "0") == "0"
    metrics = metrics or ((save_dir / "metrics.jsonl") if save_dir else Path("runs/train") / model.replace(":", "_")
                          / "metrics.jsonl")
    opts = TrainOptions(config=config, model=model, steps=steps, seq=seq, data=data, tokenizer=tokenizer, seed=seed,
                        save_dir=save_dir, save_every=save_every, resume=resume, log_every=log_every, metrics=metrics,
                        plain_deepspeed=plain_deepspeed, deterministic=deterministic,
                        activation_checkpointing=activation_checkpointing, rank_timeout=rank_timeout,
                        resume_command=_resume_command(ctx))
    need_deepspeed("dostune train")
    prepared = check_options(opts)  # a refusal prints alone, before the progress bar appears
    progress = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=err_console, disable=not rank0)
    records = []
    with progress:
        task = progress.add_task("train", total=steps, info="building the engine...")

        def on_step(r):
            records.append(r)
            mem = f" | {r.gpu_mem_gib:.1f} GiB" if r.gpu_mem_gib is not None else ""
            swing = f" | swing {r.swing:+d}" if r.swing else ""  # adaptive_swing moved subgroups for this step
            info = (f"loss {r.loss:.4f} | {r.tokens_per_s:,.0f} tok/s | {r.iter_s:.3f} s = fwd {r.fwd_s:.3f} + bwd "
                    f"{r.bwd_s:.3f} + step {r.step_s:.3f}{mem}{swing}")
            progress.update(task, completed=r.step, info=info)
            if rank0 and (r.step % log_every == 0 or r.step == steps):
                progress.console.print(f"step {r.step:>6}  {info}", highlight=False)

        with quiet_stdout():
            summary = run_train(opts, on_step=on_step, prepared=prepared)
    ranks = _gather_rank_figures(records)  # under the launcher: every rank's, on every rank
    if rank0 and len(ranks) > 1:
        err_console.print(describe_ranks(ranks), highlight=False, soft_wrap=True)
    if rank0:
        for line in _closing_lines(summary, metrics, save_dir, steps, ctx):
            err_console.print(line, soft_wrap=True, highlight=False, markup=False)
        if json_out:
            print_json(summary.__dict__)
    if summary.interrupted:
        from ..train.engine import leave_launchers_world

        # every rank agreed on this stop's step and saved there, so none waits for another in a collective: the world
        # closes as after a success, and the rank ends without the teardown that can abort a gloo rank
        leave_launchers_world()
        latest = read_latest(save_dir) if save_dir else None
        if rank0 and latest:  # its own line, unwrapped, to copy from a terminal or a job's log
            err_console.print(f"resume with: {opts.resume_command}", soft_wrap=True, highlight=False, markup=False)
        raise Interrupted(f"stopped by {signal.Signals(summary.stop_signal).name} after step {summary.last_step}"
                          + (f"; checkpoint {save_dir / latest}" if latest else
                             "; nothing saved" + ("" if save_dir else " (no --save-dir)")),
                          summary.stop_signal)


# what the run's optimizer was, for the user (the JSON summary keeps the class's name)
OPTIMIZER_NAMES = {"InterleavedZeroOptimizer": "dostune's interleaved CPU+GPU optimizer",
                   "DeepSpeedZeroOptimizer_Stage3": "DeepSpeed's own ZeRO-3 optimizer"}


def _closing_lines(summary, metrics: Path, save_dir: Optional[Path], steps: int, ctx: typer.Context) -> list[str]:
    """The run's last lines: what ran, what was saved where, and what to do next (a stopped run's resume command
    follows them)."""
    from ..train.loop import metrics_path

    how = OPTIMIZER_NAMES.get(summary.optimizer, summary.optimizer)
    files = metrics_path(metrics, 0)
    lines = [f"trained steps {summary.first_step + 1}-{summary.last_step} with {how}",
             f"metrics: {files} (one JSON line per step)"] if summary.steps_run else \
        ["no step ran, so no metrics were written"]
    if summary.checkpoints:
        lines.append(f"checkpoint: {summary.checkpoints[-1]} (DeepSpeed's format; `--resume` continues from it)")
    elif save_dir is None:
        lines.append("checkpoint: none (the run had no --save-dir)")
    if not summary.interrupted:
        lines.append(f"to train further: {_resume_command(ctx, steps=steps * 2)}" if save_dir is not None
                     else "next: give --save-dir DIR to keep a run's weights and continue it later with --resume")
    return lines


def _resume_command(ctx: typer.Context, steps: Optional[int] = None) -> str:
    """The command line that continues this run: the options given on the command line (or through their
    environment variables), with --resume (and ``--steps steps`` where given: a finished run goes further). Under
    a launcher the ranks do not see the launcher's own options."""
    words = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if p.name == "steps" and steps is not None:
            words += [p.opts[0], str(steps)]
            continue
        if p.name == "resume" or getattr(source, "name", None) not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value = ctx.params[p.name]
        if p.is_flag:
            words += [p.opts[0]] if value else p.secondary_opts[:1]
        else:
            words += [p.opts[0], str(value)]
    prefix = ("dostune train" if int(os.environ.get("WORLD_SIZE", "1")) == 1
              else "deepspeed <the same launcher options> --module dostune.train")
    return f"{prefix} {shlex.join(words + ['--resume'])}"
