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
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

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


def read_json_record(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object from ``path`` or raise ProfileError that names the file and the problem."""
    p = Path(path)
    if not p.exists():
        raise ProfileError(f"{what} {p} does not exist")
    if p.is_dir():
        raise ProfileError(f"{what} {p} is a directory, not a JSON file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ProfileError(f"cannot read {what} {p}: {e.strerror or e}") from None
    if not raw.strip():
        raise ProfileError(f"{what} {p} is empty")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProfileError(f"{what} {p} is not a JSON text file (it holds binary data)") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise ProfileError(f"{p} is nested too deeply to be a {what}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{p} must hold a JSON object, found {type(data).__name__}")
    return data


def check_version(data: dict, path, kind: str, version: int, readable: tuple[int, ...] = ()) -> None:
    """Refuse another kind of record or a schema version this dostune does not read (``version``, the one it
    writes, or one of the older ``readable`` ones)."""
    found_kind = data.get("kind")
    if found_kind is not None and found_kind != kind:
        raise ProfileError(f"{path} holds a '{found_kind}', expected a '{kind}'")
    v = data.get("schema_version")
    if v is None:
        raise ProfileError(f"{path}: field 'schema_version' is missing; is this a dostune {kind} file?")
    if v != version and v not in readable:
        older = isinstance(v, int) and v < version
        newer = isinstance(v, int) and v > version
        raise ProfileError(f"{path}: field 'schema_version' is {v!r}, this dostune reads version {version}"
                           + (" (the file is from an older dostune)" if older else
                              " (the file is from a newer dostune)" if newer else ""),
                           hint="make the file again with this dostune" if older else
                           "upgrade dostune to read it" if newer else None)


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
        raise ProfileError(format_validation_error(str(path), e, f"dostune {what}")) from None


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


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write via a temporary file next to ``path`` and rename, so an interrupted write never leaves half a
    file. The file gets the usual mode (0644 under the common umask)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    except OSError as e:
        raise DostuneError(f"cannot write {p}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, _file_mode())
        os.replace(tmp, p)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DostuneError(f"cannot write {p}: {e.strerror or e}") from None
        raise
    return p


def save_record(record: BaseModel, path: str | os.PathLike) -> Path:
    return atomic_write_text(path, record.model_dump_json(indent=2) + "\n")


