"""`dostune tune`: from profiles to a DeepSpeed config with a tuned dostune schedule."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..bench.report import plot_timeline
from ..records import atomic_write_text, save_record
from ..tune.record import TuneResult
from ..errors import DostuneError, NotAvailable
from ..optim.schedule import gpu_count
from ..profile.identity import cuda_available
from ..tune.limits import GPU_HEADROOM_SHARE
from ..tune.regime import NAMES
from ..tune.search import TuneOptions, check_options, run_tune, trial_record
from ..tune.search import output_dir as tune_output_dir
from ..tune.study import SAMPLERS
from .common import (err_console, flag, handle_errors, need_deepspeed, parse_fraction, print_json, progress_display,
                     quiet_stdout, stop_code, stop_signal, stop_signals)


def _f(x, fmt="{:.3f}", none="-"):
    return none if x is None else fmt.format(x)


def _during_backward(s: dict) -> str:
    """What the schedule updates while backward runs."""
    return "CPU" if s.get("overlap_backward") else "no"


def render_summary(res: TuneResult) -> Table:
    """The table `dostune tune` prints: the best schedules and ZeRO-Offload as predicted, and, where --validate ran
    them, as measured."""
    w = res.world
    world = (f", one rank of {w['nodes']} node(s) x {w['gpus_per_node']} GPU(s)"
             if w["nodes"] * w["gpus_per_node"] > 1 else "")
    scored = f", scored for {NAMES[res.regime]}" if res.regime else ""
    t = Table(title=f"{res.model} (micro-batch {res.micro_batch}, {res.precision}) on {Path(res.node_profile).stem}"
                    f"{world}: the best of {res.trials} trials, predicted{scored}")
    measured = {v.label: v for v in res.validation}
    cols = ["schedule", "sub_group_size", "GPU subgroups", "overlaps bwd", "peak GiB", "step s", "iteration s",
            "no-clip iter s", "clip iter s", "speedup"]
    if measured:
        cols += ["measured s", "measured speedup", "error"]
    for col in cols:
        t.add_column(col, justify="left" if col == "schedule" else "right")
    zo, zo_row = res.ds_offload, next((v for v in res.validation if v.method == "zero-offload"), None)

    def speedup(zo_s, s) -> str:
        return f"{zo_s / s:.2f}x" if zo_s and s else "-"

    def validated(v, zo_measured) -> list[str]:
        if v is None:
            return ["-", "-", "-"]
        error = v.predicted_iter_s / v.measured_iter_s - 1 if v.predicted_iter_s else None
        return [_f(v.measured_iter_s), speedup(zo_measured, v.measured_iter_s), _f(error, "{:+.1%}")]

    zo_measured = zo_row.measured_iter_s if zo_row is not None else None
    for k, r in enumerate(res.top, 1):
        s, p = r.schedule, r.predicted
        resident = s.get("resident_subgroups", 0)
        row = [f"dostune #{k}" + (" (config)" if k == 1 else ""), f"{r.sub_group_size:.3g}",
               f"{gpu_count(r.subgroups, s['gpu_fraction'])}/{r.subgroups}" + (f", {resident} resident" if resident
                                                                                 else ""),
               "yes" if s.get("overlap_backward") else "no", _f(p.peak_gpu_gib, "{:.1f}"), _f(p.step_s), _f(p.iter_s),
               _f(r.iter_in("no_clip")), _f(r.iter_in("clip")), speedup(zo.iter_s if zo else None, p.iter_s)]
        t.add_row(*row, *(validated(measured.get(f"dostune #{k}"), zo_measured) if measured else []))
    if zo is not None:
        row = ["ZeRO-Offload", f"{res.ds_sub_group_size:.3g}", "-", "no", _f(zo.peak_gpu_gib, "{:.1f}"),
               _f(zo.step_s), _f(zo.iter_s), _f(zo.iter_s), _f(zo.iter_s), "1.00x" if zo.iter_s else "-"]
        t.add_row(*row, *(validated(zo_row, zo_measured) if measured else []))
    if res.regret is not None:
        t.caption = regret_line(res)
    return t


def regret_line(res: TuneResult) -> str:
    """The pick's regret against its measured neighbourhood, in a line."""
    ran = sum(v.method == "dostune" for v in res.validation)
    if res.regret_best == "dostune #1":
        return f"regret 1.00x: the pick measured fastest of the {ran} schedules measured"
    return (f"regret {res.regret:.2f}x: the pick measured {res.regret - 1:.1%} slower than {res.regret_best}, the "
            f"fastest of the {ran} schedules measured")


