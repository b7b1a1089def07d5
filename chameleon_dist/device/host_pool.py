"""A bounded pool of host buffers: exact-size reuse, and idle buffers bounded by recent use.

Swapped activations repeat with the same sizes every iteration, so a released buffer is handed out again
for the same byte size; nothing is rounded up to a power of two (rounding costs up to ~1.8x host RAM in
other offloaders). When no idle buffer has the exact size, the smallest idle one at most
``reuse_slack_fraction`` larger is lent as a view of its first ``nbytes`` (bounded waste, and no new
pinned allocation when shapes change a little).

Two bounds keep host memory tied to what is in use:

- ``budget_bytes`` (``host_memory_budget``) bounds everything the pool holds, in use or idle; when a new
  buffer would exceed it, idle buffers are freed (least recently released first), and if that is not
  enough ``acquire`` returns ``None`` so the caller keeps the tensor on the device instead of crashing.
- Idle buffers are capped at ``idle_cap_factor`` times the peak bytes in use over the last
  ``window_cycles`` cycles (a cycle ends each time nothing is in use any more, e.g. at the end of an
  iteration's backward pass); beyond it the least recently released idle buffers are freed. In a steady
  state the sizes repeat and everything idle is reused, so nothing is freed; when every iteration brings
  new sizes (a different batch shape each step), old sizes age out instead of piling up to the budget.

An allocator that can pre-reserve (``reserve_arena``: the CUDA device's pinned allocator) gets one
``HostArena`` from ``reserve_arena``, once, after the first WarmUp iteration: new buffers are then slices
of it (no page-locking in the save path when sizes change); its unlent bytes count as reserved, so the
budget still bounds everything held from the host. Only a buffer the arena cannot hold is allocated apart.
``reserve_arena`` is given the most bytes the host buffers held at once (``peak_in_use_aligned_bytes``, each
buffer 512-aligned as the arena lends it), not the iteration's total swapped bytes (micro-batches x peak).

NOTE [A fragmented arena]
When the arena's free bytes would hold a request but no free range does (buffers of changing sizes died in
another order), the pool lends a pageable buffer for that one copy (``pageable_fallbacks``, counted and
logged by the runtime per iteration) instead of evicting idle buffers that hold no range it could use and
then refusing. Such a buffer stands in for arena bytes that are free but unusable while fragmented: it
counts in ``in_use_bytes`` and the arena's free bytes count less by as much in ``reserved_bytes``, and the
pageable buffers lent never exceed the arena's free bytes (less those already stood in for). So the host
memory actually held may pass the budget by at most the pageable bytes in use, a transient excess bounded
by the arena's fragmented free bytes (``pageable_in_use_bytes``). It is freed when released (never cached):
the next copy tries the arena again. Idle buffers are evicted for the arena only while its free bytes are
short of the request.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
from typing import Callable

import torch

from chameleon_dist.device.host_arena import ALIGNMENT_BYTES, HostArena
from chameleon_dist.device.host_lock import DeferringLock
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

Allocator = Callable[[int], torch.Tensor]

IDLE_CAP_FACTOR = 2.0
"""Idle (cached) bytes are kept up to this multiple of the recent peak bytes in use."""

WINDOW_CYCLES = 16
"""How many recent in-use cycles the peak is taken over."""

REUSE_SLACK_FRACTION = 0.125
"""An idle buffer up to this fraction larger than a request may serve it (as a view of its start)."""


def _aligned(nbytes: int) -> int:
    """``nbytes`` as the arena lends it: rounded up to ``ALIGNMENT_BYTES``."""
    return -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def host_key(buffer: torch.Tensor) -> int:
    """A lent host buffer's identity: its storage (a view lent from a larger buffer shares the larger one's, and
    one buffer is lent once at a time). Not the data pointer: a meta-tensor device's buffers have none."""
    return buffer.untyped_storage()._cdata


def plain_host_allocator(nbytes: int) -> torch.Tensor:
    """Pageable host memory (the emulated device's host side)."""
    return torch.empty(nbytes, dtype=torch.uint8)


