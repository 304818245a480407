"""Page-lock existing host tensors in place.

DeepSpeed 0.19.8 keeps the offloaded fp32 master params and DeepSpeedCPUAdam's exp_avg/exp_avg_sq in
pageable memory; only gradients are pinned. Pageable memory cannot be copied asynchronously (the driver
stages it through a bounce buffer, ~6.5 GB/s on the H100 node instead of ~52), so the GPU lane needs
them pinned. Registering the tensors in place with cudaHostRegister keeps their identity (DeepSpeed and
its checkpoints hold references to them) and wastes nothing, unlike ``pin_memory()``, which copies and
rounds each allocation up to a power of two. A CPU device copies nothing across a bus and pins nothing
(``NoPins``).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class PinRegistry:
    """Page-locks tensors under a key (e.g. (subgroup, "exp_avg")). Re-pinning a key releases the
    tensor it held before (a checkpoint load replaces optimizer states), holds a reference to what it
    registered so nothing is freed while registered, and unregisters everything on close()."""

    def __init__(self):
        self._held: dict[object, tuple[int, torch.Tensor]] = {}

    def pin(self, key, t: torch.Tensor) -> bool:
        """Page-lock ``t``'s storage. True if it is pinned afterwards."""
        if t.device.type != "cpu" or t.numel() == 0:
            return False
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        held = self._held.get(key)
        if held is not None and held[0] == ptr:
            return True
        if held is not None:
            self._release(key)
        if t.is_pinned():  # pinned by its allocator (e.g. DeepSpeed's pinned gradient buffers)
            return True
        rc = torch.cuda.cudart().cudaHostRegister(ptr, storage.nbytes(), 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of %d bytes failed (%s); copies of it will be slower", storage.nbytes(), rc)
            return False
        self._held[key] = (ptr, t)
        return True

    def _release(self, key) -> None:
        ptr, _ = self._held.pop(key)
        torch.cuda.cudart().cudaHostUnregister(ptr)

    def close(self) -> None:
        for key in list(self._held):
            self._release(key)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes page-locked in place now (what the allocator pinned itself is not counted here)."""
        return sum(t.untyped_storage().nbytes() for _, t in self._held.values())


class NoPins:
    """PinRegistry's calls on a CPU device, where nothing is page-locked."""

    def pin(self, key, t: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return 0
