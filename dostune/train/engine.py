"""Building DeepSpeed engines for a model spec, in one process or under DeepSpeed's launcher."""
from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable, NoReturn, Optional

import torch

from ..dsconfig import activation_checkpointing
from ..leaf_blocks import mark_leaf_blocks
from ..models.registry import ModelSpec, loss_of
from ..ops import load_deepspeed_ops


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_own_world = False  # whether ensure_distributed made this process's world (then it is closed at exit)


def ensure_distributed(timeout_s: Optional[float] = None) -> None:
    """Initialise torch.distributed through DeepSpeed. Under ``deepspeed``/``torchrun`` the launcher has set
    RANK/WORLD_SIZE; a plain ``python`` or ``dostune`` process becomes a world of one. ``timeout_s`` bounds every
    collective (a dead or hung rank makes the others' collectives fail after it); None keeps DeepSpeed's default.
    A process group that exists already keeps its timeout."""
    global _own_world
    import deepspeed
    import deepspeed.comm as dist

    # before init_distributed and any CPU Adam, in this world or the one already made: both then find their ops
    # loaded from the environment's build (ops.py), and a missing one is built with a note, under a lock of dostune's
    load_deepspeed_ops()
    if dist.is_initialized():
        return
    own_world = "RANK" not in os.environ
    if own_world:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    deepspeed.init_distributed(verbose=False, **kw)
    _unlink_deepspeeds_shm_buffer(dist.get_rank(), dist.get_world_size())
    if own_world:
        # The world of one is this process's to close. Left open, NCCL prints a three-line warning at exit
        # ("destroy_process_group() was not called"), once for every process: a `tune --validate` runs eight. A
        # launcher's world is closed only by a command that succeeded (cli.app): a failed rank may leave peers
        # inside a collective, which closing could wait on.
        _own_world = True
        atexit.register(_leave_world)


# Where DeepSpeed's CPU accelerator keeps its all-reduce buffers, and how their names begin (shm.cpp, SHM_BUFFER_NAME)
DS_SHM_DIR = Path("/dev/shm")
DS_SHM_PREFIX = "deepspeed_allreduce_buffer_"


