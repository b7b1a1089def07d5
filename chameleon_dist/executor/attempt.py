"""``SwapAttempt``: what the swap executor knows about one attempt at an iteration, and only that.

An out-of-memory retry starts the iteration over (``SwapExecutor.new_attempt``) with a new ``SwapAttempt``:
nothing of the failed attempt is cleared field by field, so nothing can be forgotten. What outlives an attempt
(the device, the protection, the policy matcher, the counters) stays on the executor. The memory-pressure
relief (``pressure.py``) walks the attempt it is handed.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch

from chameleon_dist.device.meter import storage_key
from chameleon_dist.executor.recompute import ProducerLog, StorageHolders
from chameleon_dist.executor.records import KeptTensor, SwappedTensor
from chameleon_dist.executor.schedule import NEVER, PlacedSchedule
from chameleon_dist.executor.storage_entries import StorageEntries

if TYPE_CHECKING:
    from chameleon_dist.device.locking import SharedLock
    from chameleon_dist.executor.records import SwapEntry


@dataclasses.dataclass(eq=False)
class SwapAttempt:
    """The per-attempt state of a ``SwapExecutor``: its entries, saves, placed points and save numbering.

    Made by ``start``; a retry makes a new one. Entries, kept and packed tensors are held weakly: the attempt
    never keeps a saved tensor alive."""

    by_storage: StorageEntries  # entries by storage; where in-place writes count (``note_writes``)
    holders: StorageHolders  # what holds each storage, for recipe inputs
    producers: ProducerLog  # recent forward ops, for per-tensor recomputation
    order: list[weakref.ReferenceType["SwapEntry"]] = dataclasses.field(default_factory=list)  # swapped, save order
    kept: list[weakref.ReferenceType[KeptTensor]] = dataclasses.field(default_factory=list)  # a passive swap's pick
    packed: list[weakref.ReferenceType[KeptTensor | SwappedTensor]] = dataclasses.field(default_factory=list)
    saved_storages: dict[int, weakref.ReferenceType] = dataclasses.field(default_factory=dict)  # key -> storage
    placed: PlacedSchedule = dataclasses.field(default_factory=PlacedSchedule)  # NOTE [Placed swaps] in schedule.py
    due_op: int = NEVER  # the op count at which the next placed point is due (read by the dispatch mode)
    micro_batch: int = 0  # of the save sites (NOTE [Save-site matching] in ``matching.py``)
    unpacked: bool = False  # backward unpacked a saved tensor since the last forward save
    swapped_since_release: bool = False  # a swap-out was issued since backward last let go of the sources
    prefetching: bool = False  # a swap-in ahead of its use is allocating (NOTE [Relief under pressure])

    @classmethod
    def start(cls, lock: "SharedLock", parameters_of: StorageHolders | None = None) -> "SwapAttempt":
        """A new attempt under the executor's ``lock``; the protected parameters ``parameters_of`` knew
        (the previous attempt's holders) are known to this one too."""
        holders = parameters_of.next_attempt() if parameters_of is not None else StorageHolders()
        return cls(by_storage=StorageEntries(lock), holders=holders, producers=ProducerLog(holders.holder_of))

    def schedule(self, heap: list, at_op: int, entry: "SwapEntry") -> None:
        """Place ``entry`` on one of the heaps of ``placed`` at op count ``at_op``."""
        self.placed.add(heap, at_op, entry)
        if at_op < self.due_op:
            self.due_op = at_op

    def seen_before(self, storage: torch.UntypedStorage) -> bool:
        """Whether a storage was saved before in this attempt; a new one takes the next save ordinal (NOTE
        [Save-site matching] in ``matching.py``). Addresses of dead storages get reused: checked."""
        key = storage_key(storage)
        known = self.saved_storages.get(key)
        if known is not None and known() is storage:
            return True
        self.saved_storages[key] = weakref.ref(storage)
        return False

    def abandon(self) -> None:
        """The attempt failed: its saved tensors give back their device and host memory (its graph may outlive
        it where the garbage collector cannot reach: an error inside backward leaves PyTorch's engine holding
        it), so they take no memory from the retry. Unpacking one afterwards raises."""
        for ref in self.packed:
            packed = ref()
            if isinstance(packed, KeptTensor):
                packed.abandon()
            elif isinstance(packed, SwappedTensor):
                packed.entry.abandon()