def render_neighbourhood(res: TuneResult) -> Table:
    """The pick and its neighbours as measured, each beside its prediction in the regime its runs were in."""
    pick = next((v for v in res.validation if v.label == "dostune #1"), None)
    clip = f"clipping at {res.validation_clip:g}" if res.validation_clip else "clipping off"
    t = Table(title=f"the pick and its neighbours, measured ({clip})")
    for col in ("schedule", "regime", "predicted s", "measured s", "vs the pick"):
        t.add_column(col, justify="left" if col == "schedule" else "right")
    for v in res.validation:
        if v.method != "dostune" or (v.neighbour is None and v is not pick):
            continue
        vs = _f(v.measured_iter_s / pick.measured_iter_s - 1, "{:+.1%}") if pick is not None and v is not pick else ""
        t.add_row(v.label, (v.regime or "-").replace("_", "-"), _f(v.predicted_iter_s), _f(v.measured_iter_s), vs)
    return t


def render_trials(res: TuneResult) -> Table:
    t = Table(title=f"best schedules for {res.model} (micro-batch {res.micro_batch}, {res.precision}) on "
                    f"{Path(res.node_profile).stem}: {res.trials} trials")
    for col in ("schedule", "trial", "sub_group_size", "GPU subgroups", "buffers", "threads", "upload", "grads on GPU",
                "during bwd", "step s", "iter s", "G elem/s", "extra GiB", "peak GiB"):
        t.add_column(col, justify="right")
    for k, r in enumerate(res.top, 1):
        s, p = r.schedule, r.predicted
        gpu = gpu_count(r.subgroups, s["gpu_fraction"])
        res_k = s.get("resident_subgroups", 0)
        t.add_row(f"#{k}", str(r.number), f"{r.sub_group_size:.3g}",
                  f"{gpu}/{r.subgroups}" + (f" ({res_k} resident)" if res_k else ""), str(s["staging_buffers"]),
                  str(s.get("cpu_threads", "-")), s["upload"], "yes" if s["grads_on_gpu"] else "no",
                  _during_backward(s), _f(p.step_s), _f(p.iter_s), _f(p.update_gelem_s, "{:.2f}"),
                  _f(p.extra_step_gib, "{:.2f}"), _f(p.peak_gpu_gib, "{:.1f}"))
    return t


def _bwd_parts(p) -> str:
    if p.bwd_compute_s is None:
        return "-"
    return f"{p.bwd_compute_s:.3f} + {p.bwd_copies_s:.3f} + {p.bwd_interference_s:.3f}"


def render_breakdown(res: TuneResult) -> Table:
    b, d = res.best.predicted, res.ds_offload
    t = Table(title="predicted phase breakdown (s)")
    for col in ("", "forward", "backward", "= compute + copies + CPU lane", "step", "of which lanes", "CPU busy",
                "H2D busy", "D2H busy", "iteration"):
        t.add_column(col, justify="right")
    t.add_row("dostune (best)", _f(b.fwd_s), _f(b.bwd_s), _bwd_parts(b), _f(b.step_s), _f(b.lanes_s),
              _f(b.cpu_busy_s), _f(b.h2d_busy_s), _f(b.d2h_busy_s), _f(b.iter_s))
    if d is not None:
        form = {True: ", pinned", False: ", pageable", None: ""}[d.pinned]
        step = " (measured)" if d.measured_step else ""
        t.add_row(f"ZeRO-Offload (sub_group_size {res.ds_sub_group_size:.3g}{form})", _f(d.fwd_s), _f(d.bwd_s),
                  _bwd_parts(d), _f(d.step_s) + step, _f(d.lanes_s), "", "", "", _f(d.iter_s))
    return t


def render_validation(res: TuneResult) -> Table:
    clip = f"clipping at {res.validation_clip:g}" if res.validation_clip else "clipping off"
    t = Table(title=f"measured vs predicted (s; {clip})")
    for col in ("schedule", "fwd pred/meas", "bwd pred/meas", "step pred/meas", "iter pred/meas", "iter error",
                "step error", "meas peak GiB"):
        t.add_column(col, justify="right")
    for v in res.validation:
        pm = [f"{_f(v.predicted(ph))}/{_f(v.measured(ph))}" for ph in ("fwd", "bwd", "step", "iter")]
        t.add_row(v.label, *pm, _f(v.iter_error, "{:.1%}"), _f(v.step_error, "{:.1%}"),
                  _f(v.measured_peak_gpu_gib, "{:.1f}"))
    return t


