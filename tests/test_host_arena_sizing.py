"""The pinned arena (issue 37 item 9): sized from the most bytes the host buffers held at once in the first
WarmUp iteration (not the iteration's total swapped bytes: micro-batches x peak), and a fragmented arena lends
a pageable buffer for one copy, counted and logged, instead of evicting every idle buffer and refusing."""

from __future__ import annotations

import logging
import mmap

import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.host_arena import ALIGNMENT_BYTES, HostArena
from chameleon_dist.device.host_pool import HostBufferPool
from tests.test_cuda_device import fake_cuda  # noqa: F401 - the fixture
from tests.test_cuda_pinning import CountingCudart

MiB = 2**20
SLOT = ALIGNMENT_BYTES


class ArenaAllocator:
    def __init__(self):
        self.regions = []

    def __call__(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def reserve_arena(self, nbytes):
        self.regions.append(mmap.mmap(-1, nbytes))
        return HostArena(self.regions[-1], nbytes)


def _in_region(allocator, buffer):
    start = torch.frombuffer(allocator.regions[0], dtype=torch.uint8, count=1).data_ptr()
    return start <= buffer.data_ptr() < start + len(allocator.regions[0])


def test_the_arena_holds_the_most_bytes_in_host_buffers_at_once_not_the_total(fake_cuda, monkeypatch):  # noqa: F811
    fake_cuda.cudart = CountingCudart()
    device = fake_cuda.make(host_memory_budget_bytes=64 * MiB, capacity_bytes=2**30)
    monkeypatch.setattr(device.backend, "is_device_tensor", lambda tensor: tensor.device.type == "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.zeros(1, dtype=torch.uint8),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None, raising=False)
    chameleon = Chameleon({"min_swap_bytes": 4096, "profiler": {"warmup_iterations": 2}}, device=device)
    model = chameleon.attach(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))))
    micro_batches = 4

    def closure():
        for _ in range(micro_batches):  # one forward and backward each: their host buffers come and go
            model(torch.randn(64, 256)).relu().sum().backward()

    model.zero_grad(set_to_none=True)
    chameleon.run_iteration(closure)
    swapped_bytes = chameleon.last_report.swap_out_bytes
    pool = device.host_pool
    assert swapped_bytes > 0 and pool.arena is not None
    assert pool.arena.capacity_bytes == pool.peak_in_use_aligned_bytes  # the high-water mark, 512-aligned
    assert pool.arena.capacity_bytes < swapped_bytes / 2  # not micro-batches x peak
    locks = fake_cuda.cudart.register_calls
    for _ in range(2):  # the same iteration again fits the arena: no page-locking, no fallback
        model.zero_grad(set_to_none=True)
        chameleon.run_iteration(closure)
    assert fake_cuda.cudart.register_calls == locks and pool.pageable_fallbacks == 0


def _fragmented_pool():
    """An arena of 16 slots, the budget's size, all lent; slots 1, 3, 5, 7 free again (fragments of one slot
    each) and slots 9 and 11 idle in the pool."""
    allocator = ArenaAllocator()
    pool = HostBufferPool(16 * SLOT, allocator)
    assert pool.reserve_arena(16 * SLOT) == 16 * SLOT
    slots = [pool.acquire(SLOT) for _ in range(16)]
    assert all(_in_region(allocator, slot) for slot in slots)
    for index in (1, 3, 5, 7):
        pool.release(slots[index])
    assert pool.trim() == 4 * SLOT  # their ranges go back to the arena, apart from each other
    for index in (9, 11):
        pool.release(slots[index])
    kept = [slot for index, slot in enumerate(slots) if index not in (1, 3, 5, 7, 9, 11)]
    return pool, allocator, kept


def test_a_fragmented_arena_lends_a_pageable_buffer_for_one_copy_without_evicting_or_refusing():
    pool, allocator, kept = _fragmented_pool()
    evicted_before = pool.evicted_bytes
    buffer = pool.acquire(2 * SLOT)  # 4 slots free, no two together
    assert buffer is not None and buffer.numel() == 2 * SLOT
    assert not _in_region(allocator, buffer)  # pageable, for this copy
    assert pool.refusals == 0 and pool.evicted_bytes == evicted_before  # the idle slots 9 and 11 stay
    assert pool.cached_bytes == 2 * SLOT
    assert pool.pageable_fallbacks == 1 and pool.pageable_fallback_bytes == 2 * SLOT
    assert pool.reserved_bytes <= pool.budget_bytes  # it stands in for the arena's unusable free bytes
    pool.release(buffer)  # freed, not cached: the next copy tries the arena again
    assert pool.cached_bytes == 2 * SLOT and pool.pageable_in_use_bytes == 0
    assert pool.acquire(SLOT) is not None and pool.pageable_fallbacks == 1  # an idle slot: no fallback


def test_pageable_fallbacks_are_bounded_by_the_arenas_unusable_free_bytes():
    pool, _allocator, _kept = _fragmented_pool()
    lent = [pool.acquire(2 * SLOT), pool.acquire(2 * SLOT)]  # 4 free slots stand for both
    assert all(buffer is not None for buffer in lent) and pool.pageable_fallbacks == 2
    assert pool.evicted_bytes == 4 * SLOT  # (the trim's only)
    third = pool.acquire(2 * SLOT)  # the idle slots give their ranges back, and those are fragments too
    assert third is not None and pool.pageable_fallbacks == 3 and pool.cached_bytes == 0
    assert pool.acquire(2 * SLOT) is None  # nothing left to stand for a fourth: refused
    assert pool.refusals == 1 and pool.reserved_bytes <= pool.budget_bytes


def test_the_runtime_logs_the_pageable_fallbacks_of_an_iteration(caplog):
    from chameleon_dist import EmulatedDevice

    device = EmulatedDevice(10**9)
    pool, _allocator, kept = _fragmented_pool()
    device.host_pool = pool
    chameleon = Chameleon({"min_swap_bytes": 0, "enabled": True}, device=device)
    with caplog.at_level(logging.INFO, logger="chameleon_dist"), chameleon.iteration():
        pool.release(pool.acquire(2 * SLOT))
    lines = [r.getMessage() for r in caplog.records if "pageable" in r.getMessage()]
    assert len(lines) == 1 and "1 host buffer" in lines[0] and "fragmented" in lines[0], lines
