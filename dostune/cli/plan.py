"""`dostune plan`: what each offload method needs in host RAM, pinned memory and GPU memory on a node, and whether it
fits, before anything is allocated."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..optim.schedule import ScheduleConfig, gpu_count, make_plan, updates_in_backward
from ..plan import MemoryPlan, MethodNeeds, describe_world, memory_plan
from ..records import atomic_write_text, check_writable
from ..tune.limits import GPU_HEADROOM_SHARE
from ..tune.search import TuneOptions
from .common import err_console, flag, handle_errors, print_json, progress_display


def _gib(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def _verdict(r: MethodNeeds) -> str:
    return "fits" if r.fits else "does not fit: " + " and ".join(r.short_of)


def render_plan(plan: MemoryPlan) -> Table:
    ranks = plan.ranks
    world = f", {describe_world(plan.world)}" if ranks > 1 or plan.world["nodes"] > 1 else ""
    ac = ", activation checkpointing" if plan.activation_checkpointing else ""
    t = Table(title=f"memory each method needs: {plan.model} ({plan.params / 1e9:.2f}B parameters, {plan.precision}, "
                    f"micro-batch {plan.micro_batch}{ac}) on {plan.node}{world}")
    per = " (rank / node)" if ranks > 1 else ""
    for col in ("method", f"host RAM GiB{per}", f"pinned GiB{per}", "GPU peak GiB", "fits"):
        t.add_column(col, justify="left" if col in ("method", "fits") else "right")
    for r in plan.methods:
        host = _gib(r.host_gib) + (f" / {_gib(r.host_gib * ranks)}" if ranks > 1 else "")
        pinned = _gib(r.pinned_gib) + (f" / {_gib(r.pinned_gib * ranks)}" if ranks > 1 else "")
        gpu = (">= " if r.gpu_peak_floor and r.gpu_peak_gib is not None else "") + _gib(r.gpu_peak_gib)
        t.add_row(r.label, host, pinned, gpu, _verdict(r))
    return t


def plan_lines(plan: MemoryPlan) -> list[str]:
    """What the table rests on and what to do with it, a line each."""
    gpu = "" if plan.gpu_gib is None else (f"; GPU {plan.gpu_gib:.1f} GiB, of which a method's peak may take "
                                           f"{plan.gpu_usable_gib:.1f} ({GPU_HEADROOM_SHARE:.0%} kept as headroom)")
    out = [f"{plan.node}: {plan.host_available_gib:.1f} GiB of host memory available when profiled, of which the "
           f"node's {plan.ranks} rank(s) may take {plan.host_usable_gib:.1f} GiB together{gpu}"]
    if plan.twin_flow_ratios is not None:
        lo, hi = plan.twin_flow_ratios
        out.append(f"Twin-Flow fits here at offload_optimizer.ratio {lo:g} to {hi:g} (the share of the optimizer "
                   "state offloaded: the lower, the more of it on the GPU and the less on the host)")
    d = next(r for r in plan.methods if r.method == "dostune")
    if d.schedule is not None and d.subgroups is not None:
        s, sched = d.schedule, ScheduleConfig.model_validate(d.schedule)
        k = gpu_count(d.subgroups, s["gpu_fraction"])
        resident = s.get("resident_subgroups", 0)
        what = (f"{d.label}: sub_group_size {d.sub_group_size:.3g}, {k}/{d.subgroups} subgroups on the GPU lane"
                + (f" ({resident} resident)" if resident else "")
                + (", the CPU lane during backward" if updates_in_backward(make_plan(d.subgroups, sched), sched)
                   else ""))
        if s.get("speculative_subgroups") is not None:
            what += f" ({s['speculative_subgroups']} of its subgroups speculating, as many as the host holds)"
        if d.predicted_iter_s is not None:
            what += f"; predicted iteration {d.predicted_iter_s:.3f} s"
            zo = plan.zero_offload_iter_s
            if zo:
                what += f", ZeRO-Offload's {zo:.3f} s ({zo / d.predicted_iter_s:.2f}x)"
        out.append(what)
    return out


@handle_errors
def plan(
    model: str = typer.Option("gpt2-1.3b", help="Model preset or package.module:factory."),
    profile: Optional[Path] = typer.Option(None, help="Node profile (dostune profile). Default: profiles/NODE.json, "
                                           "this node's; without a GPU, the shipped H100 profile."),
    model_profile: Optional[Path] = typer.Option(None, help="Model profile (dostune profile --model). Default: "
                                                 "NODE-MODEL-bB-sS.json beside the node profile, if any; without "
                                                 "one the GPU peaks are floors and the plan says so."),
    micro_batch: Optional[int] = typer.Option(None, min=1, help="Micro-batch (default: the model profile's, else 8)."),
    seq: Optional[int] = typer.Option(None, min=1, help="Sequence length of the model profile to read."),
    precision: Optional[str] = typer.Option(None, help="bf16, fp16 or fp32 (default: the model profile's, else "
                                            "bf16)."),
    activation_checkpointing: bool = flag(False, "--activation-checkpointing", help="Plan for every transformer "
                                                  "block checkpointed; the model profile should be measured that "
                                                  "way (the plan notes it when it is not)."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=1, help="GPUs (ranks) per node: each rank holds "
                                           "its partition of the state, the node's host memory holds them all. "
                                           "Default 1."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Nodes (the partition is over every rank). "
                                        "Default 1."),
    hostfile: Optional[Path] = typer.Option(None, help="DeepSpeed's hostfile ('HOST slots=N' per node): plan for the "
                                            "world it describes."),
    host_memory_budget: str = typer.Option("auto", help="Host memory the node's ranks may take together besides "
                                           "their processes, GiB; 'auto' = 95% of what the node profile found "
                                           "available, less 2 GiB per rank (as dostune tune)."),
    trials: int = typer.Option(100, min=1, help="Trials of the tuner's search for dostune's pick."),
    seed: int = typer.Option(0, help="Sampler seed of that search."),
    config_out: Optional[Path] = typer.Option(None, "--config-out", help="Also write dostune's pick as a DeepSpeed "
                                              "config here (as dostune tune's ds_config.json), when it fits."),
    json_out: bool = flag(False, "--json", help="Print the plan as JSON on stdout."),
):
    """Show what each way of offloading the optimizer state needs on a node, and whether it fits, before anything
    is allocated.

    For DeepSpeed ZeRO-Offload with its host buffers pinned and pageable (offload_optimizer.pin_memory), Twin-Flow
    keeping as much of the optimizer state on the GPU as fits (offload_optimizer.ratio), and dostune's pick (the
    search `dostune tune` runs, nothing written): the host RAM, the pinned memory and the peak GPU memory each needs
    on one rank and on the node, and whether it fits, naming what it runs short of. Reads the profiles only: it runs
    on a machine without a GPU. Without a model profile the GPU peaks are floors, and the plan says what it
    estimated and from what.

    Example: llama-13b with activation checkpointing on an H200 node, from the shipped profile:

      dostune plan --model llama-13b --activation-checkpointing --profile profiles/h200-pcie5.json

    The same model on a node of 4 GPUs (each rank holds a quarter of the state; the node's host memory all four):

      dostune plan --model llama-13b --activation-checkpointing --profile NODE.json --num-gpus 4
    """
    if config_out is not None:
        check_writable(config_out, "--config-out")
    opts = TuneOptions(model=model, profile=profile, model_profile=model_profile, micro_batch=micro_batch, seq=seq,
                       precision=precision, activation_checkpointing=activation_checkpointing, num_gpus=num_gpus,
                       nodes=nodes, hostfile=hostfile, host_memory_budget=host_memory_budget, trials=trials,
                       seed=seed)
    with progress_display() as progress:
        res, ds_config = memory_plan(opts, progress)
    err_console.print(render_plan(res))
    for line in plan_lines(res):
        err_console.print(line, highlight=False, soft_wrap=True)
    for line in res.estimated:
        err_console.print(f"[dim]estimated:[/] {line}", highlight=False, soft_wrap=True)
    for note in res.notes:
        err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if config_out is not None:
        if ds_config is None:
            err_console.print(f"[yellow]note:[/] dostune's pick does not fit here: {config_out} not written",
                              highlight=False, soft_wrap=True)
        else:
            atomic_write_text(config_out, json.dumps(ds_config, indent=2) + "\n")
            err_console.print(f"dostune's pick written to [bold]{config_out}[/]", highlight=False)
    if json_out:
        print_json(res)
