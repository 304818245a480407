"""Shared CLI plumbing: consoles, error handling, progress bars."""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..deepspeed_support import StderrWithoutBuildNotes, stdout_to_stderr
from ..errors import DostuneError

# Width when stderr is not a terminal (a log, CI, a pipe): rich's default of 80 columns would cut the tuning
# tables to "5e…"; a log has no width, so give the tables room (COLUMNS still wins when set).
LOG_WIDTH = 200
# Width of --help when stdout is not a terminal (`dostune tune --help | less`, a log): at 80 columns rich cuts
# option names and defaults to "--activation-checkpoi…"; the help text's own lines are up to ~110 columns.
HELP_WIDTH = 120


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    width = None if tty or os.environ.get("COLUMNS") else LOG_WIDTH
    return Console(stderr=stderr, width=width)


def help_width(stream) -> int | None:
    """The width of --help on ``stream``: None (rich's choice) on a terminal or with COLUMNS set, else HELP_WIDTH."""
    tty = hasattr(stream, "isatty") and stream.isatty()
    return None if tty or os.environ.get("COLUMNS") else HELP_WIDTH


# People read stderr (tables, progress); machines read stdout when --json is given.
err_console = _console(stderr=True)
out_console = _console(stderr=False)


def print_error(message: str, hint: str | None = None) -> None:
    """One line for the problem and at most one for the hint, never wrapped into more (a log greps by line)."""
    err_console.print(f"[bold red]error:[/] {_one_line(message)}", highlight=False, soft_wrap=True)
    if hint:
        err_console.print(f"[dim]hint: {_one_line(hint)}[/]", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2, hint: str | None = None) -> None:
    print_error(message, hint)
    raise typer.Exit(code)


def _one_line(text: str) -> str:
    from rich.markup import escape

    return escape(" ".join(str(text).split()))


def handle_errors(fn: Callable) -> Callable:
    """Turn DostuneError (and a file-system error nobody foresaw) into a one-line message, a hint (the
    command's --help where the error brings none) and an exit code; Ctrl-C into exit 130. DOSTUNE_DEBUG=1 shows
    the traceback instead."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DostuneError as e:
            if os.environ.get("DOSTUNE_DEBUG"):
                raise
            fail(str(e), e.exit_code, e.hint or f"`dostune {fn.__name__} --help` describes every option")
        except OSError as e:
            if os.environ.get("DOSTUNE_DEBUG"):
                raise
            where = f": {e.filename}" if e.filename else ""
            fail(f"{e.strerror or e}{where}", 2, "DOSTUNE_DEBUG=1 shows where it happened")
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130)

    return wrapper


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """Within: SIGTERM (a job scheduler's stop, `timeout`'s) raises KeyboardInterrupt as Ctrl-C does, so that long
    work which catches it keeps what it finished. Yields the list of the signals received; exit with
    ``stop_code`` of it."""
    got: list[int] = []

    def stop(signum, frame):
        got.append(signum)
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def stop_signal(got: list[int]) -> signal.Signals:
    """The signal that stopped a command: the first of ``got``, SIGINT (Ctrl-C) where none was caught."""
    return signal.Signals(got[0] if got else signal.SIGINT)


def stop_code(got: list[int]) -> int:
    """The exit code of a command stopped by ``stop_signal(got)``: 128 + the signal, as a shell reports it."""
    return 128 + stop_signal(got)


def parse_fraction(text: str | float, option: str) -> float:
    """The one rule for shares and tolerances on the command line: '10%' or 0.1 (a bare number is a fraction,
    so above 1 it must carry '%', else '10' would silently mean 1000%)."""
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise DostuneError(f"{option}: expected a percentage like 10% or a fraction like 0.1, got {text!r}",
                           hint=f"e.g. {option} 10%") from None
    if value != value or value < 0:
        raise DostuneError(f"{option} must be a non-negative share, got {text!r}",
                           hint=f"a share is 0 or more, e.g. {option} 10%")
    if not t.endswith("%") and value > 1:
        raise DostuneError(f"{option} {t} is ambiguous: a bare number is a fraction (0.1 = 10%)",
                           hint=f"write {t}% for {t} percent, or {value / 100:g} for the same as a fraction")
    return value


def flag(default: bool, *names: str, help: str) -> Any:
    """A boolean option shown as a flag (no '<bool>' value placeholder in --help)."""
    return typer.Option(default, *names, help=help, metavar="")


def print_json(obj: Any) -> None:
    if hasattr(obj, "model_dump_json"):
        sys.stdout.write(obj.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def elapsed_text(seconds: float) -> str:
    """H:MM:SS, as rich's progress display shows a task's time."""
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class LogProgress:
    """The commands' progress where stderr is a log, a pipe or CI rather than a terminal: a line as each phase ends,
    with its count and time, written at once. A live display cannot redraw there: it writes nothing until it stops,
    which leaves the log of a ten-minute `tune --validate` empty until its end, and empty for good if it is killed."""

    def __init__(self, console: Console):
        self._console = console
        self._task = None  # [description, total, done, started]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._finish_current()
        return False

    def _finish_current(self):
        if self._task is not None:
            description, total, done, started = self._task
            self._console.print(f"  {description}  {done}/{total}  {elapsed_text(time.monotonic() - started)}",
                                markup=False, highlight=False, soft_wrap=True)
            self._console.file.flush()
            self._task = None

    def start(self, description: str, total: int) -> None:
        self._finish_current()
        self._task = [description, max(total, 1), 0, time.monotonic()]

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._task[2] += n


class RichProgress:
    """ProgressSink backed by a rich progress display: one bar per measurement phase. The display starts with the
    first phase, so a command refused before any work prints its error alone."""

    def __init__(self, console: Console = err_console):
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False)
        self._task = None
        self._live = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._live:
            return False
        self._finish_current()
        if isinstance(sys.stdout, StderrWithoutBuildNotes):
            sys.stdout.flush()
        return self._progress.__exit__(*exc)

    def _finish_current(self):
        if self._task is not None:
            t = self._progress.tasks[self._task]
            self._progress.update(self._task, completed=t.total)

    def start(self, description: str, total: int) -> None:
        if not self._live:
            self._progress.__enter__()
            self._live = True
            _quiet_live_stdout()
        self._finish_current()
        self._task = self._progress.add_task(description, total=max(total, 1))

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)


def progress_display(console: Console = err_console) -> RichProgress | LogProgress:
    """The commands' progress: rich's live bars on a terminal, a line per finished phase anywhere else."""
    return RichProgress(console) if console.is_terminal else LogProgress(console)


def need_deepspeed(purpose: str) -> None:
    """Refuse an untested DeepSpeed before any work (one line); show the note when the user overrode that."""
    from ..deepspeed_support import check_deepspeed

    note = check_deepspeed(purpose)
    if note:
        err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _quiet_live_stdout() -> None:
    """A live display started inside quiet_stdout on a terminal puts its own stdout in front (rich's FileProxy,
    which prints through the display's console): drop DeepSpeed's note there too. The display puts back what it
    found when it stops."""
    from rich.file_proxy import FileProxy

    if isinstance(sys.stdout, FileProxy) and isinstance(sys.stdout.rich_proxied_file, StderrWithoutBuildNotes):
        sys.stdout = StderrWithoutBuildNotes(sys.stdout)


def quiet_stdout():
    """Inside: what third-party code prints to stdout goes to stderr, so that stdout carries only the --json
    output a script reads; DeepSpeed's "... op built successfully" is dropped (a failed build still raises)."""
    return stdout_to_stderr()
