"""`dostune refit`: carry a tuned config's schedule over to another model."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from ..errors import DostuneError
from ..models.registry import resolve_model
from ..optim.schedule import ScheduleConfig
from ..records import atomic_write_text, check_writable, read_json_record
from ..tune.refit import refit as run_refit
from .common import err_console, flag, handle_errors, print_json


@handle_errors
def refit(
    config: Path = typer.Option(..., help="A DeepSpeed config with a dostune section, e.g. the ds_config.json "
                                "`dostune tune` wrote for another model."),
    model: str = typer.Option(..., help="The model to run it on: a preset, hf:config.json, or package.module:factory."),
    output: Path = typer.Option(..., "--output", "-o", help="Where to write the refitted config."),
    sub_group_size: Optional[int] = typer.Option(None, min=1, help="ZeRO-3 sub_group_size for the new model. "
                                                 "Default: one that gives about as many subgroups as the schedule "
                                                 "was tuned for."),
    micro_batch: Optional[int] = typer.Option(None, min=1, help="Micro-batch per GPU (default: the config's)."),
    force: bool = flag(False, "--force", "-f", help="Overwrite an existing output file."),
    json_out: bool = flag(False, "--json", help="Print the refitted config as JSON on stdout."),
):
    """Carry a tuned schedule over to another model: same shape, counts scaled to the new model's subgroups.

    A dostune section is tuned for one model's subgroups: on another model its resident and swing counts may
    not fit (`dostune train` refuses it before building anything). This keeps the schedule's shape (the GPU
    lane's share, staging buffers, upload path, gradients on the GPU, overlap with backward), picks a
    sub_group_size, and scales the subgroup counts the way the tuner sets them. The result runs; it is not
    a tuning result: for the new model's best schedule, profile it and run `dostune tune`.

    Example (the CPU quick start: the schedule tuned for gpt2-1.3b on a model a laptop trains):
      dostune refit --config runs/tune/gpt2-1.3b/ds_config.json --model gpt2-tiny --micro-batch 2 -o tiny.json
    """
    if output.exists() and not output.is_dir() and not force:
        raise DostuneError(f"{output} already exists", hint="pass --force to overwrite it or choose another --output")
    check_writable(output, "--output")
    data = read_json_record(config, "DeepSpeed config")
    spec = resolve_model(model)
    res = run_refit(data, spec, str(config), sub_group_size=sub_group_size, micro_batch=micro_batch,
                    world_size=int(os.environ.get("WORLD_SIZE", "1")))
    atomic_write_text(output, json.dumps(res.ds_config, indent=2) + "\n")
    for note in res.notes:
        err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    sched = ScheduleConfig.from_ds_config(res.ds_config)
    gpu = round(sched.gpu_fraction * res.subgroups + 1e-9)
    tuned = f"tuned for {res.tuned_subgroups} subgroups" if res.tuned_subgroups else "schedule"
    err_console.print(f"{config} ({tuned}) refitted to {model}: {res.subgroups} subgroups, {gpu} in the GPU lane"
                      + (f" ({sched.resident_subgroups} resident)" if sched.resident_subgroups else "")
                      + f"; written to [bold]{output}[/]", highlight=False, soft_wrap=True)
    if json_out:
        print_json(res.ds_config)
