"""Device memory as the CUDA caching allocator reports it, for the simulated backend.

Each storage a device op produces for the first time is a *block* (views share their storage and cost
nothing): its size rounded up to 512 bytes, as the caching allocator rounds every request, allocated on
the stream current at the op. ``live_bytes`` is what CUDA's ``memory_allocated`` would say. A
``weakref.finalize`` on the storage gives the block back to its allocation stream when the storage dies,
whichever thread drops it (the hazard checker sees the free: NOTE [Stream hazards]). An op whose new
blocks would not fit raises ``EmulatedOutOfMemoryError`` (a ``torch.OutOfMemoryError``) before its outputs
are handed to anyone, as the caching allocator raises at the allocation; relief and one retry happen above,
in the dispatch layer (``device/dispatch.py``), as they do on a GPU.

Two models of the allocator behind the blocks: by default every block is its own segment (no fragmentation:
the capacity bounds ``live_bytes``, the 512-byte-rounded block sizes, and a freed byte serves any stream);
with ``caching=True`` the blocks live in the caching allocator's segments and per-stream pools (NOTE [The
caching allocator model] in ``caching.py``): the capacity bounds ``reserved_bytes``, and a request fits only
where that model says it does (``fits``), which relief and the prefetch limit ask. Tests with capacities of a
few kilobytes keep the default (one 2 MiB segment is larger than their whole device).
"""

from __future__ import annotations

import threading
import weakref

import torch

from chameleon_dist.device.simulated.caching import CacheBlock, CachingAllocatorModel
from chameleon_dist.device.simulated.clock import SimStream
from chameleon_dist.device.simulated.hazards import BlockAccess, HazardChecker
from chameleon_dist.units import format_bytes

# torch.tensor(data) builds its tensor below the dispatcher and only then passes it through lift_fresh: the
# "input" of that op is a brand-new storage, not an existing one
FRESH_FROM_DATA = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})

