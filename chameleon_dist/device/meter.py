"""Exact memory metering by storage in a dispatch mode: the meta-device traces of full-size models
(``models/llama.py``) count their tensors with it. (The emulated device meters through its simulated
backend: ``device/simulated/memory.py``.)

A ``TorchDispatchMode`` sees every aten op run on the training thread (and in its backward pass). Each
storage an op produces for the first time is counted once (views share their storage and cost nothing);
a ``weakref.finalize`` on the storage gives its bytes back when it dies, whichever thread drops it. An
op whose new storages would push live bytes past ``capacity_bytes`` raises ``EmulatedOutOfMemoryError``
(a ``torch.OutOfMemoryError``) and its result is discarded, exactly where a real device would fail.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.device.base import PressureHandler
from chameleon_dist.device.leaves import tensor_leaves
from chameleon_dist.device.simulated.memory import FRESH_FROM_DATA, EmulatedOutOfMemoryError, storage_key

__all__ = ["EmulatedOutOfMemoryError", "StorageMeter", "storage_key"]



class StorageMeter(TorchDispatchMode):
    """Counts live device bytes by storage; raises an out-of-memory error at ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, include_meta: bool = False) -> None:
        """``include_meta`` also counts meta tensors (traces of full-size models without memory)."""
        super().__init__()
        self._counted = _has_storage_or_meta if include_meta else _has_storage
        if capacity_bytes <= 0:
            raise ValueError(f"device.capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.RLock()
        self._tracked: dict[int, int] = {}
        self._live_bytes = 0
        self._peak_bytes = 0
        self._local = threading.local()
        self.op_index = 0
        self.pressure_handler: PressureHandler | None = None
        self._timeline: list[int] | None = None

    # ---- accounting -------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_bytes = self._live_bytes

    def is_tracked(self, storage: torch.UntypedStorage) -> bool:
        with self._lock:
            return storage_key(storage) in self._tracked

    def track(self, tensor: torch.Tensor) -> int:
        """Count ``tensor``'s storage (once) without a capacity check; returns the bytes added."""
        storage = tensor.untyped_storage()
        with self._lock:
            added = self._register_locked(storage, storage_key(storage), storage.nbytes())
            self._peak_bytes = max(self._peak_bytes, self._live_bytes)
        return added

    def _register_locked(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> int:
        old = self._tracked.get(key)
        if old is None:
            weakref.finalize(storage, self._release, key)
            self._tracked[key] = nbytes
            self._live_bytes += nbytes
            return nbytes
        self._tracked[key] = nbytes
        self._live_bytes += nbytes - old
        return nbytes - old

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._tracked.pop(key, 0)
            self._live_bytes -= nbytes

    # ---- op interception --------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Do not meter ops run on this thread inside the block (host-side buffers)."""
        before = getattr(self._local, "paused", False)
        self._local.paused = True
        try:
            yield
        finally:
            self._local.paused = before

    @contextlib.contextmanager
    def recording_timeline(self) -> Iterator[list[int]]:
        """Collect live bytes after every metered op into the yielded list."""
        samples: list[int] = [self._live_bytes]
        self._timeline = samples
        try:
            yield samples
        finally:
            self._timeline = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(self._local, "paused", False):
            return out
        self.op_index += 1
        self._account_outputs(func, args, kwargs, out)
        if self._timeline is not None:
            self._timeline.append(self._live_bytes)
        return out

    def _account_outputs(self, func, args, kwargs, out) -> None:
        counted = self._counted
        outputs = [t for t in tensor_leaves(out) if isinstance(t, torch.Tensor) and counted(t)]
        if not outputs:
            return
        input_keys: set[int] | None = None
        changed: dict[int, tuple[torch.UntypedStorage, int]] = {}
        with self._lock:
            for t in outputs:
                storage = t.untyped_storage()
                key = storage_key(storage)
                nbytes = storage.nbytes()
                known = self._tracked.get(key)
                if known is None:
                    if input_keys is None:
                        input_keys = set() if func in FRESH_FROM_DATA else _storage_keys(args, kwargs, counted)
                    if key in input_keys:  # a view of / in-place on a storage we never saw created
                        continue
                elif known == nbytes:
                    continue
                changed[key] = (storage, nbytes)
            added_bytes = sum(n - self._tracked.get(k, 0) for k, (_, n) in changed.items())
            fits = self._live_bytes + added_bytes <= self.capacity_bytes
        if not changed:
            return
        if not fits:  # outside the lock: the handler waits for copies whose completion frees memory
            self._relieve_pressure(self._live_bytes + added_bytes - self.capacity_bytes)
        with self._lock:
            if added_bytes > 0 and self._live_bytes + added_bytes > self.capacity_bytes:
                raise EmulatedOutOfMemoryError(
                    str(func), self.op_index, added_bytes, self._live_bytes, self.capacity_bytes,
                    swapping=self.pressure_handler is not None,
                )
            for key, (storage, nbytes) in changed.items():
                self._register_locked(storage, key, nbytes)
            self._peak_bytes = max(self._peak_bytes, self._live_bytes)

    def _relieve_pressure(self, short_bytes: int) -> None:
        handler = self.pressure_handler
        if handler is None:
            return
        with self.paused():
            handler(short_bytes)




def _has_storage(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.device.type != "meta"


def _has_storage_or_meta(t: torch.Tensor) -> bool:
    return t.layout == torch.strided


def _storage_keys(args, kwargs, counted=_has_storage) -> set[int]:
    keys = set()
    for t in tensor_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and counted(t):
            keys.add(storage_key(t.untyped_storage()))
    return keys
