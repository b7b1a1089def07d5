"""Pinning that cannot poison CUDA (issue 24 item 5), on the fake CUDA backend of ``test_cuda_device``: a
failed ``cudaHostRegister`` leaves no error for the next kernel and falls back to pageable memory with one
warning; after the first WarmUp a pinned arena is reserved once and the save path page-locks nothing."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.host_pool import HostBufferPool
from tests.test_cuda_device import FakeCudart, fake_cuda  # noqa: F401 - the fixture

MiB = 2**20
CUDA_ERROR_MEMORY_ALLOCATION = 2


class FailingCudart(FakeCudart):
    """``cudaHostRegister`` fails and, as the CUDA runtime does, leaves the error as this thread's last error.
    With ``expose_get_last_error=False`` it has only what PyTorch's bindings have (no ``cudaGetLastError``)."""

    def __init__(self, expose_get_last_error: bool = True) -> None:
        super().__init__()
        self.register_calls = 0
        self.last_error = 0
        if expose_get_last_error:
            self.cudaGetLastError = self._get_last_error

    def cudaHostRegister(self, address, nbytes, flags):
        self.register_calls += 1
        self.last_error = CUDA_ERROR_MEMORY_ALLOCATION
        return CUDA_ERROR_MEMORY_ALLOCATION

    def _get_last_error(self):
        error, self.last_error = self.last_error, 0
        return error


class CountingCudart(FakeCudart):
    def __init__(self) -> None:
        super().__init__()
        self.register_calls = 0

    def cudaHostRegister(self, address, nbytes, flags):
        self.register_calls += 1
        return super().cudaHostRegister(address, nbytes, flags)


@pytest.fixture
def kernel_launches(monkeypatch, fake_cuda):  # noqa: F811 - the imported fixture
    """``torch.zeros`` as a kernel launch on the fake GPU: like PyTorch's launch check, it raises (and resets)
    the thread's last CUDA error."""
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        error = getattr(fake_cuda.cudart, "last_error", 0)
        if error:
            fake_cuda.cudart.last_error = 0
            raise RuntimeError(f"CUDA error: out of memory (cudaError {error})")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    real_empty = torch.empty
    fake_cuda.pinned_requests = 0

    def empty(*args, pin_memory=False, **kwargs):  # the fake's pinned allocator: plain memory, counted
        fake_cuda.pinned_requests += bool(pin_memory)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return zeros


@pytest.mark.parametrize("expose_get_last_error", [True, False], ids=["cudaGetLastError", "bindings-without-it"])
def test_a_failed_register_leaves_no_error_and_falls_back_once(fake_cuda, kernel_launches, caplog,  # noqa: F811
                                                               expose_get_last_error):
    fake_cuda.cudart = FailingCudart(expose_get_last_error)
    device = fake_cuda.make(host_memory_budget_bytes=MiB)
    with caplog.at_level(logging.WARNING, logger="chameleon_dist"):
        source = torch.arange(1000, dtype=torch.float32)
        host = device.wait(device.copy_to_host(source.untyped_storage()))
        second = device.host_pool.acquire(7000)
    assert fake_cuda.cudart.last_error == 0  # cleared at once, not left for the next kernel
    kernel_launches(4, device="cpu")  # the next op runs
    assert torch.equal(host.view(torch.float32), source)  # the swap went through pageable memory
    assert fake_cuda.cudart.register_calls == 1  # never tried again
    assert device.host_allocator.fallback_buffers == 2 and second.numel() == 7000
    assert fake_cuda.pinned_requests == 0  # pageable memory, not PyTorch's pinned allocator (powers of two)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cudaHostRegister" in warnings[0] and "host_memory_budget" in warnings[0]
    assert device.host_pool.reserve_arena(MiB) == 0  # no arena either: pinning is off


