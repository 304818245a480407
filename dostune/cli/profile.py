"""`dostune profile`: measure the node (and, with --model, a model on it)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..dsconfig import DEFAULT_SUB_GROUP_SIZE
from ..errors import DostuneError
from ..profile.identity import gpu_info, node_name
from ..profile.model import MODEL_EFFORT
from ..profile.node import NODE_REPEATS, NodeProfileOptions, measure_node
from ..profile.paths import MEASURED, node_profile_path
from ..profile.record import node_profile_schema
from ..records import check_writable, save_record
from ..profile.summary import summary_rows
from .common import (err_console, flag, handle_errors, need_deepspeed, print_json, progress_display,
                     quiet_stdout)


_REPEATS, _THOROUGH_REPEATS = NODE_REPEATS["standard"], NODE_REPEATS["thorough"]
_STANDARD, _THOROUGH = MODEL_EFFORT["standard"], MODEL_EFFORT["thorough"]


def _parse_sizes(text: Optional[str], unit: int, what: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        sizes = [int(float(x) * unit) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DostuneError(f"{what}: expected comma-separated numbers, got {text!r}",
                           hint=f"e.g. {what} 4,16,64 (no spaces, or quote the list)") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise DostuneError(f"{what}: sizes must be positive, got {text!r}", hint=f"e.g. {what} 4,16,64")
    return sizes


def render_profile(profile) -> Table:
    mode = f"{profile.mode}, " if profile.mode else ""
    table = Table(title=f"node profile: {profile.name} ({mode}{profile.repeats} repeats)", show_lines=False)
    table.add_column("what", style="bold")
    table.add_column("median", justify="right")
    table.add_column("spread and fit", style="dim")
    for row in summary_rows(profile):
        table.add_row(row.what, row.value, row.detail)
    return table


@handle_errors
def profile(
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Where to write the profile JSON. Default: profiles/NAME.json "
                                          "(with --model: profiles/NAME-MODEL-bB-sS.json), where `dostune tune` "
                                          "looks."),
    name: Optional[str] = typer.Option(None, help="Label for this node, e.g. mynode. Default: the GPU's short name "
                                       "and PCIe generation, e.g. h100-pcie5 (cpu-Nc without a GPU)."),
    thorough: bool = flag(False, "--thorough", help=f"Measure longer, for validation work: {_THOROUGH_REPEATS} repeats "
                          f"instead of {_REPEATS} (with --model: {_THOROUGH.iters} iterations a window instead of "
                          f"{_STANDARD.iters}, the backward probes over {_THOROUGH.probe_seconds:g} s instead of "
                          f"{_STANDARD.probe_seconds:g}). The profile records which mode measured it."),
    repeats: Optional[int] = typer.Option(None, min=1, help="Timed repeats per measurement; medians and min-max "
                                          f"spread are kept. Default: {_REPEATS}, or {_THOROUGH_REPEATS} with "
                                          "--thorough."),
    device: int = typer.Option(0, min=0, help="CUDA device index to profile."),
    quick: bool = flag(False, "--quick", help="Tiny sizes, 2 repeats: a smoke test in seconds, not a usable profile."),
    dtype: str = typer.Option("bf16", help="Half precision the model trains in: bf16 or fp16 (conversion cost)."),
    cpu_adam_threads: Optional[str] = typer.Option(None, help="Comma-separated OpenMP thread counts for CPU Adam. "
                                                   "Default: 1, cores/4, cores/2, 3*cores/4, cores."),
    copy_sizes_mib: Optional[str] = typer.Option(None, help="Comma-separated copy sizes in MiB. Default: 4,16,64,256,1024."),
    no_contention: bool = flag(False, "--no-contention", help="Skip CPU Adam under concurrent DMA."),
    ranks_per_node: Optional[int] = typer.Option(None, min=1, help="Measure this many ranks of the node together, "
                                                 "as `deepspeed --num_gpus N` runs them: CPU Adam in N processes at "
                                                 "once (cores/N threads each), GPUs 0..N-1 copying at once, the DMA "
                                                 "contention with all of them streaming, and the GPUs' PCIe/NUMA "
                                                 "topology. Default: every GPU torch sees (1 without a GPU)."),
    model: Optional[str] = typer.Option(None, help="Profile this model instead of the node: a preset (e.g. "
                                        "gpt2-1.3b), hf:config.json, or package.module:factory."),
    micro_batch: int = typer.Option(8, min=1, help="With --model: micro-batch size."),
    seq: int = typer.Option(1024, min=1, help="With --model: sequence length."),
    sub_group_size: int = typer.Option(DEFAULT_SUB_GROUP_SIZE, min=1, help="With --model: ZeRO-3 sub_group_size whose "
                                       "subgroups' gradient readiness is timed."),
    iters: Optional[int] = typer.Option(None, min=1, help="With --model: timed iterations in each of the step's two "
                                        f"windows (after 2 warm-up). Default: {_STANDARD.iters}, or "
                                        f"{_THOROUGH.iters} with --thorough."),
    probe_seconds: Optional[float] = typer.Option(None, min=0, help="With --model: spread the backward probes over "
                                                  "this many seconds, so that a few slow seconds of the host do not "
                                                  f"set the prediction. Default: {_STANDARD.probe_seconds:g} on a GPU "
                                                  f"({_THOROUGH.probe_seconds:g} with --thorough), 0 (--iters rounds "
                                                  "in a row) without one."),
    plot: Optional[Path] = typer.Option(None, help="With --model: draw the memory timeline to this PNG."),
    activation_checkpointing: bool = flag(False, "--activation-checkpointing", help="With --model: "
                                          "checkpoint every transformer block (recompute its activations "
                                          "in backward), as a run whose config has the section would."),
    force: bool = flag(False, "--force", "-f", help="Overwrite an existing output file."),
    json_out: bool = flag(False, "--json", help="Print the profile as JSON on stdout."),
    schema: bool = flag(False, "--schema", help="Print the profile's JSON schema and exit."),
):
    """Measure this node and write a versioned JSON profile to profiles/, where `dostune tune` finds it.

    Measures PCIe bandwidth (H2D, D2H, both at once, pageable both ways) over sizes, DeepSpeed's CPU Adam over
    sizes and thread counts, the GPU lane's fused Adam, fp32->half conversion on CPU and GPU, and CPU Adam
    slowed down by concurrent DMA. On a node with several GPUs it also measures them together, as the ranks of
    `deepspeed --num_gpus N` use them (--ranks-per-node; docs/multi-gpu.md). Without a GPU only the CPU side is
    measured and the GPU side is reported as not available.

    With --model, profiles that model under DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU instead:
    forward/backward/step times, a GPU memory timeline sampled at module boundaries, when each optimizer
    subgroup's gradients become final in backward, and PCIe traffic per phase; then backward's probes (without
    the gradient copies, with page-locked ones, beside the CPU lane) round after round for --probe-seconds, so
    that a few slow seconds of the host do not set the prediction; with --thorough, the step timed again, a second
    draw of the host's speed (the tuner takes the mean of the two); last, on a GPU, the CPU lane as the step runs it. It
    is written to its own file, named for the node, the model, the micro-batch and the sequence length: the name
    `dostune tune` looks for beside the node profile. For several GPUs or nodes run it under DeepSpeed's
    launcher, as training will run (file name NODE-MODEL-bB-sS-MxN.json; docs/multi-gpu.md):
      deepspeed --num_gpus 2 --module dostune.profile --model gpt2-1.3b

    How long, measured on one H200 (16 cores): the node profile about 30 s; gpt2-1.3b's profile about a minute and a
    half, more for larger models (each iteration runs ZeRO-Offload's step). --thorough takes the counts every
    validation of the performance model used: more repeats, the second window, and for a model about a minute more.

    Examples:
      dostune profile
      dostune profile --model gpt2-1.3b --micro-batch 8 --seq 1024 --plot memory.png
      dostune tune --model gpt2-1.3b
    """
    if schema:
        print_json(node_profile_schema())
        return
    if quick and thorough:
        raise DostuneError("--quick and --thorough contradict each other",
                           hint="--quick is a smoke test in seconds, --thorough a longer profile: give one")
    if model is not None:
        if quick:
            raise DostuneError("--quick profiles the node, not a model",
                           hint="leave out --quick; --iters 1 --probe-seconds 0 is the shortest model profile")
        _profile_model(model, micro_batch, seq, dtype, sub_group_size, iters, name, output, plot, force, json_out,
                       activation_checkpointing, probe_seconds, "thorough" if thorough else "standard")
        return
    opts = (NodeProfileOptions.tiny() if quick else NodeProfileOptions.thorough() if thorough
            else NodeProfileOptions())
    opts.name, opts.device, opts.half_dtype = name, device, dtype
    if repeats is not None:
        opts.repeats = repeats
    opts.contention = not no_contention
    opts.ranks_per_node = ranks_per_node
    opts.cpu_adam_threads = _parse_sizes(cpu_adam_threads, 1, "--cpu-adam-threads") or opts.cpu_adam_threads
    opts.copy_sizes_bytes = _parse_sizes(copy_sizes_mib, 1 << 20, "--copy-sizes-mib") or opts.copy_sizes_bytes
    opts.validate()
    # Everything that can refuse the output refuses it now: measuring takes minutes on a GPU node.
    path = _output_path(output, force, lambda: node_profile_path(opts.name or node_name(gpu_info(device))))
    need_deepspeed("dostune profile")
    with progress_display() as progress, quiet_stdout():
        prof = measure_node(opts, progress)
    save_record(prof, path)
    err_console.print(render_profile(prof))
    for note in prof.notes:
        err_console.print(f"[yellow]note:[/] {note}")
    err_console.print(f"profile written to [bold]{path}[/]")
    if json_out:
        print_json(prof)


def _output_path(output: Optional[Path], force: bool, default_path) -> Path:
    """The file the profile goes to, checked before any measuring: not there yet (or --force), and writable."""
    path = output or default_path()
    if path.exists() and not path.is_dir() and not force:
        from ..profile.paths import profiles_dir

        if path.resolve().parent == profiles_dir().resolve():  # a checkout's profiles/ holds the shipped ones
            raise DostuneError(f"{path} already exists: it is a profile dostune ships",
                               hint="give this node another --name (e.g. --name mynode), or --force to replace it")
        raise DostuneError(f"{path} already exists", hint="pass --force to overwrite it or choose another --output")
    return check_writable(path, "--output")


def render_model_profile(p) -> Table:
    world = f", {p.world_size} ranks on {p.world.nodes} node(s), the slowest rank's" if p.world_size > 1 else ""
    mode = f"; {p.mode}: {p.iterations} iterations a window, probes over {p.probe_seconds:g} s" \
        if p.mode and p.probe_seconds is not None else ""
    t = Table(title=f"model profile: {p.model} (micro-batch {p.micro_batch}, seq {p.seq}, {p.precision}{world}) on "
                    f"{p.node}{mode}")
    for col in ("phase", "time s (median)", "spread", "peak alloc GiB", "min alloc GiB", "free GiB", "PCIe tx/rx GB/s"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for ph, x in p.phases.items():
        traffic = p.pcie.get(ph) if p.pcie else None
        t.add_row(ph, f"{x.time_s.median:.3f}", f"{x.time_s.lo:.3f}-{x.time_s.hi:.3f}", f"{x.peak_allocated_gib:.2f}",
                  f"{x.min_allocated_gib:.2f}", "-" if x.free_gib is None else f"{x.free_gib:.1f}",
                  f"{traffic.tx_gbps:.1f}/{traffic.rx_gbps:.1f}" if traffic else "-")
    return t


def _profile_model(model, micro_batch, seq, dtype, sub_group_size, iters, node, output, plot, force, json_out,
                   activation_checkpointing=False, probe_seconds=None, mode="standard"):
    from ..models.registry import resolve_model
    from ..perfmodel.world import World, rank
    from ..profile.timing import NullProgress
    from ..profile.memory_figure import plot_memory_timeline
    from ..profile.model import ModelProfileOptions, measure_model, model_profile_name

    opts = ModelProfileOptions.of_mode(mode, model=model, micro_batch=micro_batch, seq=seq, precision=dtype,
                                       sub_group_size=sub_group_size, iters=iters, node=node,
                                       activation_checkpointing=activation_checkpointing, probe_seconds=probe_seconds)
    opts.validate()
    if dtype not in ("bf16", "fp16", "fp32"):
        raise DostuneError(f"--dtype must be bf16, fp16 or fp32 for a model profile, got {dtype!r}",
                           hint="profile the precision the model will train in (bf16 unless told)")
    spec = resolve_model(model)
    spec.check_seq(seq)

    def default_path() -> Path:
        # the name `dostune tune` looks for beside the node profile, which has the same node name by default
        label = node or node_name(gpu_info(0))
        return MEASURED / model_profile_name(label, model, micro_batch, seq, World.of_run())

    path = _output_path(output, force, default_path)
    if plot is not None:
        check_writable(plot, "--plot")
    need_deepspeed("dostune profile --model")
    # under the launcher rank 0 alone shows progress
    shown = progress_display() if rank() == 0 else contextlib.nullcontext(NullProgress())
    with shown as progress, quiet_stdout():
        prof = measure_model(opts, progress)
    if rank() != 0:  # under the launcher every rank measured; rank 0 writes what they measured together
        return
    save_record(prof, path)
    err_console.print(render_model_profile(prof))
    ready = [s.grad_ready_s for s in prof.subgroups if s.grad_ready_s is not None]
    err_console.print(f"{prof.params / 1e9:.3f}B parameters in {prof.num_subgroups} subgroups of up to "
                      f"{max(s.numel for s in prof.subgroups) / 1e6:.1f}M elements; optimizer state "
                      f"{prof.optimizer_state_bytes / 2**30:.1f} GiB on the host; gradients final between "
                      + (f"{min(ready):.3f} and {max(ready):.3f} s into backward" if ready else "(not recorded)"))
    if prof.later_window is not None:
        later = prof.later_window
        err_console.print(f"ZeRO-Offload's step: {prof.phases['step'].time_s.median:.3f} s, and "
                          f"{later.step_s.median:.3f} s timed again {later.after_s:.0f} s later (the model takes the mean)")
    if prof.step_lane is not None:
        err_console.print(prof.step_lane.describe())
    for note in prof.notes:
        err_console.print(f"[yellow]note:[/] {note}")
    if plot is not None:
        err_console.print(f"memory timeline drawn to [bold]{plot_memory_timeline(prof, plot)}[/]")
    err_console.print(f"model profile written to [bold]{path}[/]")
    if json_out:
        print_json(prof)
