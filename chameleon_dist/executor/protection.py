"""``StorageProtection``: the storages the swap path never moves (``SwapExecutor.protect`` and friends).

A module's parameters and buffers, what a callable yields (an engine's own buffers: gradient buckets,
workspaces), both read again when each iteration begins, and single buffers protected during an iteration
until the next one begins. Keyed by storage address and checked against the storage itself: a storage's
Python object lives exactly as long as the storage, so a dead reference means freed, and another storage may
now sit at that address (ZeRO-3 frees gathered parameters every layer).
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch import nn

from chameleon_dist.device.meter import storage_key


class StorageProtection:
    def __init__(self) -> None:
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._sources: list[Callable[[], Iterable[torch.Tensor]]] = []
        # storage key -> the storage: a key counts while that storage lives (a freed one's address gets reused)
        self._storages: dict[int, weakref.ReferenceType[torch.UntypedStorage]] = {}

    def add(self, owner: nn.Module | Callable[[], Iterable[torch.Tensor]]) -> None:
        """Protect ``owner``'s tensors from the next ``refresh`` on."""
        self._modules.add(owner) if isinstance(owner, nn.Module) else self._sources.append(owner)

    def add_now(self, tensor: torch.Tensor) -> bool:
        """Protect ``tensor``'s storage until the next ``refresh``; False if it already was."""
        storage = tensor.untyped_storage()
        if self.protects(storage):
            return False
        self._storages[storage_key(storage)] = weakref.ref(storage)
        return True

    def remove_now(self, tensor: torch.Tensor) -> None:
        """Undo an ``add_now`` that returned True."""
        self._storages.pop(storage_key(tensor.untyped_storage()), None)

    def protects(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is protected: its key is, and the storage protected under it is this one."""
        ref = self._storages.get(storage_key(storage))
        return ref is not None and ref() is storage

    def refresh(self) -> list[torch.Tensor]:
        """Read the owners again (what ``add_now`` added goes); returns their tensors."""
        modules = (t for module in self._modules for t in [*module.parameters(), *module.buffers()])
        tensors = [*modules, *(t for source in self._sources for t in source())]
        storages = (t.untyped_storage() for t in tensors)
        self._storages = {storage_key(storage): weakref.ref(storage) for storage in storages}
        return tensors

    def keys(self) -> set[int]:
        """Storage keys of the protected storages still alive (as of the last ``refresh`` and ``add_now``)."""
        return {key for key, ref in self._storages.items() if ref() is not None}