BLOCK_ROUND_BYTES = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes (kMinBlockSize)."""


def block_bytes(nbytes: int) -> int:
    """The bytes a ``nbytes`` allocation occupies in the caching allocator (0 stays 0: no block)."""
    return -(-nbytes // BLOCK_ROUND_BYTES) * BLOCK_ROUND_BYTES if nbytes > 0 else 0


def storage_key(storage: torch.UntypedStorage) -> int:
    """Identity of a live storage (its C++ StorageImpl address; shared by all views)."""
    return storage._cdata


class EmulatedOutOfMemoryError(torch.OutOfMemoryError):
    """The emulated device ran out of memory; carries where and by how much, and whether swapping was on
    (a pressure handler installed: the runtime installs one only when ``enabled``)."""

    def __init__(self, op_name: str, op_index: int, requested_bytes: int, live_bytes: int, capacity_bytes: int,
                 swapping: bool = False, reserved_bytes: int | None = None, expandable_segments: bool = False):
        self.op_name = op_name
        self.op_index = op_index
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.capacity_bytes = capacity_bytes
        self.swapping = swapping
        self.reserved_bytes = reserved_bytes  # None: the block model (no segments)
        cached_bytes = reserved_bytes - live_bytes if reserved_bytes is not None else 0
        # the bytes were there, but in blocks of other segments or streams: fragmentation, not size
        self.fragmented = reserved_bytes is not None and cached_bytes >= requested_bytes
        reserved = ""
        if reserved_bytes is not None:
            reserved = (f" and {format_bytes(reserved_bytes)} reserved in segments ({format_bytes(cached_bytes)} "
                        "reserved but unallocated)")
        if self.fragmented and not expandable_segments:
            advice = ("The free bytes are fragmented across segments and streams (relief freed blocks that live "
                      "ones pin): turn on expandable_segments (device.expandable_segments: true here, "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True on a GPU), or raise device.capacity.")
        elif swapping:
            advice = ("Chameleon swapping is on and could not free enough: lower min_swap_bytes or the "
                      "micro-batch size, or raise device.capacity.")
        else:
            advice = "Chameleon swapping is off on this device: turn it on (enabled: true) or raise device.capacity."
        super().__init__(
            f"emulated device out of memory in {op_name} (op #{op_index}): tried to allocate "
            f"{format_bytes(requested_bytes)} with {format_bytes(live_bytes)} live{reserved} of "
            f"{format_bytes(capacity_bytes)} capacity (device.capacity). {advice}"
        )

    @property
    def short_bytes(self) -> int:
        return max(self.live_bytes + self.requested_bytes - self.capacity_bytes, 1)


class Block(BlockAccess):
    __slots__ = ("nbytes", "storage_bytes", "cached")

    def __init__(self, stream: SimStream, storage_bytes: int, cached: CacheBlock | None = None) -> None:
        super().__init__(stream)
        self.storage_bytes = storage_bytes
        self.cached = cached  # its block in the caching allocator model (None: the block model)
        self.nbytes = cached.size if cached is not None else block_bytes(storage_bytes)


class SimAllocator:
    """Blocks by storage, live and peak bytes, and the capacity check (see the module docstring)."""

    def __init__(self, capacity_bytes: int, hazards: HazardChecker, caching: bool = False,
                 expandable_segments: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"device.capacity must be > 0 bytes, got {capacity_bytes}")
        if expandable_segments and not caching:
            raise ValueError("expandable_segments needs the caching allocator model (EmulatedDevice(caching_allocator=True))")
        self.capacity_bytes = capacity_bytes
        self.cache = CachingAllocatorModel(capacity_bytes, expandable_segments) if caching else None
        self.hazards = hazards
        self.swapping = False  # a pressure handler is installed (only for the error's advice)
        self._lock = threading.RLock()
        self._blocks: dict[int, Block] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes
            if self.cache is not None:
                self.cache.peak_reserved_bytes = self.cache.reserved_bytes

    @property
    def reserved_bytes(self) -> int:
        """What ``memory_reserved`` would say: the segments (the block model: ``live_bytes``)."""
        return self.cache.reserved_bytes if self.cache is not None else self.live_bytes

    @property
    def peak_reserved_bytes(self) -> int:
        return self.cache.peak_reserved_bytes if self.cache is not None else self.peak_bytes

    def fits(self, nbytes: int, stream: SimStream) -> bool:
        """Whether an allocation of ``nbytes`` on ``stream`` would succeed now (the caching model's answer, with
        its release of cached segments; the block model: the bytes are under the capacity)."""
        with self._lock:
            if self.cache is not None:
                return self.cache.fits(nbytes, stream)
            return self.live_bytes + block_bytes(nbytes) <= self.capacity_bytes

    def block_of(self, storage: torch.UntypedStorage) -> Block | None:
        return self._blocks.get(storage_key(storage))

    def track(self, storage: torch.UntypedStorage, stream: SimStream) -> Block:
        """Count ``storage`` (once) without a capacity check (parameters, a batch moved to the device)."""
        with self._lock:
            block = self._register_locked(storage, storage_key(storage), storage.nbytes(), stream)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return block

    def allocate(self, storages: list[torch.UntypedStorage], stream: SimStream, op_name: str, op_index: int) -> None:
        """Count the new (or resized) ``storages`` an op produced on ``stream``; raises
        ``EmulatedOutOfMemoryError`` (counting nothing) when they do not fit."""
        with self._lock:
            if self.cache is not None:
                self._allocate_cached_locked(storages, stream, op_name, op_index)
                return
            blocks = self._blocks
            added_bytes = 0
            for storage in storages:
                known = blocks.get(storage_key(storage))
                added_bytes += block_bytes(storage.nbytes()) - (known.nbytes if known is not None else 0)
            if added_bytes > 0 and self.live_bytes + added_bytes > self.capacity_bytes:
                raise EmulatedOutOfMemoryError(op_name, op_index, added_bytes, self.live_bytes, self.capacity_bytes,
                                               swapping=self.swapping)
            for storage in storages:
                self._register_locked(storage, storage_key(storage), storage.nbytes(), stream)
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes

    def _allocate_cached_locked(self, storages, stream: SimStream, op_name: str, op_index: int) -> None:
        """The caching model's allocation: each storage a block of its stream's pool; on failure what this
        call took goes back and the error says how the bytes stood."""
        cache = self.cache
        taken: list[CacheBlock] = []
        for storage in storages:
            known = self._blocks.get(storage_key(storage))
            if storage.nbytes() == 0 or (known is not None and known.cached is not None
                                         and known.cached.size >= block_bytes(storage.nbytes())):
                taken.append(None)  # (no bytes, or a resize within its block: nothing new)
                continue
            cached = cache.malloc(storage.nbytes(), stream)
            if cached is None:
                for block in taken:
                    if block is not None:
                        cache.free(block)
                raise EmulatedOutOfMemoryError(op_name, op_index, block_bytes(storage.nbytes()), cache.allocated_bytes,
                                               self.capacity_bytes, swapping=self.swapping,
                                               reserved_bytes=cache.reserved_bytes,
                                               expandable_segments=cache.expandable_segments)
            taken.append(cached)
        for storage, cached in zip(storages, taken):
            self._register_locked(storage, storage_key(storage), storage.nbytes(), stream, cached)
        self.live_bytes = cache.allocated_bytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def new_storages(self, outputs: list[torch.Tensor], input_keys) -> list[torch.UntypedStorage]:
        """The storages among ``outputs`` that need a block: never seen, or resized. ``input_keys()`` gives
        the keys of the op's input storages: an untracked output storage that is also an input is a host
        tensor seen through a view or an in-place op, not a new device block."""
        blocks = self._blocks
        fresh: list[torch.UntypedStorage] = []
        inputs = None
        for t in outputs:
            storage = t.untyped_storage()
            key = storage_key(storage)
            known = blocks.get(key)
            if known is None:
                if inputs is None:
                    inputs = input_keys()
                if key in inputs:
                    continue
            elif known.storage_bytes == storage.nbytes():
                continue
            if all(s is not storage for s in fresh):
                fresh.append(storage)
        return fresh

    def _register_locked(self, storage: torch.UntypedStorage, key: int, nbytes: int, stream: SimStream,
                         cached: CacheBlock | None = None) -> Block:
        old = self._blocks.get(key)
        if self.cache is not None and cached is None and nbytes > 0 and (old is None or old.cached is None
                                                                         or old.cached.size < block_bytes(nbytes)):
            cached = self.cache.malloc(nbytes, stream, force=True)  # (track: counted without a capacity check)
        if old is None:
            block = self._blocks[key] = Block(stream, nbytes, cached)
            weakref.finalize(storage, self._release, key)
            self.live_bytes += block.nbytes
            if self.cache is not None:
                self.live_bytes = self.cache.allocated_bytes
            return block
        if self.cache is not None:
            if cached is not None:  # resized past its block: a new one, the old goes back to its pool
                if old.cached is not None:
                    self.cache.free(old.cached)
                old.cached = cached
            old.nbytes, old.storage_bytes = (old.cached.size if old.cached is not None else 0), nbytes
            self.live_bytes = self.cache.allocated_bytes
            return old
        rounded = block_bytes(nbytes)
        self.live_bytes += rounded - old.nbytes
        old.nbytes, old.storage_bytes = rounded, nbytes
        return old

    def _release(self, key: int) -> None:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is None:
                return
            self.live_bytes -= block.nbytes
            if block.cached is not None:
                self.cache.free(block.cached)
                self.live_bytes = self.cache.allocated_bytes
        self.hazards.freed(block, block.nbytes)
