import os

import pytest
import torch

# DeepSpeed prints its accelerator choice at import; keep test output readable.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on a GPU machine: bash scripts/gpu-tests.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
