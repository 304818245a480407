"""The records that flow between dostune's stages (profiles, tuning results, bench results) share one base and
one way to and from JSON: every file is read with one message per problem (missing, empty, binary, wrong kind of
record, a schema version this dostune does not read, a field that does not validate) and written atomically with
the usual file mode. The record types themselves live with the stage that writes them (profile/record.py,
profile/model_record.py, tune/record.py, bench/record.py)."""
from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Callable, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import DostuneError, ProfileError


class Record(BaseModel):
    """The base of every record: unknown keys are an error, so a typo in a hand-edited file never passes silently."""

    model_config = ConfigDict(extra="forbid")


class Span(Record):
    """One piece of lane work of an optimizer step, in seconds from the step's start: traced by the optimizer and
    stored by bench. (The performance model's simulator keeps its own lighter dataclass, which adds each copy's
    PCIe traffic: it builds thousands of them per tuning candidate.)"""

    lane: str  # cpu, h2d, gpu, d2h, up
    subgroup: int
    start: float
    end: float


class SetAside(Record):
    """Timed iterations a measurement set aside because the hypervisor took more than host_steal.QUIET_BELOW of the
    CPU while they ran (another ran in the place of each): written by the model profile and bench."""

    runs: int = 0
    steal: list[float] = Field(default_factory=list)  # each one's share of steal
    seconds: list[float] = Field(default_factory=list)  # each one's length: against the kept ones, what steal cost
    waited_s: float = 0.0  # seconds spent watching the host for a quiet moment before running again

    @classmethod
    def of(cls, parts: "list[SetAside | None]") -> "SetAside | None":
        """Several measurements' (a bench's rounds) as one; None when none of them recorded any."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return cls(runs=sum(p.runs for p in parts), steal=[x for p in parts for x in p.steal],
                   seconds=[x for p in parts for x in p.seconds], waited_s=round(sum(p.waited_s for p in parts), 3))


R = TypeVar("R", bound=BaseModel)


def format_validation_error(path: str, err: ValidationError, what: str = "dostune profile") -> str:
    """One line: the file and its first problems (a message that wraps is still one line in a log)."""
    problems = []
    for e in err.errors()[:4]:
        loc = ".".join(str(p) for p in e["loc"]) or "<top level>"
        problems.append(f"field '{loc}': {e['msg']}")
    more = len(err.errors()) - 4
    if more > 0:
        problems.append(f"and {more} more problem(s)")
    return f"{path} is not a valid {what}: " + "; ".join(problems)


# What writes each kind of file, for the hint when one cannot be read (keyed by the reader's ``what`` and by kind).
_MADE_BY = {"profile": "`dostune profile`", "dostune.node-profile": "`dostune profile`",
            "model profile": "`dostune profile --model`", "dostune.model-profile": "`dostune profile --model`",
            "bench result": "`dostune bench`", "dostune.bench": "`dostune bench`",
            "DeepSpeed config": "`dostune tune`", "tuning result": "`dostune tune`",
            "dostune.tune-result": "`dostune tune`"}


def _made_by(what: str, before: str, after: str = "") -> str:
    """The command that writes ``what`` between ``before`` and ``after``; nothing when no command does."""
    maker = _MADE_BY.get(what)
    return f"{before}{maker}{after}" if maker else ""


def _inside(folder: Path) -> str:
    """The hint for a folder named where a JSON file belongs: the file in it to name, if there is one."""
    try:
        found = sorted(folder.glob("*.json"), key=lambda f: (f.name != "ds_config.json", f.name))
    except OSError:
        found = []
    return f"name the file inside it, e.g. {found[0]}" if found else "name the JSON file itself, not a folder"


def read_json_record(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object from ``path`` or raise ProfileError that names the file and the problem, with a hint."""
    p = Path(path)
    if not p.exists():
        raise ProfileError(f"{what} {p} does not exist", hint="check the path" + _made_by(what, ", or make one with "))
    if p.is_dir():
        raise ProfileError(f"{what} {p} is a directory, not a JSON file", hint=_inside(p))
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ProfileError(f"cannot read {what} {p}: {e.strerror or e}",
                           hint="check the file's permissions, or copy it somewhere readable") from None
    if not raw.strip():
        raise ProfileError(f"{what} {p} is empty", hint="a write or copy was cut short, or this is the wrong file: "
                           "make it again" + _made_by(what, " with ") + " or name another")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProfileError(f"{what} {p} is not a JSON text file (it holds binary data)",
                           hint=f"check the path: a {what} is JSON text" + _made_by(what, ", as ", " writes it")) from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})",
                           hint="fix the file there" + _made_by(what, ", or make it again with ")) from None
    except RecursionError:
        raise ProfileError(f"{p} is nested too deeply to be a {what}",
                           hint=f"check the path: a {what} is a flat JSON object") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p} must hold a JSON object, found {type(data).__name__}",
                           hint=f"check the path: a {what} is one JSON object {{...}}")
    return data


