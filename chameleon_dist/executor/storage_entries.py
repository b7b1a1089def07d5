"""``StorageEntries``: the swap executor's entries by device storage, and the storages an in-place write counts on.

A storage's key (its address) is reused once the storage dies; a dead storage's key is forgotten by a finalizer,
which runs at once on one thread but may wait for the executor's lock when another thread holds it (NOTE
[Threads and locks] in device/locking.py). So every lookup also checks that the entry's storage IS the one
asked about, and the finalizer removes only what a dead storage left: a new storage at the same address never
shares a dead one's host copy (a wrong gradient) nor its in-place count.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from chameleon_dist.device.meter import storage_key

if TYPE_CHECKING:
    from chameleon_dist.device.locking import SharedLock
    from chameleon_dist.executor.records import SwapEntry


class StorageEntries:
    """Storage key -> the entry its bytes leave the device with; storage key -> the entries whose bytes live there
    (swapped originals, restored copies): an in-place write to one is counted on them (``note_writes``)."""

    def __init__(self, lock: "SharedLock") -> None:
        self._lock = lock
        self._by_storage: dict[int, weakref.ReferenceType[SwapEntry]] = {}
        self._watched: dict[int, tuple[weakref.ReferenceType, list[weakref.ReferenceType[SwapEntry]]]] = {}

    def has(self, storage: torch.UntypedStorage) -> bool:
        """Whether an entry was made for a storage at ``storage``'s address in this attempt."""
        return storage_key(storage) in self._by_storage

    def entry_of(self, storage: torch.UntypedStorage) -> "SwapEntry | None":
        """The live entry made for ``storage`` itself (not for a dead storage at its address)."""
        ref = self._by_storage.get(storage_key(storage))
        entry = ref() if ref is not None else None
        return entry if entry is not None and entry.source() is storage else None

    def add(self, storage: torch.UntypedStorage, entry: "SwapEntry") -> None:
        """``entry`` is the one ``storage`` leaves the device with; writes to ``storage`` count on it."""
        self._by_storage[storage_key(storage)] = weakref.ref(entry)
        self.watch(storage, entry)

    def watch(self, storage: torch.UntypedStorage, entry: "SwapEntry") -> None:
        """Count in-place writes to ``storage`` on ``entry``."""
        key = storage_key(storage)
        storage_ref, refs = self._watched.get(key, (None, None))
        if storage_ref is None or storage_ref() is not storage:
            storage_ref, refs = self._watched[key] = (weakref.ref(storage), [])
            weakref.finalize(storage, self._lock.run_or_defer, self._forget, key)  # (a finalizer never waits)
        refs.append(weakref.ref(entry))

    def note_writes(self, tensors) -> None:
        """An op is about to write ``tensors`` in place: count it on every entry whose bytes live in one of their
        storages, so that unpacking a tensor saved before the write raises (``check_version``)."""
        watched = self._watched
        if not watched:
            return
        for tensor in tensors:
            if tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            storage_ref, refs = watched.get(storage_key(storage), (None, ()))
            if storage_ref is not None and storage_ref() is storage:
                for ref in refs:
                    entry = ref()
                    if entry is not None:
                        entry.writes += 1

    def _forget(self, key: int) -> None:
        """A watched storage died: drop what it left at its key (a live storage may hold the key by now)."""
        ref = self._by_storage.get(key)
        entry = ref() if ref is not None else None
        if entry is None or entry.source() is None:
            self._by_storage.pop(key, None)
        watched = self._watched.get(key)
        if watched is not None and watched[0]() is None:
            del self._watched[key]
