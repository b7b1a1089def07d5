"""Pinned regions are unregistered while they are still mapped, then closed (issue 37 item 8), on the fake CUDA
runtime of ``test_cuda_device``: the fake's ``cudaHostUnregister`` records whether the region it is given is
still mapped; a failed unregister leaves no CUDA error behind for the next kernel."""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch

from tests.test_cuda_device import FakeCudart, fake_cuda  # noqa: F401 - the fixture
from tests.test_cuda_pinning import kernel_launches  # noqa: F401 - the fixture

MiB = 2**20
CUDA_ERROR_INVALID_VALUE = 1


class MappingCudart(FakeCudart):
    """Records, at each ``cudaHostUnregister``, whether the region at that address is still mapped and open.
    With ``fail_unregister`` it fails and leaves the error as the thread's last error, as the runtime does."""

    def __init__(self, fail_unregister: bool = False, expose_get_last_error: bool = True) -> None:
        super().__init__()
        self.regions: dict[int, weakref.ref] = {}  # address -> the mapping made there
        self.events: list[tuple[int, bool]] = []  # (address, mapped and open at unregister)
        self.fail_unregister = fail_unregister
        self.last_error = 0
        if expose_get_last_error:
            self.cudaGetLastError = self._get_last_error

    def cudaHostUnregister(self, address):
        region = self.regions[address]()
        self.events.append((address, region is not None and not region.closed))
        if self.fail_unregister:
            self.last_error = CUDA_ERROR_INVALID_VALUE
            return CUDA_ERROR_INVALID_VALUE
        return super().cudaHostUnregister(address)

    def _get_last_error(self):
        error, self.last_error = self.last_error, 0
        return error


@pytest.fixture
def mappings(monkeypatch, fake_cuda):  # noqa: F811
    """Every ``mmap.mmap`` made from now on is known to the fake runtime by its address."""
    real_mmap = mmap.mmap
    fake_cuda.cudart = MappingCudart()

    def make(*args, **kwargs):
        region = real_mmap(*args, **kwargs)
        probe = torch.frombuffer(region, dtype=torch.uint8, count=1)
        fake_cuda.cudart.regions[probe.data_ptr()] = weakref.ref(region)
        del probe
        return region

    monkeypatch.setattr(mmap, "mmap", make)
    return fake_cuda


def _closed_or_gone(cudart, address):
    region = cudart.regions[address]()
    return region is None or region.closed


def test_a_buffers_region_is_unregistered_while_mapped_then_closed(mappings):
    device = mappings.make(host_memory_budget_bytes=4 * MiB)
    buffer = device.host_allocator(100_000)
    (address, _nbytes), = mappings.cudart.registered.items()
    buffer.fill_(3)
    del buffer
    gc.collect()
    assert mappings.cudart.events == [(address, True)]  # unregistered before the mapping went
    assert _closed_or_gone(mappings.cudart, address)


def test_the_arenas_region_is_unregistered_while_mapped_after_its_last_buffer(mappings):
    device = mappings.make(host_memory_budget_bytes=4 * MiB)
    pool = device.host_pool
    assert pool.reserve_arena(MiB) == MiB
    (address, _nbytes), = mappings.cudart.registered.items()
    buffers = [pool.acquire(1000), pool.acquire(5000)]
    pool.arena = None  # the pool lets go of the arena; its buffers still hold the region
    gc.collect()
    assert mappings.cudart.events == []
    del buffers
    gc.collect()
    assert mappings.cudart.events == [(address, True)]
    assert _closed_or_gone(mappings.cudart, address)


@pytest.mark.parametrize("expose_get_last_error", [True, False], ids=["cudaGetLastError", "bindings-without-it"])
def test_a_failed_unregister_leaves_no_error_for_the_next_kernel(mappings, kernel_launches,  # noqa: F811
                                                                 expose_get_last_error):
    mappings.cudart = cudart = MappingCudart(fail_unregister=True, expose_get_last_error=expose_get_last_error)
    real_regions = cudart.regions
    device = mappings.make(host_memory_budget_bytes=4 * MiB)
    buffer = device.host_allocator(100_000)
    assert real_regions  # (the fixture's factory saw the new runtime)
    del buffer
    gc.collect()
    assert len(cudart.events) == 1 and cudart.events[0][1]
    assert cudart.last_error == 0  # read back at once
    kernel_launches(4, device="cpu")  # the next op runs
