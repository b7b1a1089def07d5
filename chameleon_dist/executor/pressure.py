"""What the swap executor does when the device is about to run out of memory (``relieve_pressure``).

NOTE [Relief under pressure]
The device calls the executor's ``relieve_pressure(short_bytes)`` (its ``PressureRelief.relieve``) before it
raises out-of-memory. In order, each step only when the previous ones freed too little:
1. Swap-outs: issue the placed ones that are due later and release every held source, in-flight copies
   included, ordered on the device: each owning stream waits for its copy's done-event, so the op that
   runs next on it reuses the block only after the copy has read it; the host never synchronises (the
   time the stream waits is stall; ``pressure_waits``).
2. Prefetches: give back device bytes restored ahead of their use while a host copy still exists, the
   ones needed last first: swap-ins started early (a host buffer goes back only when backward uses the
   restored bytes), and restores that reused a device original because its slow swap-out had not landed
   yet (once it has). Each comes back again on demand, at the cost of another copy (``evicted_prefetches``;
   ``SwapEntry.evict``). Prefetching exists to hide copy time, never to cost an out-of-memory error:
   without this step a run could fail at a capacity where the same run without prefetching fits. Not
   done when the allocation under pressure is itself a prefetch (that one is simply skipped).
3. Passive swap: swap idle kept tensors out synchronously, best fit first (``passive_swaps``).

"Enough" is the request fitting, not ``short_bytes`` freed: on a caching allocator the freed bytes stay in their
stream's pool inside segments that live blocks pin, and the retry needs one block that fits on the right
stream (NOTE [The caching allocator model] in device/simulated/caching.py). Where the device can tell
(``pressure_request_fits``: the emulated device's caching model) a step goes on until the request fits, even
past ``short_bytes``; where it cannot (None), ``short_bytes`` freed is enough (on CUDA it carries a
fragmentation margin). If relief ends with the request still not fitting, the retry raises an error that names
``expandable_segments`` when the free bytes were there, in the wrong segments.

In a multi-rank job these steps are all there is: an out-of-memory error cannot be retried by one rank
alone (NOTE [One rank cannot retry alone] in integrations/megatron/install.py).

Relief runs on whichever thread ran short (the iteration's, an autograd device thread), always under the
executor's lock (``SwapExecutor.relieve_pressure``): one relief at a time, and never while another thread is
half-way through a pack or unpack of the entries it walks (NOTE [Threads and locks] in device/locking.py).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Callable

from chameleon_dist.executor.records import SwappedTensor
from chameleon_dist.units import format_bytes

if TYPE_CHECKING:
    from chameleon_dist.device.base import Device
    from chameleon_dist.executor.attempt import SwapAttempt
    from chameleon_dist.executor.context import SwapCounters
    from chameleon_dist.executor.records import KeptTensor, SwapEntry

logger = logging.getLogger(__name__)


class PressureRelief:
    """The memory-pressure steps (NOTE [Relief under pressure]) of one ``SwapExecutor``, over the attempt it
    hands in with each call (``SwapAttempt``: its placed swap-outs, swapped entries in save order and kept
    tensors, all weakly held).

    Args:
        device: the executor's device.
        entry_for: makes (or finds) the entry a kept tensor leaves the device with, read back on ``reader``;
            None when the host budget has no room.
        issue_pending_swap_outs: issues every placed swap-out not issued yet, now.
    """

    def __init__(
        self,
        device: "Device",
        entry_for: Callable[..., "SwapEntry | None"],
        issue_pending_swap_outs: Callable[[], None],
    ) -> None:
        self._device = device
        self._entry_for = entry_for
        self._issue_pending_swap_outs = issue_pending_swap_outs

    def _enough(self, freed_bytes: int, short_bytes: int) -> bool:
        """The request under pressure fits now (where the device can tell), else ``short_bytes`` are freed."""
        request_fits = getattr(self._device, "pressure_request_fits", None)
        fits = request_fits() if request_fits is not None else None
        return fits if fits is not None else freed_bytes >= short_bytes

    def relieve(self, short_bytes: int, attempt: "SwapAttempt", counters: "SwapCounters") -> int:
        """Free device memory until the request under pressure fits (or ``short_bytes`` are freed, where the
        device cannot tell), from what ``attempt`` holds; count it on ``counters``. Returns the bytes freed."""
        before = self._device.live_bytes()
        if attempt.placed.swap_outs:
            self._issue_pending_swap_outs()
        self._device.release_all_sources()  # stream-ordered: each block's reuse waits for its copy, the host does not
        freed = max(before - self._device.live_bytes(), 0)
        waited = freed > 0
        if not self._enough(freed, short_bytes) and not attempt.prefetching:
            freed += self._evict_prefetches(short_bytes - freed, attempt.order, counters)
        passive_swaps = counters.passive_swaps
        if not self._enough(freed, short_bytes) and attempt.kept:
            freed += self._passive_swap(short_bytes - freed, attempt.kept, counters)
        if waited and counters.passive_swaps == passive_swaps:
            counters.pressure_waits += 1
        logger.debug("memory pressure (%s short): released %s", format_bytes(short_bytes), format_bytes(freed))
        return freed

    def _evict_prefetches(self, short_bytes: int, entries: list[weakref.ReferenceType["SwapEntry"]],
                          counters: "SwapCounters") -> int:
        """Step 2: restored bytes with a host copy to come back from go, the earliest saved (needed last)
        first. Memory comes free only where nothing else holds the bytes (an op using them now does)."""
        freed = 0
        for ref in entries:
            if self._enough(freed, short_bytes):
                break
            entry = ref()
            if entry is None or entry.to_host is None:
                continue  # no host copy (restored and used, recomputed, or never copied)
            before = self._device.live_bytes()
            if entry.in_flight:
                self._device.wait(entry.to_device)  # the copy writes into the block: it must land before it goes
                entry.evict()
            elif entry.reused_source:
                self._device.wait(entry.to_host)  # the host copy must be complete before the original goes
                entry.evict()
            else:
                continue
            counters.evicted_prefetches += 1
            freed += max(before - self._device.live_bytes(), 0)
        return freed

    def _passive_swap(self, short_bytes: int, kept_refs: list[weakref.ReferenceType["KeptTensor"]],
                      counters: "SwapCounters") -> int:
        """Step 3: idle kept tensors leave the device synchronously, best fit first."""
        kept = [k for k in (ref() for ref in kept_refs) if k is not None and k.swapped is None and k.tensor is not None]
        # best fit: the smallest that covers the shortfall, then the largest ones
        kept.sort(key=lambda k: (k.nbytes < short_bytes, k.nbytes if k.nbytes >= short_bytes else -k.nbytes))
        freed = 0
        for k in kept:
            if self._enough(freed, short_bytes):
                break
            before = self._device.live_bytes()
            entry = self._entry_for(k.tensor, reader=k.stream)  # (read in backward on the stream current at its save)
            if entry is None:
                break  # host budget full
            entry.planned = False  # comes back on demand / with the fallback prefetch
            k.swap_out(SwappedTensor(entry, k.tensor))
            self._device.wait(entry.to_host)
            self._device.release_all_sources()
            counters.passive_swaps += 1
            counters.passive_swap_bytes += entry.nbytes
            freed += max(before - self._device.live_bytes(), 0)
        return freed
