"""The baseline swap executor: saved-tensor hooks that move activations to the host and back.

Every saved activation whose storage holds at least ``min_swap_bytes`` leaves the device asynchronously
when autograd saves it and comes back when backward needs it, with the next ``prefetch_depth`` swapped
storages (in reverse save order, the order backward usually needs them) brought back ahead of time.
Never swapped: parameters and views of parameters, tensors that are not plain dense device tensors, and
anything packed while a backward pass runs (recompute inside backward). Values are copied byte for byte
and views are rebuilt with their exact strides, so training stays bit-identical. A later issue replaces
the "swap everything" rule by policy-driven decisions; the mechanics here stay.

With a policy (``use_policy``), only the saved storages the policy matches leave the device (see
``matching``); each comes back when the iteration's op count reaches its planned swap-in trigger (checked
whenever autograd unpacks a saved tensor), shifted by how far the sequence had moved at its save; one
needed before its prefetch started is fetched on demand and counted. Under memory pressure the executor
first lets in-flight swap-outs land, then swaps out idle kept tensors synchronously (passive swap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import logging
import weakref
from typing import Callable, ContextManager, Iterator, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.device.base import Device
from chameleon_dist.device.meter import storage_key
from chameleon_dist.executor.matching import MatchCounts, PolicyMatcher
from chameleon_dist.executor.records import KeptTensor, SwapEntry, SwappedTensor
from chameleon_dist.policy.model import Policy
from chameleon_dist.trace.writes import WrittenTensors
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SwapCounters:
    """What the executor did during one iteration."""

    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swapped_storages: int = 0  # storages copied out (views of one storage share one copy)
    kept_for_host_budget_bytes: int = 0
    prefetched: int = 0
    saved_bytes: list[int] = dataclasses.field(default_factory=list)  # every tensor autograd saved, in order
    on_demand: int = 0  # swap-ins started only when backward needed the tensor
    reused_original_bytes: int = 0  # restores that reused the still-alive device original (no copy)
    passive_swap_bytes: int = 0  # kept tensors swapped out synchronously under memory pressure
    passive_swaps: int = 0
    matches: MatchCounts = dataclasses.field(default_factory=MatchCounts)


class SwapObserver(Protocol):
    """What the detailed profiler wants to hear from the executor (profiling iterations only)."""

    def on_saved(self, tensor: torch.Tensor) -> None: ...

    def on_swap_out(self, storage: torch.UntypedStorage) -> int: ...

    def on_swap_in(self, swap_index: int, at_op: int) -> None: ...

    def on_restored(self, swap_index: int, tensor: torch.Tensor) -> None: ...

    @property
    def op_count(self) -> int: ...


class WriteWatch(TorchDispatchMode):
    """Reports every in-place write to ``on_write`` (for an executor used without the runtime, whose
    profiler already reports writes from its own dispatch mode)."""

    def __init__(self, on_write: Callable[[list[torch.Tensor]], None]) -> None:
        super().__init__()
        self._on_write = on_write
        self._written = WrittenTensors()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        written = self._written.of(func, args, kwargs)
        if written:
            self._on_write(written)
        return func(*args, **(kwargs or {}))


class SwapExecutor:
    """Installs the swap hooks for one iteration at a time (``active()``)."""

    def __init__(self, device: Device, min_swap_bytes: int, prefetch_depth: int = 2) -> None:
        if min_swap_bytes < 0:
            raise ValueError(f"min_swap_bytes must be >= 0, got {min_swap_bytes}")
        if prefetch_depth < 0:
            raise ValueError(f"executor.prefetch_depth must be >= 0, got {prefetch_depth}")
        self.device = device
        self.min_swap_bytes = min_swap_bytes
        self.prefetch_depth = prefetch_depth
        self.counters = SwapCounters()
        self._protected: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._protected_keys: set[int] = set()
        self._by_storage: dict[int, weakref.ReferenceType[SwapEntry]] = {}
        # storage key -> the entries whose bytes live there (swapped originals, restored copies): an
        # in-place write to one is counted on them (``note_writes``)
        self._watched: dict[int, list[weakref.ReferenceType[SwapEntry]]] = {}
        self._order: list[weakref.ReferenceType[SwapEntry]] = []
        self._host_budget_warned = False
        self._swapped_since_release = False
        self.observer: SwapObserver | None = None
        self.matcher: PolicyMatcher | None = None
        self.op_clock: Callable[[], int] = lambda: -1  # ops seen so far in the iteration (-1: unknown)
        self._ordinals: dict[int, tuple[int, weakref.ReferenceType]] = {}
        self._next_ordinal = 0
        self._triggers: list[tuple[int, int, weakref.ReferenceType[SwapEntry]]] = []
        self._kept: list[weakref.ReferenceType[KeptTensor]] = []
        self.quiet: Callable[[], ContextManager[None]] = contextlib.nullcontext  # hides own ops from profilers

    # ---- setup ------------------------------------------------------------------------------
    def protect(self, module: nn.Module) -> None:
        """Never swap ``module``'s parameters, buffers, or views of them."""
        self._protected.add(module)

    def protected_keys(self) -> set[int]:
        """Storage keys of the protected modules' parameters and buffers (as of now)."""
        self._refresh_protected()
        return self._protected_keys

    def _refresh_protected(self) -> None:
        keys = set()
        for module in self._protected:
            for tensor in list(module.parameters()) + list(module.buffers()):
                keys.add(storage_key(tensor.untyped_storage()))
        self._protected_keys = keys

    def use_policy(self, policy: Policy | None) -> None:
        """Swap what ``policy`` says from the next iteration on (None: swap every eligible tensor)."""
        if policy is None:
            self.matcher = None
        elif self.matcher is None or self.matcher.policy is not policy:  # (reset per iteration by ``active``)
            self.matcher = PolicyMatcher(policy)

    @contextlib.contextmanager
    def active(self, writes_reported: bool = False) -> Iterator[SwapCounters]:
        """Swap during the block; yields this iteration's counters. In-place writes must reach
        ``note_writes``: pass ``writes_reported=True`` when a dispatch mode of the caller's reports them
        (the runtime's profiler does), else the executor watches for them with a dispatch mode of its own."""
        self.counters = SwapCounters()
        self._refresh_protected()
        self._start_attempt()
        watch = contextlib.nullcontext() if writes_reported else WriteWatch(self.note_writes)
        try:
            with watch, torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.counters
            self.device.release_pending()
        finally:
            self._clear()

    def note_writes(self, tensors) -> None:
        """An op is about to write ``tensors`` in place: count it on every entry whose bytes live in one
        of their storages, so that unpacking a tensor saved before the write raises (``check_version``)."""
        watched = self._watched
        if not watched:
            return
        for tensor in tensors:
            if tensor.layout != torch.strided:
                continue
            refs = watched.get(storage_key(tensor.untyped_storage()))
            if refs:
                for ref in refs:
                    entry = ref()
                    if entry is not None:
                        entry.writes += 1

    def _watch(self, storage: torch.UntypedStorage, entry: SwapEntry) -> None:
        key = storage_key(storage)
        refs = self._watched.get(key)
        if refs is None:
            refs = self._watched[key] = []
            weakref.finalize(storage, self._forget, key)
        refs.append(weakref.ref(entry))

    def _forget(self, key: int) -> None:
        """A watched storage died (its address may be reused by an unrelated one)."""
        self._by_storage.pop(key, None)
        self._watched.pop(key, None)

    def new_attempt(self) -> None:
        """An out-of-memory retry starts the iteration over: the counters (the same object ``active``
        yielded, emptied in place) and the save numbering describe only the attempt that completes."""
        fresh = SwapCounters()
        for field in dataclasses.fields(SwapCounters):
            setattr(self.counters, field.name, getattr(fresh, field.name))
        self._start_attempt()

    def _start_attempt(self) -> None:
        """Matching, release flag and per-iteration bookkeeping start over (the counters are fresh)."""
        if self.matcher is not None:
            self.matcher.reset()
            self.counters.matches = self.matcher.counts
        self._swapped_since_release = False
        self._clear()

    def _clear(self) -> None:
        self._by_storage.clear()
        self._watched.clear()
        self._order.clear()
        self._ordinals.clear()
        self._next_ordinal = 0
        self._triggers.clear()
        self._kept.clear()

    # ---- hooks ------------------------------------------------------------------------------
    def _eligible(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return False  # parameters, subclasses (DTensor, fake), sparse and nested tensors stay
        if tensor.is_leaf and tensor.requires_grad:
            return False
        if torch._C._current_graph_task_id() != -1:
            return False  # packed inside backward (recompute): it is needed right away
        storage = tensor.untyped_storage()
        if storage.nbytes() < max(self.min_swap_bytes, 1):
            return False
        if storage_key(storage) in self._protected_keys:
            return False
        return self.device.is_device_tensor(tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | KeptTensor | SwappedTensor:
        with self.quiet():
            return self._pack_quietly(tensor)

    def _pack_quietly(self, tensor: torch.Tensor) -> torch.Tensor | KeptTensor | SwappedTensor:
        if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter:
            return tensor  # tensor subclasses (DTensor, fake tensors) are left to their own logic
        self.counters.saved_bytes.append(tensor.numel() * tensor.element_size())
        if self.observer is not None:
            self.observer.on_saved(tensor)
        if self.matcher is not None:
            self.device.release_completed()  # swap-outs whose copy landed give their device blocks back now
        ordinal, seen = self._ordinal_of(tensor.untyped_storage())
        entry = None
        if self._eligible(tensor):
            if self.matcher is None:
                entry = self._entry_for(tensor)
            elif seen:  # another view of a storage already decided: swapped (shares its copy) or kept
                if self._by_storage.get(storage_key(tensor.untyped_storage())) is not None:
                    entry = self._entry_for(tensor)
            else:
                op_count = self.op_clock()
                planned = self.matcher.match(ordinal, tensor, op_count)
                if planned is not None:
                    entry = self._entry_for(tensor)
                    if entry is not None and not entry.planned:  # schedule its prefetch (shifted like the save)
                        shift = op_count - planned.save_op_index if op_count >= 0 else 0
                        trigger = planned.swap_in_at + shift
                        heapq.heappush(self._triggers, (trigger, entry.position, weakref.ref(entry)))
                        entry.planned = True
        if entry is not None:
            return SwappedTensor(entry, tensor)
        kept = KeptTensor(tensor)
        if self.matcher is not None and tensor.numel() * tensor.element_size() >= self.min_swap_bytes and self._eligible(tensor):
            self._kept.append(weakref.ref(kept))  # a passive swap may take it later
        return kept

    def _ordinal_of(self, storage: torch.UntypedStorage) -> tuple[int, bool]:
        """Save ordinal of a storage in this iteration, and whether it was saved before (addresses of dead
        storages get reused: checked)."""
        key = storage_key(storage)
        known = self._ordinals.get(key)
        if known is not None and known[1]() is storage:
            return known[0], True
        ordinal = self._next_ordinal
        self._next_ordinal += 1
        self._ordinals[key] = (ordinal, weakref.ref(storage))
        return ordinal, False

    def _entry_for(self, tensor: torch.Tensor) -> SwapEntry | None:
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        ref = self._by_storage.get(key)
        entry = ref() if ref is not None else None
        if entry is not None and entry.version == tensor._version:
            return entry  # same bytes already on their way out: share the host copy
        handle = self.device.copy_to_host(storage)
        if handle is None:
            self.counters.kept_for_host_budget_bytes += storage.nbytes()
            if not self._host_budget_warned:
                logger.warning(
                    "host_memory_budget is full: keeping %s activations on the device (raise host_memory_budget)",
                    format_bytes(storage.nbytes()),
                )
                self._host_budget_warned = True
            return None
        entry = SwapEntry(self.device, handle, tensor._version, position=len(self._order), source=storage)
        if self.observer is not None:
            entry.trace_index = self.observer.on_swap_out(storage)
        self._by_storage[key] = weakref.ref(entry)
        self._watch(storage, entry)
        self._order.append(weakref.ref(entry))
        self.counters.swap_out_bytes += entry.nbytes
        self.counters.swapped_storages += 1
        self._swapped_since_release = True
        return entry

    def _unpack(self, packed: torch.Tensor | KeptTensor | SwappedTensor) -> torch.Tensor:
        with self.quiet():
            return self._unpack_quietly(packed)

    def _unpack_quietly(self, packed: torch.Tensor | KeptTensor | SwappedTensor) -> torch.Tensor:
        if self._triggers:
            self._fire_triggers(self.op_clock())
        if isinstance(packed, KeptTensor):
            if packed.swapped is None:
                return packed.unpack()
            packed = packed.swapped  # taken by a passive swap
        if not isinstance(packed, SwappedTensor):
            return packed
        packed.check_version()
        if self._swapped_since_release:
            # Planned release point: a backward pass begins, so every swap-out issued in the forward pass
            # lets go of its device block, ordered after its copy (the emulated link does this itself).
            self._swapped_since_release = False
            self.device.release_pending()
        entry = packed.entry
        if not entry.restored:
            if not entry.in_flight and entry.planned:
                self.counters.on_demand += 1
            self._swap_in(entry)
            entry.finish_swap_in()
            if not entry.reused_source:  # a restored copy: backward may write it (a retained graph re-reads)
                self._watch(entry.device_bytes.untyped_storage(), entry)
            if not entry.planned:
                self._prefetch_before(entry)
        tensor = packed.rebuild(entry.device_bytes)
        if self.observer is not None and entry.trace_index >= 0:
            self.observer.on_restored(entry.trace_index, tensor)
        return tensor

    def _swap_in(self, entry: SwapEntry) -> None:
        at_op = self.observer.op_count if self.observer is not None else -1
        if entry.start_swap_in():
            self.counters.swap_in_bytes += entry.nbytes
            if self.observer is not None:
                self.observer.on_swap_in(entry.trace_index, at_op)
        elif entry.reused_source and not entry.reuse_counted:
            entry.reuse_counted = True
            self.counters.reused_original_bytes += entry.nbytes

    def _fire_triggers(self, op_count: int) -> None:
        """Start the planned swap-ins whose trigger op has been reached."""
        triggers = self._triggers
        while triggers and (op_count < 0 or triggers[0][0] <= op_count):
            _, _, ref = heapq.heappop(triggers)
            entry = ref()
            if entry is None or entry.restored or entry.in_flight:
                continue
            if not self._prefetch(entry):
                return

    def _prefetch_before(self, entry: SwapEntry) -> None:
        """Keep the next ``prefetch_depth`` storages backward will likely need (saved earlier) coming in."""
        ahead = 0
        for ref in reversed(self._order[: entry.position]):
            if ahead >= self.prefetch_depth:
                return
            candidate = ref()
            if candidate is None or candidate.restored:
                continue
            ahead += 1
            if candidate.in_flight:
                continue
            if not self._prefetch(candidate):
                return

    def _prefetch(self, entry: SwapEntry) -> bool:
        """Start a swap-in ahead of its use; False (and nothing started) when the device has no room."""
        try:
            self._swap_in(entry)
        except torch.OutOfMemoryError:
            logger.debug("prefetch skipped: no device memory for %s", format_bytes(entry.nbytes))
            return False
        self.counters.prefetched += 1
        return True

    # ---- memory pressure --------------------------------------------------------------------
    def relieve_pressure(self, short_bytes: int) -> int:
        """Before an out-of-memory error: let pending swap-outs complete so their blocks are released; if
        that is not enough, swap out idle kept tensors synchronously, best fit first (passive swap)."""
        before = self.device.live_bytes()
        self.device.release_pending()
        self.device.synchronize()
        freed = max(before - self.device.live_bytes(), 0)
        if freed < short_bytes and self._kept:
            freed += self._passive_swap(short_bytes - freed)
        logger.debug("memory pressure (%s short): released %s", format_bytes(short_bytes), format_bytes(freed))
        return freed

    def _passive_swap(self, short_bytes: int) -> int:
        kept = [k for k in (ref() for ref in self._kept) if k is not None and k.swapped is None and k.tensor is not None]
        # best fit: the smallest that covers the shortfall, then the largest ones
        kept.sort(key=lambda k: (k.nbytes < short_bytes, k.nbytes if k.nbytes >= short_bytes else -k.nbytes))
        freed = 0
        for k in kept:
            if freed >= short_bytes:
                break
            before = self.device.live_bytes()
            entry = self._entry_for(k.tensor)
            if entry is None:
                break  # host budget full
            entry.planned = False  # comes back on demand / with the fallback prefetch
            k.swap_out(SwappedTensor(entry, k.tensor))
            self.device.wait(entry.to_host)
            self.device.release_pending()
            self.counters.passive_swaps += 1
            self.counters.passive_swap_bytes += entry.nbytes
            freed += max(before - self.device.live_bytes(), 0)
        return freed