def check_version(data: dict, path, kind: str, version: int, readable: tuple[int, ...] = ()) -> None:
    """Refuse another kind of record or a schema version this dostune does not read (``version``, the one it
    writes, or one of the older ``readable`` ones)."""
    found_kind = data.get("kind")
    if found_kind is not None and found_kind != kind:
        raise ProfileError(f"{path} holds a '{found_kind}', expected a '{kind}'",
                           hint=f"name a '{kind}' file" + _made_by(kind, " (", " writes one)"))
    v = data.get("schema_version")
    if v is None:
        raise ProfileError(f"{path}: field 'schema_version' is missing; is this a dostune {kind} file?",
                           hint="check the path" + _made_by(kind, ", or make the file again with "))
    if v != version and v not in readable:
        older = isinstance(v, int) and v < version
        newer = isinstance(v, int) and v > version
        raise ProfileError(f"{path}: field 'schema_version' is {v!r}, this dostune reads version {version}"
                           + (" (the file is from an older dostune)" if older else
                              " (the file is from a newer dostune)" if newer else ""),
                           hint="make the file again with this dostune" if older else
                           "upgrade dostune to read it" if newer else
                           "make the file again with this dostune" + _made_by(kind, " (", ")"))


def load_record(path: str | os.PathLike, cls: type[R], what: str, kind: str, version: int,
                readable: tuple[int, ...] = (), upgrade: bool = False) -> R:
    """Read a record of type ``cls`` from a JSON file: the file, its kind and its schema version are checked first,
    and every failure is one ProfileError naming the file. ``upgrade``: a readable older version is read as the
    current one (its new fields take their defaults)."""
    data = read_json_record(path, what)
    check_version(data, path, kind, version, readable)
    if upgrade:
        data["schema_version"] = version
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ProfileError(format_validation_error(str(path), e, f"dostune {what}"),
                           hint="fix the field(s) named" + _made_by(kind, ", or make the file again with ")) from None


@functools.lru_cache(maxsize=1)
def _file_mode() -> int:
    """The mode a plain open() would give a new file: 0666 less the umask (mkstemp's 0600 is for secrets). Read
    once: reading the umask means setting it, which another thread creating a file at that moment would see."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def check_writable(path: str | os.PathLike, what: str, *, directory: bool = False) -> Path:
    """Fail now, before any work, if ``path`` (a file, or with ``directory`` a folder) cannot be written: it is
    the wrong kind of thing, lies under a file, or its nearest existing folder refuses a new file. Creates
    nothing that stays behind (a probe file is made and removed)."""
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise DostuneError(f"{what} {p} is a file, not a folder", hint="give a folder path")
        if not directory and p.is_dir():
            raise DostuneError(f"{what} {p} is a folder, not a file", hint="give a file path inside it")
    folder = p if directory else p.parent
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DostuneError(f"{what} {p} cannot be created: {existing} is a file, not a folder",
                           hint="choose a path whose folders are folders")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dostune-write-check.", dir=existing)
    except OSError as e:
        raise DostuneError(f"{what} {p} cannot be written: {e.strerror or e} in {existing}",
                           hint="choose a path in a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)
    return p


def _write_atomically(path: str | os.PathLike, write: Callable[[IO], None], mode: str) -> Path:
    """Create ``path`` through ``write(file)`` on a temporary file next to it (opened with ``mode``), then rename."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    except OSError as e:
        raise DostuneError(f"cannot write {p}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, p)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DostuneError(f"cannot write {p}: {e.strerror or e}") from None
        raise
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write via a temporary file next to ``path`` and rename, so an interrupted write never leaves half a
    file. The file gets the usual mode (0644 under the common umask)."""
    return _write_atomically(path, lambda f: f.write(text), "w")


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Lay out a matplotlib figure, write it to ``path`` the way ``atomic_write_text`` writes (the format from the
    file's suffix, PNG without one) and close it."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        fmt = Path(path).suffix.lstrip(".").lower() or "png"
        return _write_atomically(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi), "wb")
    finally:
        plt.close(fig)


def save_record(record: BaseModel, path: str | os.PathLike) -> Path:
    return atomic_write_text(path, record.model_dump_json(indent=2) + "\n")