class IdleBuffers:
    """The pool's idle (cached) buffers, by release order and by size: the most recently released of a size is
    reused first, the least recently released of all is evicted first. The pool counts their bytes."""

    def __init__(self) -> None:
        self._stamp = 0
        self._by_stamp: collections.OrderedDict[int, tuple[int, torch.Tensor]] = collections.OrderedDict()
        self._by_size: dict[int, collections.deque[int]] = {}  # size -> stamps, oldest first
        self._sizes: list[int] = []  # sorted sizes that have idle buffers

    def __bool__(self) -> bool:
        return bool(self._by_stamp)

    def values(self):
        """(size, buffer) of every idle buffer, oldest first."""
        return self._by_stamp.values()

    def add(self, nbytes: int, buffer: torch.Tensor) -> None:
        """``buffer`` (``nbytes`` long) is idle, the most recently released."""
        self._stamp += 1
        self._by_stamp[self._stamp] = (nbytes, buffer)
        stamps = self._by_size.get(nbytes)
        if stamps is None:
            stamps = self._by_size[nbytes] = collections.deque()
            bisect.insort(self._sizes, nbytes)
        stamps.append(self._stamp)

    def take(self, nbytes: int, slack_fraction: float) -> tuple[int, torch.Tensor] | None:
        """The most recently released idle buffer of the smallest size in [nbytes, nbytes x (1 + slack)], with
        its size, taken out; None when there is none."""
        index = bisect.bisect_left(self._sizes, nbytes)
        if index == len(self._sizes):
            return None
        size = self._sizes[index]
        if size != nbytes and (nbytes == 0 or size > nbytes + nbytes * slack_fraction):
            return None
        stamps = self._by_size[size]
        _, buf = self._by_stamp.pop(stamps.pop())
        if not stamps:
            self._drop_size(size)
        return size, buf

    def take_oldest(self) -> int:
        """Take out the least recently released idle buffer (there is one); returns its size."""
        _stamp, (size, _buf) = self._by_stamp.popitem(last=False)
        stamps = self._by_size[size]
        stamps.popleft()  # the oldest of its size is the oldest overall among them
        if not stamps:
            self._drop_size(size)
        return size

    def _drop_size(self, size: int) -> None:
        del self._by_size[size]
        del self._sizes[bisect.bisect_left(self._sizes, size)]


class RecentPeaks:
    """The peak bytes in use of the current cycle of use and of the last ``window_cycles`` ones (a cycle ends
    each time nothing is in use any more): what the idle buffers are capped by."""

    def __init__(self, window_cycles: int) -> None:
        self.cycle_bytes = 0
        self._recent_bytes: collections.deque[int] = collections.deque(maxlen=window_cycles)

    def note(self, in_use_bytes: int) -> None:
        self.cycle_bytes = max(self.cycle_bytes, in_use_bytes)

    def end_cycle(self) -> None:
        self._recent_bytes.append(self.cycle_bytes)
        self.cycle_bytes = 0

    @property
    def peak_bytes(self) -> int:
        """The highest of the current cycle's peak and the recent ones."""
        return max(max(self._recent_bytes, default=0), self.cycle_bytes)


@dataclasses.dataclass
class PageableLoans:
    """The pageable buffers lent in place of a fragmented arena's free bytes (NOTE [A fragmented arena])."""

    lent: dict[int, int] = dataclasses.field(default_factory=dict)  # host_key -> aligned bytes lent pageable
    in_use_bytes: int = 0
    fallbacks: int = 0
    fallback_bytes: int = 0
    logged_fallbacks: int = 0  # as of the last ``log_pageable_fallbacks``
    logged_fallback_bytes: int = 0


