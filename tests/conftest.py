import os

import pytest
import torch

from dostune.train.engine import DS_SHM_DIR, DS_SHM_PREFIX

# DeepSpeed prints its accelerator choice at import; keep test output readable.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on a GPU machine: bash scripts/gpu-tests.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# DeepSpeed 0.19's CPU accelerator gives every rank of a world of several a 66 MiB shared-memory buffer for its
# all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp) and never unlinks it; /dev/shm is memory. dostune's ranks remove
# the names once every rank is initialised (train.engine); before that, run after run filled the machine until the
# CI gate's workers ran out of memory. In case a test's world is killed before it gets there, the buffers this
# session's worlds made go when it ends; their processes have ended by then.
def _ds_shm_buffers() -> set[str]:
    try:
        return {n for n in os.listdir(DS_SHM_DIR) if n.startswith(DS_SHM_PREFIX)}
    except OSError:  # no /dev/shm (not Linux)
        return set()


@pytest.fixture(scope="session", autouse=True)
def _remove_deepspeeds_shared_memory_buffers():
    before = _ds_shm_buffers()
    yield
    for name in _ds_shm_buffers() - before:
        try:
            os.unlink(os.path.join(DS_SHM_DIR, name))
        except OSError:
            pass
