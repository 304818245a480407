"""The `dostune` command line: a thin layer over the library API."""
from __future__ import annotations

import os
import sys
from typing import Optional

import typer
from typer import _click as click
from typer.core import TyperCommand, TyperGroup

from .._version import __version__
from ..profile.identity import cuda_available

# DeepSpeed prints "Setting accelerator to CPU. If you have GPU ..." at import on a machine without a GPU: name
# the accelerator it would pick anyway, before any command imports it (DS_ACCELERATOR set by the user wins).
if "DS_ACCELERATOR" not in os.environ and not cuda_available():
    os.environ["DS_ACCELERATOR"] = "cpu"

from . import bench as _bench
from . import check as _check
from . import ops as _ops
from . import plan as _plan
from . import profile as _profile
from . import refit as _refit
from . import train as _train
from . import tune as _tune
from .common import err_console, help_width, print_error

class _FlagHelp:
    """--help is a flag: typer 0.29 shows it with a '<bool>' value placeholder; show it without, like our flags.
    Help printed to a pipe or a log is as wide as the text needs (rich would cut it at 80 columns with '…')."""

    def get_help_option(self, ctx):
        opt = super().get_help_option(ctx)
        if opt is not None:
            opt.metavar = ""
        return opt

    def format_help(self, ctx, formatter):
        from typer import rich_utils

        width = help_width(sys.stdout)
        if width is None or rich_utils.MAX_WIDTH is not None:  # a terminal, COLUMNS or TERMINAL_WIDTH: theirs
            return super().format_help(ctx, formatter)
        rich_utils.MAX_WIDTH = width
        try:
            return super().format_help(ctx, formatter)
        finally:
            rich_utils.MAX_WIDTH = None

    def parse_args(self, ctx, args):
        """Some usage errors (an option given without its value) come from the parser without the command they
        belong to: name it, so the hint points at that command's --help."""
        try:
            return super().parse_args(ctx, args)
        except click.exceptions.UsageError as e:
            if e.ctx is None:
                e.ctx, e.cmd = ctx, ctx.command
            raise


class _Command(_FlagHelp, TyperCommand):
    pass


class _Group(_FlagHelp, TyperGroup):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """A usage error (unknown option, a value out of range, a missing required option) is one line plus a
        hint, exit 2, like every other refusal, instead of typer's usage text and boxed panel."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `dostune` alone: the help, as typer shows it
                e.show()
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            where = f"`{ctx.command_path} --help`" if ctx is not None else "`dostune --help`"
            print_error(e.format_message(), f"{where} lists the options")
            sys.exit(e.exit_code)
        except typer.Abort:  # Ctrl-C at a prompt (typer bundles its own click: its Abort lives here)
            err_console.print("aborted")
            sys.exit(1)
        code = rv if isinstance(rv, int) else 0
        if code == 0:  # not after a failure: a rank that failed may leave peers inside a collective
            from ..train.engine import leave_launchers_world

            leave_launchers_world()
        sys.exit(code)


app = typer.Typer(
    cls=_Group,
    name="dostune",
    help="Deep Optimizer States for DeepSpeed ZeRO-3: profile a node, tune the interleaved CPU+GPU "
         "optimizer schedule, train with it, and benchmark it against DeepSpeed's offload.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool):
    if value:
        typer.echo(f"dostune {__version__}")
        raise typer.Exit()


# Measured on the H100 (gpt2-1.3b, tuned schedule): 0.714 s -> 0.660 s per iteration, mostly backward.
# The interleaved step allocates and frees large staging and gradient buffers every iteration; with the
# default allocator their segments fragment under the activations and allocations start to retry.
ALLOC_CONF_DEFAULT = "expandable_segments:True"


@app.callback()
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True, metavar="",
                                                 help="Print the version and exit.")):
    """Sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set already (it must be set
    before CUDA starts; `dostune.initialize` users set it themselves)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF_DEFAULT)


app.command("profile", cls=_Command)(_profile.profile)
app.command("tune", cls=_Command)(_tune.tune)
app.command("plan", cls=_Command)(_plan.plan)
app.command("refit", cls=_Command)(_refit.refit)
app.command("train", cls=_Command)(_train.train)
app.command("bench", cls=_Command)(_bench.bench)
app.command("check", cls=_Command)(_check.check)
_ops.app.command("build", cls=_Command)(_ops.build)
_ops.app.command("status", cls=_Command)(_ops.status)
app.add_typer(_ops.app, name="ops", cls=_Group)


def quiet_known_warnings() -> None:
    """Warnings the libraries raise that say nothing to a dostune user, silenced for the CLI's processes (a bench
    method's process takes the parent's filters)."""
    import warnings

    # torch.distributed's deprecation notices, raised from inside DeepSpeed on every step, drown the output.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")
    # DeepSpeed binds no device to a world of one on purpose (init_process_group's device_id makes every later group
    # split NCCL's communicator), and torch then warns at the engine's first barrier, in every bench process
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                            category=UserWarning)


def main() -> None:
    """The process's entry point: the `dostune` script, and `python -m dostune.train` on a launcher's ranks. A rank
    that closed its launcher's world (it succeeded, or train stopped every rank at one step) ends without the
    interpreter's teardown (train.engine.exit_skipping_teardown says why); `app`
    only raises SystemExit, which a script that calls it may catch."""
    quiet_known_warnings()
    try:
        app()
    except SystemExit as e:
        from ..train.engine import exit_skipping_teardown, left_launchers_world

        if left_launchers_world():
            exit_skipping_teardown(e.code if isinstance(e.code, int) else 0)
        raise


if __name__ == "__main__":
    main()
