"""What the swap executor does when the device is about to run out of memory (``relieve_pressure``).

NOTE [Relief under pressure]
The device calls ``relieve_pressure(short_bytes)`` before it raises out-of-memory. In order, each step only
when the previous ones freed too little:
1. Swap-outs: issue the placed ones that are due later, let every in-flight copy land and release its
   source (the time waited is stall; ``pressure_waits``).
2. Prefetches: give back device bytes restored ahead of their use while a host copy still exists, the
   ones needed last first: swap-ins started early (a host buffer goes back only when backward uses the
   restored bytes), and restores that reused a device original because its slow swap-out had not landed
   yet (once it has). Each comes back again on demand, at the cost of another copy (``evicted_prefetches``;
   ``SwapEntry.evict``). Prefetching exists to hide copy time, never to cost an out-of-memory error:
   without this step a run could fail at a capacity where the same run without prefetching fits. Not
   done when the allocation under pressure is itself a prefetch (that one is simply skipped).
3. Passive swap: swap idle kept tensors out synchronously, best fit first (``passive_swaps``).

In a multi-rank job these steps are all there is: an out-of-memory error cannot be retried by one rank
alone (NOTE [One rank cannot retry alone] in integrations/megatron/install.py).
"""

from __future__ import annotations

import logging

from chameleon_dist.executor.records import SwappedTensor
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)


class PressureRelief:
    """The executor's memory-pressure steps (NOTE [Relief under pressure]). A part of ``SwapExecutor``: it
    uses the executor's ``device``, ``counters``, ``_placed``, ``_order`` (swapped entries in save order),
    ``_kept`` (kept tensors a passive swap may take), ``_prefetching`` and ``_entry_for``."""

    def relieve_pressure(self, short_bytes: int) -> int:
        """Free at least ``short_bytes`` of device memory if possible; returns the bytes freed."""
        before = self.device.live_bytes()
        if self._placed.swap_outs:
            self._issue_overdue(everything=True)
        self.device.release_all_sources()
        self.device.synchronize()
        freed = max(before - self.device.live_bytes(), 0)
        waited = freed > 0
        if freed < short_bytes and not self._prefetching:
            freed += self._evict_prefetches(short_bytes - freed)
        passive_swaps = self.counters.passive_swaps
        if freed < short_bytes and self._kept:
            freed += self._passive_swap(short_bytes - freed)
        if waited and self.counters.passive_swaps == passive_swaps:
            self.counters.pressure_waits += 1
        logger.debug("memory pressure (%s short): released %s", format_bytes(short_bytes), format_bytes(freed))
        return freed

    def _evict_prefetches(self, short_bytes: int) -> int:
        """Step 2: restored bytes with a host copy to come back from go, the earliest saved (needed last)
        first. Memory comes free only where nothing else holds the bytes (an op using them now does)."""
        freed = 0
        for ref in self._order:
            if freed >= short_bytes:
                break
            entry = ref()
            if entry is None or entry.to_host is None:
                continue  # no host copy (restored and used, recomputed, or never copied)
            before = self.device.live_bytes()
            if entry.in_flight:
                self.device.wait(entry.to_device)  # the copy writes into the block: it must land before it goes
                entry.evict()
            elif entry.reused_source:
                self.device.wait(entry.to_host)  # the host copy must be complete before the original goes
                entry.evict()
            else:
                continue
            self.counters.evicted_prefetches += 1
            freed += max(before - self.device.live_bytes(), 0)
        return freed

    def _passive_swap(self, short_bytes: int) -> int:
        """Step 3: idle kept tensors leave the device synchronously, best fit first."""
        kept = [k for k in (ref() for ref in self._kept) if k is not None and k.swapped is None and k.tensor is not None]
        # best fit: the smallest that covers the shortfall, then the largest ones
        kept.sort(key=lambda k: (k.nbytes < short_bytes, k.nbytes if k.nbytes >= short_bytes else -k.nbytes))
        freed = 0
        for k in kept:
            if freed >= short_bytes:
                break
            before = self.device.live_bytes()
            entry = self._entry_for(k.tensor, stream=k.stream)
            if entry is None:
                break  # host budget full
            entry.planned = False  # comes back on demand / with the fallback prefetch
            k.swap_out(SwappedTensor(entry, k.tensor))
            self.device.wait(entry.to_host)
            self.device.release_all_sources()
            self.counters.passive_swaps += 1
            self.counters.passive_swap_bytes += entry.nbytes
            freed += max(before - self.device.live_bytes(), 0)
        return freed
