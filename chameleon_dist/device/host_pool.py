"""A bounded pool of host buffers with exact-size reuse.

Swapped activations repeat with the same sizes every iteration, so buffers are kept per exact byte size
and handed out again; nothing is rounded up to a power of two (rounding costs up to ~1.8x host RAM in
other offloaders). ``budget_bytes`` bounds everything the pool holds, in use or cached; when a new buffer
would exceed it, cached buffers of other sizes are freed first, and if that is not enough ``acquire``
returns ``None`` so the caller keeps the tensor on the device instead of crashing the job.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Callable

import torch

logger = logging.getLogger(__name__)

Allocator = Callable[[int], torch.Tensor]


def plain_host_allocator(nbytes: int) -> torch.Tensor:
    """Pageable host memory (the emulated device's host side)."""
    return torch.empty(nbytes, dtype=torch.uint8)


class HostBufferPool:
    """Thread-safe exact-size buffer pool bounded by ``budget_bytes`` (``None`` = unbounded)."""

    def __init__(self, budget_bytes: int | None, allocate: Allocator = plain_host_allocator) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"host_memory_budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.peak_reserved_bytes = 0
        self.refusals = 0
        self.allocations = 0

    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the host: buffers in use plus cached free ones."""
        return self.in_use_bytes + self.cached_bytes

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 host buffer of exactly ``nbytes``, or ``None`` when the budget has no room."""
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                buf = bucket.pop()
                self.cached_bytes -= nbytes
                self.in_use_bytes += nbytes
                return buf
            if self.budget_bytes is not None and self.reserved_bytes + nbytes > self.budget_bytes:
                self._evict_locked(self.reserved_bytes + nbytes - self.budget_bytes)
                if self.reserved_bytes + nbytes > self.budget_bytes:
                    self.refusals += 1
                    return None
            self.in_use_bytes += nbytes
            self.allocations += 1
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        try:
            return self._allocate(nbytes)
        except BaseException:
            with self._lock:
                self.in_use_bytes -= nbytes
            raise

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from ``acquire`` for reuse."""
        nbytes = buf.numel()
        with self._lock:
            self.in_use_bytes -= nbytes
            self.cached_bytes += nbytes
            self._free[nbytes].append(buf)

    def trim(self) -> int:
        """Free every cached buffer; returns the bytes given back to the host."""
        with self._lock:
            return self._evict_locked(self.cached_bytes)

    def _evict_locked(self, want_bytes: int) -> int:
        freed = 0
        for size in sorted(self._free, reverse=True):
            bucket = self._free[size]
            while bucket and freed < want_bytes:
                bucket.pop()
                freed += size
            if freed >= want_bytes:
                break
        self.cached_bytes -= freed
        self._free = defaultdict(list, {k: v for k, v in self._free.items() if v})
        return freed
