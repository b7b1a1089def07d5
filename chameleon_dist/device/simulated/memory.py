"""Device memory as the CUDA caching allocator reports it, for the simulated backend.

Each storage a device op produces for the first time is a *block* (views share their storage and cost
nothing): its size rounded up to 512 bytes, as the caching allocator rounds every request, allocated on
the stream current at the op. ``live_bytes`` is what CUDA's ``memory_allocated`` would say. A
``weakref.finalize`` on the storage gives the block back to its allocation stream when the storage dies,
whichever thread drops it (the hazard checker sees the free: NOTE [Stream hazards]). An op whose new
blocks would not fit raises ``EmulatedOutOfMemoryError`` (a ``torch.OutOfMemoryError``) before its outputs
are handed to anyone, as the caching allocator raises at the allocation; relief and one retry happen above,
in the dispatch layer (``device/dispatch.py``), as they do on a GPU.
"""

from __future__ import annotations

import threading
import weakref

import torch

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
                 swapping: bool = False):
        self.op_name = op_name
        self.op_index = op_index
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.capacity_bytes = capacity_bytes
        self.swapping = swapping
        if swapping:
            advice = ("Chameleon swapping is on and could not free enough: lower min_swap_bytes or the "
                      "micro-batch size, or raise device.capacity.")
        else:
            advice = "Chameleon swapping is off on this device: turn it on (enabled: true) or raise device.capacity."
        super().__init__(
            f"emulated device out of memory in {op_name} (op #{op_index}): tried to allocate "
            f"{format_bytes(requested_bytes)} with {format_bytes(live_bytes)} live of "
            f"{format_bytes(capacity_bytes)} capacity (device.capacity). {advice}"
        )

    @property
    def short_bytes(self) -> int:
        return max(self.live_bytes + self.requested_bytes - self.capacity_bytes, 1)


class Block(BlockAccess):
    __slots__ = ("nbytes", "storage_bytes")

    def __init__(self, stream: SimStream, storage_bytes: int) -> None:
        super().__init__(stream)
        self.storage_bytes = storage_bytes
        self.nbytes = block_bytes(storage_bytes)


class SimAllocator:
    """Blocks by storage, live and peak bytes, and the capacity check (see the module docstring)."""

    def __init__(self, capacity_bytes: int, hazards: HazardChecker) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"device.capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.hazards = hazards
        self.swapping = False  # a pressure handler is installed (only for the error's advice)
        self._lock = threading.RLock()
        self._blocks: dict[int, Block] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

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

    def _register_locked(self, storage: torch.UntypedStorage, key: int, nbytes: int, stream: SimStream) -> Block:
        old = self._blocks.get(key)
        if old is None:
            block = self._blocks[key] = Block(stream, nbytes)
            weakref.finalize(storage, self._release, key)
            self.live_bytes += block.nbytes
            return block
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
        self.hazards.freed(block, block.nbytes)
