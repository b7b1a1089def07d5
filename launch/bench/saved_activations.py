"""Which activation storages autograd saves in one pass, and their bytes (benchmarks size their budgets with it)."""

from __future__ import annotations

from typing import Callable, ContextManager, Iterable

import torch

from chameleon_dist.device import storage_key


class SavedActivations:
    """Inside ``hooks()``, every storage autograd saves that is not a parameter's (and, with
    ``is_device_tensor``, lives on the device) is noted in ``bytes_by_storage`` (storage key -> bytes)."""

    def __init__(self, parameters: Iterable[torch.Tensor],
                 is_device_tensor: Callable[[torch.Tensor], bool] = lambda tensor: True) -> None:
        self.parameter_keys = {storage_key(p.untyped_storage()) for p in parameters}
        self.is_device_tensor = is_device_tensor
        self.bytes_by_storage: dict[int, int] = {}

    def _note(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        if key not in self.parameter_keys and self.is_device_tensor(tensor):
            self.bytes_by_storage[key] = storage.nbytes()
        return tensor

    def hooks(self) -> ContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self._note, lambda tensor: tensor)