def _unlink_deepspeeds_shm_buffer(rank: int, world_size: int) -> None:
    """DeepSpeed 0.19's CPU accelerator gives each rank of a world on one machine a 66 MiB shared-memory buffer for
    its all-reduce (ops/csrc/cpu/comm/shm.cpp, named for the user, MASTER_ADDR, MASTER_PORT and the rank) and never
    unlinks it: every such run would leave them in /dev/shm, which is memory, until the machine has none left. A rank
    maps every rank's buffer before its init_distributed returns, so once all ranks are past it (the barrier) the
    names can go; the mappings stay, and no way of exiting (a kill included) leaves a buffer behind."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    if world_size < 2 or get_accelerator().device_name() != "cpu":
        return
    dist.barrier()
    path = DS_SHM_DIR / (f"{DS_SHM_PREFIX}{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
                         f"{os.environ.get('MASTER_PORT')}_{rank}")
    try:
        path.unlink(missing_ok=True)  # missing: ranks on several machines, which DeepSpeed gives none
    except OSError:  # not ours to remove after all: leave it
        pass


_left_launchers_world = False  # set once a command closed the world a launcher made (exit_skipping_teardown then)


def leave_launchers_world() -> bool:
    """Close the world a launcher made, once no peer can be waiting for this rank in a collective: its command
    succeeded, or every rank agreed to stop at the same step and saved (train's stop); whether there was one to
    close. A world of one made here stays open for the process's next command and is closed at exit."""
    global _left_launchers_world
    if "torch.distributed" not in sys.modules:  # a command that never touched torch.distributed
        return False
    _left_launchers_world = _left_launchers_world or (not _own_world and _leave_world())
    return _left_launchers_world


def left_launchers_world() -> bool:
    return _left_launchers_world


def _leave_world() -> bool:
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return False
    tdist.destroy_process_group()
    return True


def exit_skipping_teardown(code: int = 0) -> NoReturn:
    """End a launched rank whose world was closed (leave_launchers_world) with ``code``, without the interpreter's
    teardown.

    Closing the world does not free the default process group: a torch module imported once it exists holds it as
    a default argument (torch.distributed.nn.functional's ``group=group.WORLD``, on DeepSpeed's launched CPU ranks),
    so its gloo threads run on into the teardown, where a rank whose work was done could still abort ("terminate
    called without an active exception", exit -6, which fails the whole launch). It failed CI's two-rank launcher
    tests before the world was closed, and once after. Two bare gloo ranks with that module imported aborted so in 7
    of 60 launches, in none of 30 without it, in none of 90 ending as here (docs/findings.md, finding 18).

    What any exit does first is done here too, in its order: wait for the threads that are not daemons, then run the
    atexit handlers (they flush logs). What is skipped is freeing objects and C++ static destructors, which an ending
    process does not need."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


# what build_engine reports as it goes (its ``phase``): the model partitioned as it is built, DeepSpeed's ZeRO-3 engine
# (the offloaded fp32 state and CPU Adam's), dostune's lanes (host state page-locked in place, shadows, staging slots)
BUILD_PHASES = ("building the model", "building DeepSpeed's engine", "building dostune's lanes")


def build_engine(spec: ModelSpec, ds_config: dict, seed: int = 0, use_dostune: bool = True,
                 rank_timeout_s: Optional[float] = None, seams=None,
                 phase: Optional[Callable[[str], None]] = None):
    """Build the model under ``deepspeed.zero.Init`` (so large models are partitioned as they are built), its
    transformer blocks ZeRO-3 leaf modules (leaf_blocks.py), and wrap it in a DeepSpeed engine; with ``use_dostune``
    a ``dostune`` section switches the optimizer (as ``dostune.initialize`` does, with the test ``seams`` of
    optim.cpu_lane.CpuLaneSeams if given). An ``activation_checkpointing`` section makes the model checkpoint every
    transformer block.
    ``rank_timeout_s``: see ensure_distributed. ``phase(what)``, if given, is called as each part of the build begins
    (a large model's takes minutes, most of it in DeepSpeed's engine: its offloaded state allocated and copied)."""
    import deepspeed

    from ..optim.api import attach

    phase = phase or (lambda what: None)
    ensure_distributed(rank_timeout_s)
    torch.manual_seed(seed)
    phase(BUILD_PHASES[0])
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = spec.build(checkpointing=activation_checkpointing(ds_config))
    mark_leaf_blocks(model)  # every method's engine alike, so the profiles measure the engine training runs
    phase(BUILD_PHASES[1])
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    if use_dostune:  # what dostune.initialize adds to deepspeed.initialize once the leaf blocks are marked
        phase(BUILD_PHASES[2])
        attach(engine, seams=seams)
    return engine


def master_weights(engine) -> torch.Tensor:
    """This rank's fp32 master weights, all subgroups concatenated (on the CPU; the resident subgroups' are read from
    the GPU, their only copy)."""
    return torch.cat([t.detach().float().cpu().view(-1) for t in engine.optimizer.fp32_partitioned_groups_flat])


def train_steps(engine, spec: ModelSpec, steps: int, seq: int, seed: int = 0,
                before_backward: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None) -> list[float]:
    """Run ``steps`` optimizer steps (each with the config's gradient accumulation) on seeded batches;
    returns the loss of each micro-batch. ``before_backward(step, loss)`` may replace the loss (tests use
    it to force an overflow)."""
    gen = torch.Generator().manual_seed(seed)
    gas = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(steps):
        for _ in range(gas):
            batch = spec.batch(mb, seq, gen, engine.device)
            loss = loss_of(engine(**batch))
            if before_backward is not None:
                loss = before_backward(step, loss)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
    return losses


def free_engine_memory() -> None:
    """Release what finished engines hold. Call after dropping the last reference to an engine."""
    # DeepSpeed 0.19.8 keeps the last top-level module on a global forward stack
    # (parameter_offload.FWD_MODULE_STACK), which would keep a finished engine's GPU memory alive.
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack.clear()
    # ... and memoises PartitionedParameterCoordinator.__params_to_release with a class-level lru_cache
    # whose keys hold modules.
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as _PPC

    fn = getattr(_PPC, "_PartitionedParameterCoordinator__params_to_release", None)
    candidates = [fn, getattr(fn, "__wrapped__", None)]
    candidates += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]  # under nvtx wrappers
    for c in candidates:
        if hasattr(c, "cache_clear"):
            c.cache_clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