class HostBufferPool:
    """Thread-safe host buffer pool bounded by ``budget_bytes`` (``None`` = unbounded) and, for idle
    buffers, by ``idle_cap_factor`` x the peak in use over the last ``window_cycles`` cycles."""

    def __init__(
        self,
        budget_bytes: int | None,
        allocate: Allocator = plain_host_allocator,
        *,
        idle_cap_factor: float = IDLE_CAP_FACTOR,
        window_cycles: int = WINDOW_CYCLES,
        reuse_slack_fraction: float = REUSE_SLACK_FRACTION,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"host_memory_budget must be >= 0 bytes, got {budget_bytes}")
        if idle_cap_factor < 1 or window_cycles < 1 or reuse_slack_fraction < 0:
            raise ValueError(
                f"idle_cap_factor must be >= 1 (got {idle_cap_factor}), window_cycles >= 1 (got {window_cycles}), "
                f"reuse_slack_fraction >= 0 (got {reuse_slack_fraction})"
            )
        self.budget_bytes = budget_bytes
        self.idle_cap_factor = idle_cap_factor
        self.reuse_slack_fraction = reuse_slack_fraction
        self._allocate = allocate
        self._lock = DeferringLock()  # finalizers release buffers: possibly inside acquire (host_lock.py)
        self._idle = IdleBuffers()
        self._lent: dict[int, torch.Tensor] = {}  # host_key of a lent view -> the larger buffer it views
        self._peaks = RecentPeaks(window_cycles)
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_in_use_bytes = 0
        self.refusals = 0
        self.allocations = 0
        self.evicted_bytes = 0
        self.arena: HostArena | None = None
        self.arena_attempted = False
        self.in_use_aligned_bytes = 0  # in use, each buffer rounded up as the arena would lend it
        self.peak_in_use_aligned_bytes = 0  # the arena's size (reserve_arena)
        self._pageable = PageableLoans()  # (NOTE [A fragmented arena])

    @property
    def pageable_in_use_bytes(self) -> int:
        """Aligned bytes lent pageable now, in place of the fragmented arena's free bytes."""
        return self._pageable.in_use_bytes

    @property
    def pageable_fallbacks(self) -> int:
        """Pageable buffers lent so far (NOTE [A fragmented arena])."""
        return self._pageable.fallbacks

    @property
    def pageable_fallback_bytes(self) -> int:
        """Bytes of the pageable buffers lent so far."""
        return self._pageable.fallback_bytes

    def adopt_budget(self, budget_bytes: int | None) -> None:
        """Take ``budget_bytes`` as the budget of a pool made without one (a device built before its runtime's
        config was read: the runtime hands it the config's). A pool that has a budget keeps it (a different
        one is the caller's error to report)."""
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"host_memory_budget must be >= 0 bytes, got {budget_bytes}")
        if self.budget_bytes is None:
            self.budget_bytes = budget_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the host: buffers in use, cached free ones, and the arena's unlent bytes."""
        arena_free_bytes = 0 if self.arena is None else max(self.arena.free_bytes - self.pageable_in_use_bytes, 0)
        return self.in_use_bytes + self.cached_bytes + arena_free_bytes

    def reserve_arena(self, nbytes: int) -> int:
        """Pre-reserve one arena of ``nbytes`` (bounded by the budget, after freeing every idle buffer) from an
        allocator that can (``reserve_arena(nbytes) -> HostArena | None``); tried once per pool. Returns the
        arena's bytes (0: none: the allocator cannot, nothing to size it by, no room, or it failed)."""
        reserve = getattr(self._allocate, "reserve_arena", None)
        if reserve is None or self.arena_attempted or nbytes <= 0:
            return 0
        self.arena_attempted = True
        with self._lock:
            self._evict_locked(self.cached_bytes)  # the arena replaces them
            room_bytes = nbytes if self.budget_bytes is None else min(nbytes, self.budget_bytes - self.reserved_bytes)
        if room_bytes <= 0:
            return 0
        arena = reserve(room_bytes)
        with self._lock:
            self.arena = arena
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return 0 if arena is None else arena.capacity_bytes

    def log_pageable_fallbacks(self, iteration: int) -> int:
        """Log the pageable fallbacks since the last call (NOTE [A fragmented arena]); returns their number."""
        with self._lock:
            loans = self._pageable
            count = loans.fallbacks - loans.logged_fallbacks
            nbytes = loans.fallback_bytes - loans.logged_fallback_bytes
            loans.logged_fallbacks, loans.logged_fallback_bytes = loans.fallbacks, loans.fallback_bytes
        if count:
            logger.info("iteration %d: %d host buffer%s (%s) pageable for one copy: the pinned arena of %s was "
                        "fragmented (%s in all so far); synchronous copies, slower, never wrong", iteration, count,
                        "" if count == 1 else "s", format_bytes(nbytes),
                        format_bytes(0 if self.arena is None else self.arena.capacity_bytes), self.pageable_fallbacks)
        return count

    @property
    def idle_cap_bytes(self) -> int:
        """The most idle bytes kept now: ``idle_cap_factor`` x the recent peak in use."""
        return int(self.idle_cap_factor * self._peaks.peak_bytes)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 host buffer of exactly ``nbytes`` elements, or ``None`` when the budget has no room."""
        with self._lock:
            reused = self._take_idle_locked(nbytes)
            if reused is not None:
                self._note_in_use_locked(reused.numel())
                if reused.numel() == nbytes:
                    return reused
                view = reused[:nbytes]
                self._lent[host_key(view)] = reused
                return view
            sliced = self._take_arena_locked(nbytes)
            if sliced is not None:
                return sliced
            if self._arena_fragmented_for_locked(nbytes):
                return self._pageable_fallback_locked(nbytes)
            if self.budget_bytes is not None and self.reserved_bytes + nbytes > self.budget_bytes:
                self._evict_locked(self.reserved_bytes + nbytes - self.budget_bytes)
                sliced = self._take_arena_locked(nbytes)  # evicted slices went back to the arena
                if sliced is not None:
                    return sliced
                if self.reserved_bytes + nbytes > self.budget_bytes:
                    self.refusals += 1
                    return None
            self._note_in_use_locked(nbytes)
            self.allocations += 1
        try:
            return self._allocate(nbytes)
        except BaseException:
            with self._lock:
                self.in_use_bytes -= nbytes
                self.in_use_aligned_bytes -= _aligned(nbytes)
            raise

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from ``acquire`` for reuse. Safe from a finalizer, also one that garbage
        collection runs inside ``acquire``: then it takes effect when that section ends (``host_lock.py``)."""
        self._lock.run_or_defer(self._release_now, buf)

    def _release_now(self, buf: torch.Tensor) -> None:
        with self._lock:
            base = self._lent.pop(host_key(buf), None) if buf.numel() else None
            if base is None:
                base = buf
            nbytes = base.numel()
            self.in_use_bytes -= nbytes
            self.in_use_aligned_bytes -= _aligned(nbytes)
            pageable_bytes = self._pageable.lent.pop(host_key(base), None) if nbytes else None
            if pageable_bytes is not None:  # freed, not cached (NOTE [A fragmented arena])
                self._pageable.in_use_bytes -= pageable_bytes
                self._end_cycle_if_idle_locked()
                return
            self.cached_bytes += nbytes
            self._idle.add(nbytes, base)
            self._end_cycle_if_idle_locked()
            over_bytes = self.cached_bytes - self.idle_cap_bytes
            if over_bytes > 0:
                self._evict_locked(over_bytes)

    def trim(self) -> int:
        """Free every cached buffer; returns the bytes given back to the host."""
        with self._lock:
            return self._evict_locked(self.cached_bytes)

    # ---- internals (called with the lock held) ----------------------------------------------
    def _end_cycle_if_idle_locked(self) -> None:
        if self.in_use_bytes == 0:  # a cycle of use ended
            self._peaks.end_cycle()

    def _arena_fragmented_for_locked(self, nbytes: int) -> bool:
        """The arena's free bytes, less what pageable fallbacks stand in for, would hold ``nbytes`` but no
        free range does (NOTE [A fragmented arena])."""
        if self.arena is None or nbytes <= 0:
            return False
        return self.arena.free_bytes - self.pageable_in_use_bytes >= _aligned(nbytes)

    def _pageable_fallback_locked(self, nbytes: int) -> torch.Tensor:
        """A pageable buffer for one copy, in place of the fragmented arena's free bytes."""
        buffer, loans = plain_host_allocator(nbytes), self._pageable
        loans.lent[host_key(buffer)] = _aligned(nbytes)
        loans.in_use_bytes += _aligned(nbytes)
        loans.fallbacks += 1
        loans.fallback_bytes += nbytes
        self._note_in_use_locked(nbytes)
        return buffer

    def _note_in_use_locked(self, nbytes: int) -> None:
        self.in_use_bytes += nbytes
        self.in_use_aligned_bytes += _aligned(nbytes)
        self.peak_in_use_aligned_bytes = max(self.peak_in_use_aligned_bytes, self.in_use_aligned_bytes)
        self._peaks.note(self.in_use_bytes)
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _take_arena_locked(self, nbytes: int) -> torch.Tensor | None:
        """A slice of the arena (its bytes were reserved already: the budget is not asked), or None. Idle
        buffers of other sizes give their ranges back first (least recently released first) when it is full."""
        if self.arena is None:
            return None
        buffer = self.arena.take(nbytes)
        while buffer is None and self._idle and self.arena.free_bytes - self.pageable_in_use_bytes < _aligned(nbytes) \
                and self.arena.capacity_bytes >= nbytes:
            self._evict_locked(1)  # the oldest idle buffer: its range goes back (fragmented: NOTE [A fragmented arena])
            buffer = self.arena.take(nbytes)
        if buffer is not None:
            self._note_in_use_locked(nbytes)
            self.allocations += 1
        return buffer

    def _take_idle_locked(self, nbytes: int) -> torch.Tensor | None:
        """The most recently released idle buffer of the smallest size in [nbytes, nbytes x (1 + slack)]."""
        taken = self._idle.take(nbytes, self.reuse_slack_fraction)
        if taken is None:
            return None
        size, buf = taken
        self.cached_bytes -= size
        return buf

    def _evict_locked(self, want_bytes: int) -> int:
        """Free idle buffers, least recently released first, until ``want_bytes`` are freed or none is left."""
        freed = 0
        while self._idle and freed < want_bytes:
            freed += self._idle.take_oldest()
        self.cached_bytes -= freed
        self.evicted_bytes += freed
        return freed
