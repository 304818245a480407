"""Loads dostune's out-of-place CPU Adam (``cpu_adam_oop.c``): compiled with the system C compiler (about a
second) by ``dostune ops build`` or on first use, kept per source, compiler flags and CPU in the environment's ops
folder (dostune/ops.py), and called through ctypes, which releases the GIL for the duration of the call."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from .. import ops
from ..errors import ConfigError
from .kernels import AdamScalars, cpu_adam_simd_width

_SOURCE = Path(__file__).with_name("cpu_adam_oop.c")
# -ffp-contract=off: only the fmas written in the source are fused (DeepSpeed parity); -fno-math-errno lets
# the correctly rounded sqrt vectorise; -march=native because the cache key includes this CPU.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
_HALF_KIND = {None: 0, torch.bfloat16: 1, torch.float16: 2}
_GRAD_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lock = threading.Lock()
_lib = None


class _Scalars(ctypes.Structure):
    _fields_ = [(name, ctypes.c_float) for name in
                ("beta1", "beta2", "b1m1", "b2m1", "bc2", "eps", "step_size", "decay")] + \
               [("has_decay", ctypes.c_int), ("adamw", ctypes.c_int)]


def _cpu_identity() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


TITLE = "dostune's CPU Adam kernel"
_PARTIAL = ".building-"  # a compile in progress writes here; one found under the build lock was cut short


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _library_name(compiler: str) -> str:
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), compiler, *_FLAGS, _cpu_identity()]).encode()).hexdigest()
    return f"cpu_adam_oop-{key[:16]}.so"


def built_path() -> Optional[Path]:
    """The library built for this source, compiler and CPU, where this environment has one."""
    compiler = _compiler()
    if compiler is None:
        return None
    name = _library_name(compiler)
    return next((d / "native" / name for d in ops.ops_dirs() if (d / "native" / name).is_file()), None)


def build() -> ops.BuiltOp:
    """The kernel's library, compiled first where this environment has none for this source, compiler and CPU."""
    compiler = _compiler()
    if compiler is None:
        raise ConfigError("overlap_backward needs a C compiler (gcc) to build dostune's CPU Adam kernel; none found",
                          hint="install gcc (DeepSpeed's CPU Adam needs one too), or set overlap_backward false")
    found = built_path()
    if found is not None:
        return ops.BuiltOp("cpu_adam_oop", TITLE, found)
    name = _library_name(compiler)
    folder = ops.ops_dir() / "native"
    out = folder / name
    with ops.BuildLock(folder / "cpu_adam_oop.lock", TITLE):
        if out.is_file():  # built by the process this one waited for
            return ops.BuiltOp("cpu_adam_oop", TITLE, out)
        for left in folder.glob(f"{_PARTIAL}*"):  # no builder holds the lock: a killed compile's output
            left.unlink(missing_ok=True)
        ops.note(f"building {TITLE} into {folder} (first use in this Python environment, a few seconds)")
        start = time.monotonic()
        fd, tmp = tempfile.mkstemp(prefix=_PARTIAL, suffix=".so", dir=folder)
        os.close(fd)
        res = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise ConfigError(f"building dostune's CPU Adam kernel failed ({compiler}):\n{res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
        return ops.BuiltOp("cpu_adam_oop", TITLE, out, time.monotonic() - start)


def load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(build().path))
            f = lib.dostune_adam_oop
            f.restype = None
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 6 + \
                [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.POINTER(_Scalars), ctypes.c_int]
            _lib = lib
        return _lib


def _check(name: str, t: torch.Tensor, n: int, dtype=torch.float32) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor of {n} elements, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def adam_out_of_place(p, g, m, v, p_out, m_out, v_out, s: AdamScalars, inv_scale: float = 1.0,
                      half_out: Optional[torch.Tensor] = None, threads: Optional[int] = None) -> None:
    """One DeepSpeed-exact Adam step from (p, m, v) and gradient g into (p_out, m_out, v_out), as if
    ``g.mul_(inv_scale)`` and DeepSpeedCPUAdam had run in place on the whole tensor. ``g`` may be bf16 or fp16:
    it is widened exactly, as DeepSpeed's ``.to(float32)`` of the gradient is. ``half_out`` (bf16 or fp16)
    receives the new params rounded to nearest even, as ``half.copy_(p_out)`` would. The outputs are written with
    streaming stores, which bypass the caches (cpu_adam_oop.c says why). The outputs may be the inputs themselves
    (p_out is p, m_out is m, v_out is v): then it is DeepSpeedCPUAdam's update in place."""
    n = p.numel()
    for name, t in (("p", p), ("m", m), ("v", v), ("p_out", p_out), ("m_out", m_out), ("v_out", v_out)):
        _check(name, t, n)
    _check("g", g, n, g.dtype if g.dtype in _GRAD_KIND else torch.float32)
    if half_out is not None:
        if half_out.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"half_out must be bfloat16 or float16, got {half_out.dtype}")
        _check("half_out", half_out, n, half_out.dtype)
    if n == 0:
        return
    width = cpu_adam_simd_width()
    sc = _Scalars(s.beta1, s.beta2, s.beta1_minus1, s.beta2_minus1, s.bias_correction2, s.eps, s.step_size,
                  s.decay, int(s.has_decay), int(s.adamw))
    load().dostune_adam_oop(p.data_ptr(), g.data_ptr(), _GRAD_KIND[g.dtype], m.data_ptr(), v.data_ptr(), p_out.data_ptr(),
                            m_out.data_ptr(), v_out.data_ptr(),
                            half_out.data_ptr() if half_out is not None else None,
                            _HALF_KIND[half_out.dtype if half_out is not None else None], n,
                            n - n % width if width else 0, float(inv_scale), ctypes.byref(sc),
                            int(threads or torch.get_num_threads()))

