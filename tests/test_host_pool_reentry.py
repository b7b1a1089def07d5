"""The host pool and its arena with finalizers and threads (issue 37 item 11, host-pool part): a finalizer that
gives a buffer back may run inside ``acquire`` (garbage collection, or a buffer whose last reference the pool
drops while it evicts), on the thread that holds the pool's lock; two threads share one pool."""

from __future__ import annotations

import gc
import mmap
import threading
import weakref

import pytest
import torch

from chameleon_dist.device.host_arena import HostArena
from chameleon_dist.device.host_pool import HostBufferPool

DEADLOCK_GUARD_S = 20  # only to turn a deadlock into a failure; a passing run takes milliseconds


def _in_thread(work):
    """Run ``work`` on a daemon thread: a deadlock fails the test instead of hanging the suite."""
    outcome = {}

    def run():
        try:
            outcome["value"] = work()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLOCK_GUARD_S)
    assert not thread.is_alive(), "deadlocked: a finalizer re-entered the pool's lock"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_a_finalizer_run_by_an_eviction_inside_acquire_gives_its_buffer_back():
    pool = HostBufferPool(budget_bytes=2000)
    held = pool.acquire(500)
    idle = pool.acquire(1000)
    pool.release(idle)  # the pool's reference is now the only one
    weakref.finalize(idle.untyped_storage(), pool.release, held)  # its death gives `held` back
    del idle
    # 1500 reserved + 1200 > 2000: acquire evicts the idle 1000, whose finalizer releases `held` in there
    fresh = _in_thread(lambda: pool.acquire(1200))
    assert fresh is not None and fresh.numel() == 1200
    assert pool.in_use_bytes == 1200  # `held` came back to the pool, counted once
    assert pool.cached_bytes == 500 and pool.reserved_bytes == 1700
    assert pool.acquire(500).data_ptr() == held.data_ptr()  # and is lent again


class _Cycle:
    """A reference cycle only garbage collection frees; its finalizer releases a buffer."""

    def __init__(self, pool, buffer):
        self.me = self
        weakref.finalize(self, pool.release, buffer)


class _CollectingArena(HostArena):
    """An arena whose ``take`` runs garbage collection first, as any allocation inside ``acquire`` may."""

    def take(self, nbytes):
        gc.collect()
        return super().take(nbytes)


@pytest.mark.slow  # (out of the quick tier: 6.5 s loaded)
def test_a_finalizer_run_by_garbage_collection_inside_acquire_gives_its_buffer_back():
    class ArenaAllocator:
        def __call__(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8)

        def reserve_arena(self, nbytes):
            return _CollectingArena(mmap.mmap(-1, nbytes), nbytes)

    pool = HostBufferPool(budget_bytes=None, allocate=ArenaAllocator())
    assert pool.reserve_arena(8192) == 8192
    held = pool.acquire(1024)
    held.fill_(7)
    gc.disable()
    try:
        _Cycle(pool, held)  # garbage now, freed at the next collection
        fresh = _in_thread(lambda: pool.acquire(2048))  # the arena's take collects: the finalizer runs there
    finally:
        gc.enable()
    assert fresh is not None and fresh.numel() == 2048
    assert pool.in_use_bytes == 2048 and pool.cached_bytes == 1024
    assert pool.acquire(1024).data_ptr() == held.data_ptr()


def test_two_threads_acquiring_and_releasing_share_one_pool():
    pool = HostBufferPool(budget_bytes=64 * 4096, window_cycles=2)
    rounds = 300
    problems = []
    start = threading.Barrier(2)

    def worker(mark: int) -> None:
        start.wait()
        for step in range(rounds):
            nbytes = 512 * (1 + (step * 7 + mark) % 9)
            buffers = [pool.acquire(nbytes), pool.acquire(nbytes + 512)]
            for buffer in buffers:
                if buffer is not None:
                    buffer.fill_(mark)
            for buffer in buffers:
                if buffer is not None:
                    if not bool((buffer == mark).all()):
                        problems.append(f"thread {mark}: a buffer it held was written by the other thread")
                    pool.release(buffer)

    threads = [threading.Thread(target=worker, args=(mark,), daemon=True) for mark in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLOCK_GUARD_S)
    assert not any(thread.is_alive() for thread in threads), "deadlocked"
    assert not problems, problems[:3]
    assert pool.in_use_bytes == 0
    assert pool.reserved_bytes == pool.cached_bytes <= pool.budget_bytes
    assert pool.cached_bytes == sum(size for size, _buffer in pool._idle.values())


@pytest.mark.slow  # (out of the quick tier: 4 s loaded)
def test_arena_ranges_come_back_whichever_thread_drops_its_buffers():
    arena = HostArena(mmap.mmap(-1, 64 * 512), 64 * 512)
    start = threading.Barrier(2)
    problems = []

    def worker(mark: int) -> None:
        start.wait()
        for step in range(400):
            buffers = [arena.take(512 * (1 + (step + mark) % 3)) for _ in range(3)]
            for buffer in buffers:
                if buffer is not None:
                    buffer.fill_(mark)
            if any(buffer is not None and not bool((buffer == mark).all()) for buffer in buffers):
                problems.append(f"thread {mark}: a range lent twice")
            del buffers  # their finalizers give the ranges back, on this thread, maybe while the other holds the lock

    threads = [threading.Thread(target=worker, args=(mark,), daemon=True) for mark in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLOCK_GUARD_S)
    assert not any(thread.is_alive() for thread in threads), "deadlocked"
    gc.collect()
    assert not problems, problems[:3]
    assert arena.lent_bytes == 0 and arena.free_bytes == arena.capacity_bytes
    assert arena.take(64 * 512) is not None  # every range merged back into one