def test_after_the_arena_is_reserved_the_save_path_page_locks_nothing(fake_cuda):  # noqa: F811
    fake_cuda.cudart = CountingCudart()
    device = fake_cuda.make(host_memory_budget_bytes=4 * MiB)
    pool = device.host_pool
    assert pool.reserve_arena(16 * MiB) == 4 * MiB  # bounded by the host budget
    assert fake_cuda.cudart.register_calls == 1
    (address, region_bytes), = fake_cuda.cudart.registered.items()
    for step, numel in enumerate((1000, 3333, 250_000, 77, 100_000, 3333)):  # the sizes change every save
        tensor = torch.full((numel,), float(step))
        host = device.wait(device.copy_to_host(tensor.untyped_storage()))
        assert address <= host.data_ptr() and host.data_ptr() + host.numel() <= address + region_bytes
        assert torch.equal(host.view(torch.float32), tensor)
        device.release_host(host)
    assert fake_cuda.cudart.register_calls == 1  # no page-locking in the save path
    assert pool.reserve_arena(MiB) == 0 and fake_cuda.cudart.register_calls == 1  # once


def test_the_first_warmup_reserves_the_arena_from_what_it_swapped(fake_cuda, monkeypatch):  # noqa: F811
    fake_cuda.cudart = CountingCudart()
    device = fake_cuda.make(host_memory_budget_bytes=64 * MiB, capacity_bytes=2**30)
    monkeypatch.setattr(device.backend, "is_device_tensor", lambda tensor: tensor.device.type == "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.zeros(1, dtype=torch.uint8),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None, raising=False)
    chameleon = Chameleon({"min_swap_bytes": 4096, "profiler": {"warmup_iterations": 2}}, device=device)
    model = chameleon.attach(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))))
    locks, swapped = [], []
    for batch in (64, 64, 96, 40):  # the batch size changes after the arena exists
        # (gradients set to None, as zero_grad does: gradients carried into an iteration are copied for a
        # possible retry when backward first adds to them, in backward, which this test does not count)
        model.zero_grad(set_to_none=True)
        chameleon.run_iteration(lambda batch=batch: model(torch.randn(batch, 256)).relu().sum().backward())
        locks.append(fake_cuda.cudart.register_calls)
        swapped.append(chameleon.last_report.swap_out_bytes)
    assert locks[1:] == [locks[0]] * 3, locks  # after the first iteration: no page-lock at all
    # the most bytes the first WarmUp held on the host at once (one micro-batch: all it swapped)
    assert swapped[0] > 0 and device.host_pool.arena.capacity_bytes == device.host_pool.peak_in_use_aligned_bytes
    assert device.host_pool.arena.capacity_bytes >= swapped[0]


def test_arena_buffers_go_back_and_merge():
    import mmap

    from chameleon_dist.device.host_arena import ALIGNMENT_BYTES, HostArena

    arena = HostArena(mmap.mmap(-1, 8 * ALIGNMENT_BYTES), 8 * ALIGNMENT_BYTES)
    first, second = arena.take(ALIGNMENT_BYTES + 1), arena.take(3 * ALIGNMENT_BYTES)
    assert first.numel() == ALIGNMENT_BYTES + 1 and arena.free_bytes == 3 * ALIGNMENT_BYTES
    assert arena.take(4 * ALIGNMENT_BYTES) is None  # no free range holds it
    del first, second
    gc.collect()
    assert arena.free_bytes == 8 * ALIGNMENT_BYTES
    assert arena.take(8 * ALIGNMENT_BYTES).numel() == 8 * ALIGNMENT_BYTES  # merged into one range again


def test_the_arenas_unlent_bytes_count_against_the_budget():
    import mmap

    from chameleon_dist.device.host_arena import HostArena

    class ArenaAllocator:
        def __call__(self, nbytes):
            return torch.empty(nbytes, dtype=torch.uint8)

        def reserve_arena(self, nbytes):
            return HostArena(mmap.mmap(-1, nbytes), nbytes)

    pool = HostBufferPool(4096, ArenaAllocator())
    assert pool.reserve_arena(3072) == 3072 and pool.reserved_bytes == 3072
    inside = pool.acquire(2048)
    assert inside is not None and pool.reserved_bytes == 3072  # from the arena: nothing more held
    assert pool.acquire(2048) is None  # the arena has 1024 left; 3072 + 2048 apart would pass 4096
    held = [pool.acquire(1024)]
    assert pool.refusals == 1 and held[0] is not None and pool.reserved_bytes == 3072
    pool.release(inside)
    del inside
    held.append(pool.acquire(1536))  # the idle 2048 gives its range back: no buffer apart
    assert held[1] is not None and pool.reserved_bytes == 3072 and pool.arena.free_bytes == 512
