"""`dostune ops`: build the compiled ops runs load, once per Python environment (dostune/ops.py)."""
from __future__ import annotations

import sys

import typer

from .. import ops as _ops
from .common import err_console, handle_errors, need_deepspeed, quiet_stdout

app = typer.Typer(
    name="ops",
    help="The compiled ops dostune runs load (DeepSpeed's CPU Adam, dostune's CPU kernel): build them once for "
         "this Python environment, or see where they are.",
    no_args_is_help=True,
    add_completion=False,
)


def _where(path) -> str:
    return str(path) if path is not None else "not built (the first run builds it: a minute or two)"


@handle_errors
def build():
    """Build every op a run here loads, into this Python environment's own folder.

    DeepSpeed compiles its CPU Adam (and, without a GPU, its shared-memory all-reduce) on first use, which takes a
    minute or two; dostune compiles its CPU kernel in seconds. Run this once after installing dostune (the
    repository's install script does): runs then load the ops without compiling or locking anything, and two
    environments on one machine keep separate builds. An op already built is left as it is. The folder:
    <environment>/var/cache/dostune, or DOSTUNE_OPS_DIR where set.

    Example: dostune ops build
    """
    need_deepspeed("dostune ops build")

    def done(op: _ops.BuiltOp) -> None:
        how = f"built in {op.seconds:.0f} s" if op.seconds is not None else "already built"
        err_console.print(f"{op.title} ({op.name}): {how}: {op.path}", highlight=False, soft_wrap=True)

    with quiet_stdout():
        _ops.build_all(done)
    err_console.print(f"runs in this environment ({sys.prefix}) load these; nothing is compiled at run time",
                      highlight=False, soft_wrap=True)


@handle_errors
def status():
    """Say where each op a run here loads is built, or that the first run will build it.

    Example: dostune ops status
    """
    from ..optim import cpu_kernel

    need_deepspeed("dostune ops status")
    with quiet_stdout():
        found = _ops.deepspeed_op_status()
    for name, title, path in found:
        err_console.print(f"{title} ({name}): {_where(path)}", highlight=False, soft_wrap=True)
    kernel = cpu_kernel.built_path()
    err_console.print(f"{cpu_kernel.TITLE} (cpu_adam_oop): {_where(kernel)}", highlight=False, soft_wrap=True)
    missing = sum(p is None for *_, p in found) + (kernel is None)
    if missing:
        err_console.print("`dostune ops build` builds what is missing", highlight=False)
