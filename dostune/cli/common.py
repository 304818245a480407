"""Shared CLI plumbing: consoles, error handling, progress bars."""
from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..errors import DostuneError

# People read stderr (tables, progress); machines read stdout when --json is given.
err_console = Console(stderr=True)
out_console = Console()


def fail(message: str, code: int = 2, hint: str | None = None) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    if hint:
        err_console.print(f"[dim]hint: {hint}[/]", highlight=False)
    raise typer.Exit(code)


def handle_errors(fn: Callable) -> Callable:
    """Turn DostuneError into a one-line message and an exit code; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DostuneError as e:
            fail(str(e), e.exit_code, e.hint)
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130)

    return wrapper


def print_json(obj: Any) -> None:
    if hasattr(obj, "model_dump_json"):
        sys.stdout.write(obj.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


class RichProgress:
    """ProgressSink backed by a rich progress display: one bar per measurement phase."""

    def __init__(self, console: Console = err_console):
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False)
        self._task = None

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._finish_current()
        return self._progress.__exit__(*exc)

    def _finish_current(self):
        if self._task is not None:
            t = self._progress.tasks[self._task]
            self._progress.update(self._task, completed=t.total)

    def start(self, description: str, total: int) -> None:
        self._finish_current()
        self._task = self._progress.add_task(description, total=max(total, 1))

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)
