"""The `dostune` command line: a thin layer over the library API."""
from __future__ import annotations

from typing import Optional

import typer

from .._version import __version__
from . import bench as _bench
from . import check as _check
from . import profile as _profile
from . import train as _train
from . import tune as _tune

app = typer.Typer(
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
def _root(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                 help="Print the version and exit.")):
    """Sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set already (it must be set
    before CUDA starts; `dostune.initialize` users set it themselves)."""
    import os

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF_DEFAULT)


app.command("profile")(_profile.profile)
app.command("tune")(_tune.tune)
app.command("train")(_train.train)
app.command("bench")(_bench.bench)
app.command("check")(_check.check)


def main() -> None:
    import warnings

    # torch.distributed's deprecation notices, raised from inside DeepSpeed on every step, drown the output.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.jit")
    app()


if __name__ == "__main__":
    main()
