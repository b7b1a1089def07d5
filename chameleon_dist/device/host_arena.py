"""``HostArena``: one host region, page-locked once, carved into exact-size host buffers.

Page-locking (``cudaHostRegister``) costs time on the host and, where it fails, leaves an error behind (see
``PinnedHostAllocator`` in ``device/cuda.py``). Registering one buffer per new size puts it in the save path
whenever the sizes change (a new sequence length, a new micro-batch count). The arena is reserved once,
after the first WarmUp iteration, sized from the most bytes its host buffers held at once and bounded by
the host budget (``HostBufferPool.reserve_arena``); from then on a buffer of any size that fits is a slice of
it, and giving one back (its storage dies) returns its range. Nothing here names CUDA: the region is registered by the
caller, and the arena knows only byte ranges.

Each buffer is its own tensor and storage (``torch.frombuffer`` over a slice of the region), so the host
pool treats it like any buffer, and the range goes back to the arena when the last reference to that
storage goes (also after the arena itself was dropped: the region lives while any buffer does).
"""

from __future__ import annotations

import bisect
import mmap
import weakref

import torch

from chameleon_dist.device.host_lock import DeferringLock

ALIGNMENT_BYTES = 512
"""Every buffer starts at a multiple of this (and takes a multiple of it from the arena)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


class HostArena:
    """``capacity_bytes`` of ``region`` (an anonymous ``mmap`` the caller registered), lent out first-fit by
    address, free ranges merged on return. Thread-safe (buffers may die on any thread)."""

    def __init__(self, region: mmap.mmap, capacity_bytes: int) -> None:
        if not 0 < capacity_bytes <= len(region):
            raise ValueError(f"an arena of {capacity_bytes} bytes does not fit a region of {len(region)} bytes")
        self.capacity_bytes = int(capacity_bytes)
        self._view = memoryview(region)
        self._lock = DeferringLock()  # a buffer's range comes back from its storage's finalizer
        self._starts: list[int] = [0]  # free ranges, sorted by start
        self._sizes: list[int] = [self.capacity_bytes]
        self.lent_bytes = 0
        self.buffers_lent = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.lent_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 host buffer of exactly ``nbytes`` from the arena, or None when no free range holds it."""
        if nbytes <= 0:
            return None
        span = _aligned(nbytes)
        with self._lock:
            for position, size in enumerate(self._sizes):
                if size >= span:
                    start = self._starts[position]
                    if size == span:
                        del self._starts[position], self._sizes[position]
                    else:
                        self._starts[position] += span
                        self._sizes[position] -= span
                    self.lent_bytes += span
                    self.buffers_lent += 1
                    break
            else:
                return None
        buffer = torch.frombuffer(self._view[start:start + nbytes], dtype=torch.uint8)
        weakref.finalize(buffer.untyped_storage(), self._give_back, start, span).atexit = False
        return buffer

    def _give_back(self, start: int, span: int) -> None:
        """A buffer's storage died (a finalizer: never blocks, never runs inside a held section)."""
        self._lock.run_or_defer(self._give_back_now, start, span)

    def _give_back_now(self, start: int, span: int) -> None:
        with self._lock:
            self.lent_bytes -= span
            position = bisect.bisect_left(self._starts, start)
            self._starts.insert(position, start)
            self._sizes.insert(position, span)
            if position + 1 < len(self._starts) and start + span == self._starts[position + 1]:  # merge the next
                self._sizes[position] += self._sizes.pop(position + 1)
                del self._starts[position + 1]
            if position and self._starts[position - 1] + self._sizes[position - 1] == start:  # merge the previous
                self._sizes[position - 1] += self._sizes.pop(position)
                del self._starts[position]
