"""Checkpoints that are whole or absent: a space check before the write, `latest` moved only after every rank's
files are on disk, and a failed write cleaned up (docs/faults.md).

DeepSpeed's ``engine.save_checkpoint`` writes ``<dir>/<tag>/`` and then, on rank 0 alone and as soon as rank 0's
own files are written, overwrites ``<dir>/latest`` in place. So a kill during another rank's write, or during the
write of ``latest`` itself, could leave ``latest`` naming a partial tag or naming nothing. Here DeepSpeed saves with
``save_latest=False``; once every rank's files are synced to disk, rank 0 replaces ``latest`` atomically (a
temporary file renamed over it).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from .._version import __version__
from ..errors import DostuneError
from .faults import agree, describe


class CheckpointError(DostuneError):
    """A checkpoint could not be written; nothing half-written is left and `latest` is untouched."""


def read_latest(save_dir: Path) -> Optional[str]:
    try:
        return (Path(save_dir) / "latest").read_text().strip() or None
    except FileNotFoundError:
        return None


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def state_bytes(engine) -> int:
    """What this rank's part of a checkpoint holds, from the tensors it will save: ZeRO-3 writes this rank's fp32
    master partition and the optimizer's per-parameter states (Adam: exp_avg and exp_avg_sq), 12 bytes a parameter
    with Adam. The 16-bit parameters are not saved (ZeRO-3's module state holds placeholders; they are rebuilt from
    the fp32 masters), so they do not count. 5% and 1 MiB on top for pickling, the model-states file's metadata
    and buffers, and the recovery scripts DeepSpeed copies."""
    opt = engine.optimizer
    n = sum(t.numel() * t.element_size() for t in getattr(opt, "fp32_partitioned_groups_flat", []))
    inner = getattr(opt, "optimizer", opt)
    for st in getattr(inner, "state", {}).values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return int(n * 1.05) + 2**20


def expected_bytes(engine, save_dir: Path) -> int:
    """The checkpoint's expected size on this filesystem: the previous checkpoint's, measured, when there is one
    (same model, same states), else the sum over ranks of ``state_bytes``. With DeepSpeed's node-local storage
    each node writes only its own ranks' files, so the sum is scaled to this node's share."""
    total = agree(state_bytes(engine), engine.device, "sum")  # every rank, so the collectives stay in step
    prev = read_latest(save_dir)
    if prev and (Path(save_dir) / prev).is_dir():
        return _tree_bytes(Path(save_dir) / prev)
    if engine.use_node_local_storage():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return total * local // world
    return total


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".latest.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, save_dir / "latest")
        _fsync(str(save_dir))  # the rename itself
    finally:
        tmp.unlink(missing_ok=True)


def _is_writer(engine) -> bool:
    """The rank that creates and removes the tag folder: rank 0, or each node's first rank on node-local storage
    (DeepSpeed's own rule)."""
    return (engine.local_rank if engine.use_node_local_storage() else engine.global_rank) == 0


def save(engine, save_dir: Path, step: int, seed: int) -> str:
    """Every rank calls this at the same step. Returns the tag folder; raises CheckpointError (on every rank,
    together) when the space is short or a write fails, after removing what was written."""
    save_dir = Path(save_dir)
    tag = f"step{step}"
    folder = save_dir / tag
    save_dir.mkdir(parents=True, exist_ok=True)
    latest = read_latest(save_dir)
    kept = f"latest still names {latest}" if latest else "there is no earlier checkpoint"
    if latest == tag:  # never rewrite the checkpoint a resume would load
        raise CheckpointError(f"{folder} is already the latest checkpoint; not overwriting it")

    need = expected_bytes(engine, save_dir)
    free = free_bytes(save_dir)
    if agree(max(0, need - free), engine.device) > 0:
        whose = "" if need > free else \
            f"another rank's filesystem is short ({_gib(need)} needed here, {_gib(free)} free); "
        raise CheckpointError(f"not enough space for checkpoint {folder}: {whose}it needs about {_gib(need)}, "
                              f"{_gib(free)} free; nothing was written, {kept}")
    if folder.exists() and _is_writer(engine):
        shutil.rmtree(folder)  # left by a save that was killed: `latest` never named it

    # A failing write must not leave the ranks out of step: DeepSpeed's save runs barriers and all-reduces
    # between its writes, so a rank that raised half-way would leave the others waiting. The writes record
    # their failure instead; the save goes on through its collectives (writing nothing more) and the ranks
    # agree on the outcome afterwards.
    failure: list[BaseException] = []
    ckpt_engine = engine.checkpoint_engine
    real_save, real_copy = ckpt_engine.save, engine._copy_recovery_script

    def guarded_save(state_dict, path):
        if failure:
            return
        try:
            real_save(state_dict, path)
            _fsync(path)  # on disk before `latest` can name it
        except Exception as e:  # ENOSPC, EIO, torch's "unexpected pos" from a truncated zip stream, ...
            failure.append(e)

    def guarded_copy(path):
        if not failure:
            try:
                real_copy(path)
            except Exception as e:
                failure.append(e)

    ckpt_engine.save, engine._copy_recovery_script = guarded_save, guarded_copy
    try:
        engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False,
                               client_state={"step": step, "seed": seed, "dostune_version": __version__})
    except OSError as e:  # outside the writes (e.g. the folder cannot be made): this rank cannot go on
        failure.append(e)
    finally:
        del ckpt_engine.save, engine._copy_recovery_script  # back to the class's methods
    if not failure:
        try:
            _fsync(str(folder))  # the new files' names
        except OSError as e:
            failure.append(e)

    if not agree(int(bool(failure)), engine.device):
        try:
            if engine.global_rank == 0:
                _write_latest(save_dir, tag)
        except OSError as e:
            failure.append(e)
        if not agree(int(bool(failure)), engine.device):
            return str(folder)

    if _is_writer(engine):
        shutil.rmtree(folder, ignore_errors=True)
    cause = describe(failure[0]) if failure else "another rank's write failed"
    raise CheckpointError(f"could not write checkpoint {folder} ({cause}): it needs about {_gib(need)}, "
                          f"{_gib(free_bytes(save_dir))} free; removed the partial folder, {kept}")


def load_latest(engine, save_dir: Path) -> int:
    """Load the checkpoint `latest` names; returns its step."""
    save_dir = Path(save_dir)
    tag = read_latest(save_dir)
    if tag is None:
        raise DostuneError(f"--resume: no checkpoint in {save_dir} (DeepSpeed writes a 'latest' file there)")
    try:
        path, client = engine.load_checkpoint(str(save_dir), load_optimizer_states=True, load_lr_scheduler_states=True)
    except Exception as e:  # torch/DeepSpeed raise many kinds for truncated or foreign files
        raise DostuneError(f"--resume: checkpoint {save_dir / tag} could not be loaded ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); it was left as it is") from None
    if path is None or not client or "step" not in client:
        raise DostuneError(f"--resume: {save_dir / tag} is not a dostune checkpoint (no step recorded)")
    return int(client["step"])