@handle_errors
def tune(
    model: str = typer.Option("gpt2-1.3b", help="Model preset or package.module:factory."),
    profile: Optional[Path] = typer.Option(None, help="Node profile (dostune profile). Default: profiles/NODE.json, "
                                           "where `dostune profile` writes this node's; without a GPU, the shipped "
                                           "H200 profile."),
    model_profile: Optional[Path] = typer.Option(None, help="Model profile (dostune profile --model). Default: "
                                                 "NODE-MODEL-bB-sS.json (NODE-MODEL-bB-sS-MxN.json for M nodes of N "
                                                 "GPUs) beside the node profile, if any."),
    trials: int = typer.Option(100, min=1, help="Optuna trials (in total: a resumed study runs only the rest)."),
    sampler: str = typer.Option("tpe", help="Optuna sampler: " + ", ".join(SAMPLERS) + "."),
    seed: int = typer.Option(0, help="Sampler seed."),
    gpu_memory_budget: str = typer.Option("auto", help="GiB the schedule may stage on the GPU during the step; "
                                          "'auto' = the free memory the model profile measured in the step, less "
                                          f"a headroom of {GPU_HEADROOM_SHARE:.0%} of the GPU's memory."),
    max_peak_increase: Optional[str] = typer.Option(None, help="For an equal-memory comparison: predicted peak GPU "
                                                    "memory may exceed ZeRO-Offload's measured peak by at most this "
                                                    "much, a percentage (10%) or a fraction (0.1). Default: the "
                                                    "schedule may fill the GPU, its predicted peak up to the GPU's "
                                                    f"memory less a headroom of {GPU_HEADROOM_SHARE:.0%} (for "
                                                    "the CUDA context and the allocator's own); tune.json's details "
                                                    "say which limits the search ran under."),
    micro_batch: Optional[int] = typer.Option(None, min=1, help="Micro-batch (default: the model profile's)."),
    precision: Optional[str] = typer.Option(None, help="bf16, fp16 or fp32 (default: the model profile's)."),
    lr: float = typer.Option(1e-4, help="Learning rate written into the emitted config."),
    clip: float = typer.Option(1.0, min=0.0, help="Gradient clipping written into the emitted config (0: off)."),
    regime: str = typer.Option("measured", help="Which steps the schedules are scored for. overlap_backward "
                               "updates CPU-lane subgroups during backward on the guess that the step will not clip: "
                               "where the global gradient norm stays under --clip the guess holds ('no-clip'); where "
                               "it is over it, as on freshly initialised weights and early in training, the CPU lane "
                               "does that work in the step instead ('clip'), and the same schedule's iteration can "
                               "take a third longer. 'measured' (default) compares the gradient norms the model "
                               "profile recorded (a freshly initialised model's) with --clip; pass 'no-clip' to "
                               "fine-tune pretrained weights whose norm stays under it, 'clip' to train from scratch, "
                               "'both' when you cannot tell (the schedule whose slower regime is fastest). The table "
                               "shows every schedule's iteration in both."),
    target: str = typer.Option("deepspeed", "--for", help="Who reads ds_config.json: 'deepspeed' (deepspeed.initialize, "
                               "dostune train; every value concrete), 'trainer' (the Hugging Face Trainer: \"auto\" for "
                               "batch sizes, gradient accumulation and clipping, the optimizer's lr/betas/eps/weight "
                               "decay and bf16/fp16, which it fills from TrainingArguments) or 'accelerate' (your own "
                               "loop under Accelerate: \"auto\" for batch sizes, gradient accumulation, lr, weight decay "
                               "and bf16/fp16). The ZeRO-3 offload settings and the 'dostune' section are the same."),
    output_dir: Optional[Path] = typer.Option(None, help="Where ds_config.json, tune.json, the timeline PNG and "
                                              "the study go. Default: runs/tune/MODEL."),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL. Default: sqlite:///OUTPUT_DIR/study.db."),
    study_name: Optional[str] = typer.Option(None, help="Study name (default: NODE-MODEL-bB). Re-running with the "
                                             "same name resumes the study."),
    validate: int = typer.Option(0, min=0, help="On a GPU: run the N best schedules (and ZeRO-Offload) for real, "
                                 "gradient clipping off unless --validate-clip says, and report measured against "
                                 "predicted per phase (tune.json's validation, validation.png; the measurements "
                                 "themselves in validation-bench.json). The config is written before it starts; "
                                 "Ctrl-C or SIGTERM keeps the rounds that finished."),
    validate_rounds: int = typer.Option(2, min=1, help="With --validate: measure every method this many times, the "
                                        "order reversed every other round (as bench --rounds), each row the median "
                                        "of all its rounds' iterations. One process per row measures the host's "
                                        "moment as much as the schedule."),
    validate_iters: int = typer.Option(12, min=1, help="With --validate: timed iterations per method and round, "
                                       "after 2 of warm-up. A schedule that overlaps backward ends in a short step "
                                       "that swings 2x from one iteration to the next: 12 in each of 2 rounds hold a "
                                       "row's median step to about 6%, where 4 held it to about 10%."),
    neighbours: bool = flag(False, "--neighbours", help="On a GPU: run the pick beside its neighbours, the schedules "
                            "one step from it either way in each main knob (one GPU-lane subgroup fewer and more, the "
                            "next smaller and larger sub_group_size, one resident subgroup fewer and more, "
                            "overlap_backward switched; those predicted over the memory limits left out), in the same "
                            "interleaved rounds as --validate, and record the pick's regret: its measured iteration "
                            "over the fastest measured (tune.json's regret; 1.00x: the pick was fastest). With or "
                            "without --validate."),
    validate_clip: float = typer.Option(0.0, min=0.0, help="With --validate or --neighbours: the gradient clipping "
                                        "the runs train with (0: off, the default). Each row stands beside the "
                                        "prediction of the regime its steps are in, which the model profile's "
                                        "gradient norms tell at this threshold: pass the config's --clip to measure "
                                        "the steps its training will take from freshly initialised weights."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=1, help="GPUs per node the config will train on: "
                                           "what you pass to DeepSpeed's launcher as `deepspeed --num_gpus N` (or the "
                                           "slots=N of each hostfile line). One rank per GPU; the model predicts one "
                                           "rank and what it shares with the node's others. Default 1."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Nodes the config will train on: the hosts of "
                                        "DeepSpeed's hostfile (`deepspeed --hostfile FILE`), or the launches of "
                                        "`deepspeed --no_ssh --node_rank K`. Default 1."),
    hostfile: Optional[Path] = typer.Option(None, help="DeepSpeed's hostfile ('HOST slots=N' per node): tune for the "
                                            "world it describes (its hosts, N GPUs each); every host must resolve."),
    host_memory_budget: str = typer.Option("auto", help="Pinned host memory that the ranks of one node may hold "
                                           "together, GiB; 'auto' = 95% of what the node profile found "
                                           "available, less 2 GiB per rank for the processes themselves. The search "
                                           "keeps within it how many CPU-lane subgroups update during backward "
                                           "(their shadow states cost host memory)."),
    activation_checkpointing: bool = flag(False, "--activation-checkpointing", help="The emitted config "
                                                  "checkpoints every transformer block (DeepSpeed's "
                                                  "activation_checkpointing section); profile the model with it too."),
    json_out: bool = flag(False, "--json", help="Print the tuning result as JSON on stdout."),
    verbose: bool = flag(False, "--verbose", "-v", help="Also print every detail tune.json keeps: the profiles read "
                         "and what stood in for what they lack, every trial's schedule, the predicted phases, and "
                         "with --validate each phase measured and what the host did while it ran."),
):
    """Search the interleaved optimizer's schedule with the fitted performance model and emit a DeepSpeed config.

    Fits the analytic model to a node profile and a model profile, searches sub_group_size, the share of
    subgroups updated on the GPU, staging buffers, CPU threads, how CPU-updated subgroups reach the GPU and
    whether gradients stay on the GPU. By default the schedule may fill the GPU (less a headroom; --max-peak-increase
    holds it to ZeRO-Offload's peak instead, for an equal-memory comparison) and pins no more host memory than the
    node has to spare (`dostune plan` shows beforehand what each offload method needs there). Writes ds_config.json
    (ZeRO-3, optimizer offloaded to pinned CPU memory, plus a 'dostune' section) that plain deepspeed.initialize
    accepts and `dostune train` / `dostune.initialize` run with.
    With --for trainer or --for accelerate the same config carries "auto" where the Hugging Face Trainer or
    Accelerate fill values in (docs/hf.md).

    Several GPUs or nodes: --num-gpus N --nodes M (or --hostfile) tunes one rank of that world, and the config
    records it ("dostune_world"); run it unchanged with `deepspeed --num_gpus N` (and the hostfile for M nodes).
    Launched in another world, `dostune train` stops before building the engine (docs/multi-gpu.md).

    Example: dostune tune --model gpt2-1.3b --trials 50  (after `dostune profile` and `dostune profile --model
    gpt2-1.3b` in this folder)
    """
    opts = TuneOptions(model=model, profile=profile, model_profile=model_profile, trials=trials, sampler=sampler,
                       seed=seed, gpu_memory_budget=gpu_memory_budget,
                       max_peak_increase=parse_fraction(max_peak_increase, "--max-peak-increase")
                       if max_peak_increase is not None else None,
                       micro_batch=micro_batch, precision=precision, lr=lr, clip=clip, regime=regime,
                       output_dir=output_dir,
                       storage=storage, study_name=study_name, target=target,
                       activation_checkpointing=activation_checkpointing, num_gpus=num_gpus, nodes=nodes,
                       hostfile=hostfile, host_memory_budget=host_memory_budget)
    check_options(opts)
    if validate or neighbours:
        what = "--validate" if validate else "--neighbours"
        if opts.world().size > 1:
            raise DostuneError(f"{what} runs the schedules in this one process, not in the world tuned for",
                               hint="measure them under the launcher: deepspeed --num_gpus N --module dostune.bench "
                                    "--config ds_config.json (docs/multi-gpu.md)")
        if not cuda_available():
            raise NotAvailable(f"{what} runs the schedules for real and needs a CUDA GPU",
                               hint=f"leave out {what} on this machine")
        need_deepspeed(f"dostune tune {what}")
    with progress_display() as progress:
        res, ds_config, space = run_tune(opts, progress)
    out = tune_output_dir(opts)
    # the search's result is on disk before a validation starts: one stopped half-way loses neither
    cfg_path = atomic_write_text(out / "ds_config.json", json.dumps(ds_config, indent=2) + "\n")
    save_record(res, out / "tune.json")
    best = res.best
    from ..optim.schedule import ScheduleConfig

    sched = ScheduleConfig.model_validate(best.schedule)
    # the prediction the search scored: with overlap_backward, the CPU lane's work under backward included
    spans = space.predict_schedule(best.sub_group_size, sched, best.predicted.regime or "no_clip").step.spans
    png = plot_timeline(spans, out / "timeline.png", f"predicted update: {model}, sub_group_size "
                        f"{best.sub_group_size:.3g}, {gpu_count(best.subgroups, sched.gpu_fraction)}/{best.subgroups} "
                        "subgroups on the GPU")
    stopped = None
    if validate or neighbours:
        from ..tune.validate import validate as run_validation, validation_details

        near = []
        if neighbours:
            found, left_out = space.neighbours(best.sub_group_size, sched)
            near = [(label, trial_record(space, p)) for label, p in found]
            res.details += [f"neighbour left out of the run: {line}" for line in left_out]
        with progress_display() as progress, quiet_stdout(), stop_signals() as got:
            run = run_validation(res, validate, seq=res.seq or 1024, iters=validate_iters, rounds=validate_rounds,
                                 progress=progress, activation_checkpointing=activation_checkpointing,
                                 clip=validate_clip, neighbours=near)
        res.validation, res.validation_clip = run.rows, validate_clip
        res.regret, res.regret_best = run.regret, run.regret_best
        res.validation_bench = str(save_record(run.bench, out / "validation-bench.json"))
        if run.stopped:
            res.notes.append(run.stopped)
            stopped = got
        if res.validation:
            from ..tune.validation_figure import plot_validation

            res.validation_figure = str(plot_validation(res, out / "validation.png"))
            res.details += validation_details(res)
        save_record(res, out / "tune.json")
    for note in res.notes:
        err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if verbose:
        for line in res.details:
            err_console.print(f"[dim]detail:[/] {line}", highlight=False, soft_wrap=True)
        err_console.print(render_trials(res))
        err_console.print(render_breakdown(res))
        if res.validation:
            err_console.print(render_validation(res))
        w = res.world
        ranks = w["gpus_per_node"]
        err_console.print(f"tuned for {w['nodes']} node(s) x {ranks} GPU(s): times and memory are one rank's; the "
                          f"node's {ranks} rank(s) pin {best.predicted.pinned_host_gib * ranks:.1f} GiB of host "
                          f"memory together" + (f" (budget {res.host_budget_gib:.1f} GiB)"
                                                if res.host_budget_gib is not None else ""), highlight=False)
    err_console.print(render_summary(res))
    if res.regret is not None:
        err_console.print(render_neighbourhood(res))
    figure = f"; measured against predicted: {res.validation_figure}" if res.validation_figure else ""
    err_console.print(f"DeepSpeed config (schedule #1): [bold]{cfg_path}[/]; record: {out / 'tune.json'}; predicted "
                      f"step: {png}{figure}" + ("" if verbose else "; --verbose prints every trial, phase and detail"),
                      highlight=False)
    if json_out:
        print_json(res)
    if stopped is not None:
        err_console.print(f"[yellow]stopped[/] during the validation ({stop_signal(stopped).name}): the config and "
                          "tune.json are written, tune.json's validation holds the rounds that finished",
                          highlight=False)
        raise typer.Exit(stop_code(stopped))
