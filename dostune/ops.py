"""The compiled ops a dostune run loads, built once per Python environment and loaded from there.

A run loads DeepSpeed's CPU Adam (and, on DeepSpeed's CPU accelerator, its shared-memory all-reduce), which
DeepSpeed compiles on first use through torch.utils.cpp_extension (a minute or two), plus dostune's own CPU Adam
kernel (optim/cpu_kernel.py, a few seconds). Left to torch, three things go wrong:

* the build lands in ``~/.cache/torch_extensions/<python>_<accelerator>/<op>``, one folder for every environment
  of the user; its build file names the environment's own source paths, so two environments rebuild the op in turn;
* torch guards a build with a lock file that holds no owner (``<op>/lock``): a process killed while it builds
  leaves the file, and every later load waits on it forever, printing nothing;
* every load in a new process takes that lock again, so even a run that compiles nothing can leave it behind.

So the ops live in a folder private to the environment (``ops_dir``), built ahead of any run by ``dostune ops
build`` (scripts/install.sh runs it), and a run imports the built module directly, taking no lock. A stamp written
after a build (``dostune-build.json``: a digest of the sources, flags and versions) says whether a build is
current. Where a run still has to build, it says so on stderr, under a lock of dostune's own (``BuildLock``: an
flock the kernel drops when its holder dies, so it cannot outlive a killed process). Under it, once no process is
still building in the op's folder (the compilers a killed build started run on), a torch lock file there is what a
stopped build left, and is removed with a one-line warning. Every wait on a live builder gives up after
``DOSTUNE_BUILD_WAIT`` seconds (default 600), naming the builder's process.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from .errors import DostuneError

#: Where the ops are built and found, instead of the environment's own folder (see ops_dir).
OPS_DIR_ENV = "DOSTUNE_OPS_DIR"
#: Seconds to wait for another process's build before giving up.
WAIT_ENV = "DOSTUNE_BUILD_WAIT"
DEFAULT_WAIT_S = 600.0
#: Written into an op's build folder once a build finished: what it was built from, and the module's file.
STAMP = "dostune-build.json"

# DeepSpeed's builders of the ops a run loads, with what a user reads for them. An accelerator without one of them
# (the shared-memory all-reduce exists only on DeepSpeed's CPU accelerator) skips it.
DEEPSPEED_OPS = {"CPUAdamBuilder": "DeepSpeed's CPU Adam",
                 "ShareMemCommBuilder": "DeepSpeed's shared-memory all-reduce"}

_in_process = threading.RLock()  # one build or load at a time in a process (flock is per open file, not per thread)


def note(message: str) -> None:
    """A line for the user on stderr (a run's stdout may be the JSON a script reads)."""
    print(message, file=sys.stderr, flush=True)


def _can_create(path: Path) -> bool:
    """Whether this user can create ``path`` (or write in it, where it exists)."""
    p = path
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def ops_dirs() -> list[Path]:
    """Where built ops are looked for, in order: ``$DOSTUNE_OPS_DIR`` alone when set; else the environment's own
    folder (``<sys.prefix>/var/cache/dostune``, gone with the environment), then a folder in the user's cache named
    for the environment (for an environment this user cannot write into, e.g. a system Python)."""
    given = os.environ.get(OPS_DIR_ENV)
    if given:
        return [Path(given).expanduser()]
    prefix = os.path.realpath(sys.prefix)
    tag = hashlib.sha256(prefix.encode()).hexdigest()[:12]
    return [Path(prefix) / "var" / "cache" / "dostune",
            _user_cache() / "dostune" / "envs" / f"{Path(prefix).name}-{tag}"]


def ops_dir() -> Path:
    """Where this process builds ops: the first of ``ops_dirs`` it can write into."""
    dirs = ops_dirs()
    for d in dirs:
        if _can_create(d):
            return d
    raise DostuneError(f"no folder to build dostune's compiled ops in: {', '.join(map(str, dirs))} cannot be "
                       "written", hint=f"set {OPS_DIR_ENV} to a folder you can write")


def wait_limit() -> float:
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DostuneError(f"{WAIT_ENV} must be a number of seconds above 0, got {raw!r}",
                           hint=f"e.g. {WAIT_ENV}=900, or unset it for {DEFAULT_WAIT_S:.0f} s")
    return value


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


class BuildLock:
    """Only one process builds ``what`` at a time: an exclusive flock on ``path``, which holds the holder's process
    id for the others' messages. The kernel drops an flock when its holder dies (``kill -9`` included), so the lock
    never outlives its builder; the file stays, empty of meaning. A wait says for whom it waits and gives up after
    ``wait_limit()`` seconds."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self._fd: Optional[int] = None

    def __enter__(self) -> "BuildLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.monotonic()
                    holder = _pid_in(fd)
                    if deadline is None:
                        limit = wait_limit()
                        deadline = now + limit
                        note(f"waiting for process {holder}, which is building {self.what} (gives up after "
                             f"{_minutes(limit)}; {WAIT_ENV} sets how long)")
                    elif now > deadline:
                        raise DostuneError(f"gave up waiting for process {holder} to finish building {self.what} "
                                           f"({_minutes(wait_limit())})",
                                           hint=f"if process {holder} is stuck, stop it (kill {holder}) and run "
                                                f"again; to wait longer set {WAIT_ENV} (seconds)")
                    time.sleep(0.2)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _pid_in(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip() or "?"
    except OSError:
        return "?"


def builders_in(folder: Path) -> list[int]:
    """The processes (of this user; Linux: /proc) building in an op's build folder: one holding torch's lock file
    open (torch keeps it open until it removes it), or one working in the folder (torch runs ninja there, and ninja
    the compilers: they live on when the process that started them is killed)."""
    folder = Path(os.path.realpath(folder))
    lock = str(folder / "lock")
    found = []
    try:
        procs = [e.name for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) != os.getpid()]
    except OSError:
        return found
    for pid in procs:
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(folder):
                found.append(int(pid))
                continue
            fds = list(os.scandir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd.path) == lock:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def clear_stale_torch_lock(folder: Path, what: str) -> bool:
    """Called under ``BuildLock``, before torch builds in ``folder``: wait for a process still building there (one
    outside dostune, or the compilers of a process that was killed), as long as ``wait_limit()``; then torch's lock
    file, if one is left, belongs to no one (torch's own wait on it would never end) and is removed, with a
    warning. Whether there was one."""
    deadline = None
    while True:
        live = builders_in(folder)
        if not live:
            break
        now = time.monotonic()
        pid = live[0]
        if deadline is None:
            deadline = now + wait_limit()
            note(f"waiting for process {pid} ({_process_name(pid)}), which is still building {what} in {folder} "
                 f"(gives up after {_minutes(wait_limit())}; {WAIT_ENV} sets how long)")
        elif now > deadline:
            raise DostuneError(f"gave up waiting for process {pid} ({_process_name(pid)}) to finish building {what} "
                               f"in {folder}", hint=f"if process {pid} is stuck, stop it (kill {pid}) and run again")
        time.sleep(0.5)
    lock = folder / "lock"
    try:
        lock.unlink()
    except FileNotFoundError:
        return False
    note(f"warning: removed {lock}, left by a build of {what} that was stopped before it finished")
    return True


# ------------------------------------------------------------------------------------------------ DeepSpeed's ops

@dataclass(frozen=True)
class BuiltOp:
    name: str
    title: str
    path: Path  # the loaded module's (or library's) file
    seconds: Optional[float] = None  # how long this process took to build it; None: it was built already


def _torch_roots() -> list[Path]:
    """Where torch builds the ops: ``$TORCH_EXTENSIONS_DIR`` when the user set one (then it is theirs to share or
    not), else a folder in each of ``ops_dirs``."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return [Path(given)]
    return [d / "torch_extensions" for d in ops_dirs()]


def _build_root() -> Path:
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(given) if given else ops_dir() / "torch_extensions"


def _deepspeed_builder(class_name: str):
    """DeepSpeed's builder of that op on its accelerator, or None where the accelerator has none or cannot run it."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(class_name)
    if builder is None or not builder.is_compatible(False):
        return None
    return builder


def _loaded_ops() -> dict:
    """DeepSpeed's table of the ops this process loaded (every later ``builder.load()`` returns from it)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    return OpBuilder._loaded_ops


def _installed_with_deepspeed(builder) -> bool:
    """Whether DeepSpeed itself was installed with the op compiled in (DS_BUILD_CPU_ADAM=1 pip install ...): then
    DeepSpeed imports its own, and nothing is built."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(builder.name, False)) and accelerator_name == get_accelerator()._name


def build_key(builder) -> str:
    """A digest of what the op is built from: DeepSpeed's sources and flags (its CPU Adam's name this CPU's
    instruction set) and the versions of DeepSpeed, torch and Python. A change to any of them means a new build."""
    from importlib.metadata import version

    import torch

    strip = builder.strip_empty_entries
    h = hashlib.sha256()
    for part in [builder.absolute_name(), version("deepspeed"), torch.__version__, str(torch.version.cuda),
                 str(torch.version.hip), sys.version, *strip(builder.include_paths()), *strip(builder.cxx_args()),
                 *strip(builder.extra_ldflags())]:
        h.update(part.encode() + b"\0")
    for src in strip(builder.sources()):
        h.update(Path(builder.deepspeed_src_path(src)).read_bytes())
    return h.hexdigest()


def _read_stamp(folder: Path) -> Optional[dict]:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _import_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_built(name: str, key: str) -> Optional[Path]:
    """The module file of a current build of op ``name``, in the first root that has one."""
    for root in _torch_roots():
        stamp = _read_stamp(root / name)
        if stamp and stamp.get("key") == key:
            path = root / name / str(stamp.get("file", ""))
            if path.is_file():
                return path
    return None


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _build_deepspeed_op(builder, key: str, title: str) -> tuple:
    """Build the op in this environment's folder, under ``BuildLock``; (module, seconds, file)."""
    from .deepspeed_support import stdout_to_stderr

    root = _build_root()
    folder = root / builder.name
    what = f"{title} ({builder.name})"
    with BuildLock(root / f"{builder.name}.lock", what):
        path = _find_built(builder.name, key)  # built by the process this one waited for
        if path is not None:
            return _import_module(path), None, path
        stopped = clear_stale_torch_lock(folder, what)
        stamp = _read_stamp(folder)
        (folder / STAMP).unlink(missing_ok=True)  # a half-rebuilt op must not pass for a built one
        why = ("its last build was stopped" if stopped else
               "DeepSpeed, torch or this CPU changed since it was built" if stamp else
               "first use in this Python environment")
        note(f"building {what} into {folder} ({why}); this takes a minute or two, once")
        start = time.monotonic()
        try:
            with _env("TORCH_EXTENSIONS_DIR", str(root)), stdout_to_stderr():
                module = builder.jit_load(verbose=False)
        except Exception as e:  # a compiler error, no compiler, no ninja
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            raise DostuneError(f"building {what} failed: {lines[0] if lines else type(e).__name__}",
                               hint="DeepSpeed's ops need a C++ compiler (g++) and ninja; with them installed, "
                                    "`dostune ops build` builds it (DOSTUNE_DEBUG=1 shows the compiler's output)"
                               ) from e
        seconds = time.monotonic() - start
        path = Path(module.__file__)
        tmp = folder / f"{STAMP}.{os.getpid()}"
        tmp.write_text(json.dumps({"key": key, "file": path.name, "seconds": round(seconds, 1)}) + "\n")
        os.replace(tmp, folder / STAMP)
        return module, seconds, path


def load_deepspeed_op(class_name: str) -> Optional[BuiltOp]:
    """Load DeepSpeed's op (its builder's class name, e.g. ``CPUAdamBuilder``) into this process, building it first
    where no current build exists; from then on DeepSpeed's own ``load()`` of it returns this module. None where
    DeepSpeed's accelerator has no such op."""
    title = DEEPSPEED_OPS.get(class_name, class_name)
    with _in_process:
        from .deepspeed_support import remember_cpu_info

        remember_cpu_info()  # the CPU Adam's flags ask py-cpuinfo, a subprocess each time
        builder = _deepspeed_builder(class_name)
        if builder is None:
            return None
        loaded = _loaded_ops()
        if builder.name in loaded:
            return BuiltOp(builder.name, title, Path(getattr(loaded[builder.name], "__file__", "") or "."))
        if _installed_with_deepspeed(builder):
            module = builder.load(verbose=False)
            return BuiltOp(builder.name, title, Path(getattr(module, "__file__", "") or "."))
        key = build_key(builder)
        path, seconds = _find_built(builder.name, key), None
        module = None
        if path is not None:
            try:
                module = _import_module(path)
            except (ImportError, OSError):  # a damaged build: make it again
                module = None
        if module is None:
            module, seconds, path = _build_deepspeed_op(builder, key, title)
        loaded[builder.name] = module
        return BuiltOp(builder.name, title, path, seconds)


def load_deepspeed_ops() -> list[BuiltOp]:
    """Every DeepSpeed op a dostune run loads on this accelerator, loaded now (built first where needed): call
    before ``deepspeed.init_distributed`` and the engine, which then find them loaded."""
    return [op for op in map(load_deepspeed_op, DEEPSPEED_OPS) if op is not None]


def deepspeed_op_status() -> list[tuple[str, str, Optional[Path]]]:
    """(name, title, the current build's module file or None) of every DeepSpeed op a run loads here."""
    out = []
    with _in_process:
        from .deepspeed_support import remember_cpu_info

        remember_cpu_info()
        for class_name, title in DEEPSPEED_OPS.items():
            builder = _deepspeed_builder(class_name)
            if builder is None:
                continue
            if _installed_with_deepspeed(builder):
                out.append((builder.name, title, Path(sys.modules["deepspeed"].__file__).parent))
            else:
                out.append((builder.name, title, _find_built(builder.name, build_key(builder))))
    return out


def build_all(on_built: Optional[Callable[[BuiltOp], None]] = None) -> list[BuiltOp]:
    """Build (or find built) every op a run here loads: DeepSpeed's and dostune's CPU kernel. ``dostune ops build``."""
    from .optim import cpu_kernel

    done = []
    for op in load_deepspeed_ops():
        done.append(op)
        if on_built:
            on_built(op)
    op = cpu_kernel.build()
    done.append(op)
    if on_built:
        on_built(op)
    return done
