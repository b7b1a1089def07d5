"""``device/cuda_memory.py``: the CUDA capacity (free + reserved - a measured reserve, in allocated bytes),
its enforcement, and peaks read as a difference. CPU tests run against a fake ``torch.cuda`` allocator
whose figures each test sets; ``gpu`` tests need a real CUDA device and are skipped without."""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch

from chameleon_dist.config import ChameleonConfig, ConfigError
from chameleon_dist.config.checks import device_conflicts
from chameleon_dist.device.cuda import CudaDevice
from chameleon_dist.device.cuda_memory import (
    COMPARED_AGAINST,
    FRAGMENTATION_FRACTION,
    OUTSIDE_ALLOCATOR_FRACTION,
    PeakReader,
    enforce_capacity,
    usable_capacity_bytes,
)
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.factory import make_device

GiB = 2**30
MiB = 2**20


class FakeAllocator:
    """The caching allocator's statistics for one fake GPU: allocations grow ``reserved`` when the cache
    has no room, frees keep it cached; maxima move only up, except at ``reset_peak_memory_stats`` (a spy)."""

    def __init__(self, total_bytes: int, free_bytes: int, reserved_bytes: int = 0, allocated_bytes: int = 0):
        self.total_bytes = total_bytes
        self.free_bytes = free_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.max_allocated_bytes = allocated_bytes
        self.max_reserved_bytes = reserved_bytes
        self.resets = 0
        self.fraction = 1.0
        self.fractions_set: list[tuple[float, int]] = []

    def allocate(self, nbytes: int) -> None:
        self.allocated_bytes += nbytes
        if self.allocated_bytes > self.reserved_bytes:
            grown = self.allocated_bytes - self.reserved_bytes
            self.reserved_bytes += grown
            self.free_bytes -= grown
        self.max_allocated_bytes = max(self.max_allocated_bytes, self.allocated_bytes)
        self.max_reserved_bytes = max(self.max_reserved_bytes, self.reserved_bytes)

    def free(self, nbytes: int) -> None:
        self.allocated_bytes -= nbytes  # the block stays cached: reserved does not drop

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.max_allocated_bytes = self.allocated_bytes
        self.max_reserved_bytes = self.reserved_bytes

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:  # what torch checks
            raise ValueError(f"Invalid fraction value: {fraction!r}")
        self.fraction = fraction
        self.fractions_set.append((fraction, device))

    def install(self, monkeypatch) -> None:
        patches = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "get_device_properties": lambda index: types.SimpleNamespace(name="GPU", total_memory=self.total_bytes),
            "Stream": lambda device=None: types.SimpleNamespace(device=device),
            "mem_get_info": lambda device=None: (self.free_bytes, self.total_bytes),
            "memory_allocated": lambda device=None: self.allocated_bytes,
            "max_memory_allocated": lambda device=None: self.max_allocated_bytes,
            "memory_reserved": lambda device=None: self.reserved_bytes,
            "max_memory_reserved": lambda device=None: self.max_reserved_bytes,
            "memory_stats_as_nested_dict": lambda device=None: {
                "allocated_bytes": {"all": {"current": self.allocated_bytes, "peak": self.max_allocated_bytes}},
                "reserved_bytes": {"all": {"current": self.reserved_bytes, "peak": self.max_reserved_bytes}},
            },
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "get_per_process_memory_fraction": lambda device=None: self.fraction,
            "set_per_process_memory_fraction": self.set_per_process_memory_fraction,
        }
        for name, value in patches.items():
            monkeypatch.setattr(torch.cuda, name, value)


@pytest.fixture
def gpu80(monkeypatch):
    """An 80 GiB GPU: 60 GiB free, 10 GiB reserved by this process, 9 GiB of it allocated (10 GiB others)."""
    fake = FakeAllocator(80 * GiB, 60 * GiB, reserved_bytes=10 * GiB, allocated_bytes=9 * GiB)
    fake.install(monkeypatch)
    return fake


# ---- capacity ---------------------------------------------------------------------------------
def test_capacity_is_free_plus_reserved_less_the_measured_reserve(gpu80):
    reading = usable_capacity_bytes(0)
    fragmentation = math.ceil(0.05 * 70 * GiB)  # 5% of free + reserved beats the 1 GiB gap measured now
    outside = math.ceil(0.03 * 60 * GiB)  # 3% of free memory: NCCL communicators, lazily loaded kernels
    assert (reading.fragmentation_reserve_bytes, reading.outside_allocator_reserve_bytes) == (fragmentation, outside)
    assert reading.pool_bytes == 70 * GiB
    assert reading.capacity_bytes == reading.usable_bytes == 70 * GiB - fragmentation - outside
    assert reading.capacity_bytes < 0.9 * 80 * GiB  # not a share of total memory: others hold 10 GiB
    assert (FRAGMENTATION_FRACTION, OUTSIDE_ALLOCATOR_FRACTION) == (0.05, 0.03)
    text = reading.describe()
    assert "usable" in text and "60.00 GiB free" in text and "10.00 GiB reserved" in text
    assert f"compared against {COMPARED_AGAINST}" in text and COMPARED_AGAINST == "memory_allocated"


def test_a_wide_reserved_gap_measured_at_start_is_all_reserved(monkeypatch):
    FakeAllocator(80 * GiB, 50 * GiB, reserved_bytes=20 * GiB, allocated_bytes=10 * GiB).install(monkeypatch)
    reading = usable_capacity_bytes(0)
    assert reading.fragmentation_reserve_bytes == 10 * GiB  # the cached-but-unallocated 10 GiB, > 5% of 70
    assert reading.capacity_bytes == 70 * GiB - 10 * GiB - math.ceil(0.03 * 50 * GiB)


def test_the_capacity_follows_free_memory_at_start(monkeypatch):
    fake = FakeAllocator(80 * GiB, 80 * GiB)
    fake.install(monkeypatch)
    alone = usable_capacity_bytes(0).capacity_bytes
    fake.free_bytes = 40 * GiB  # another process took half the GPU
    shared = usable_capacity_bytes(0).capacity_bytes
    assert alone == 80 * GiB - math.ceil(0.05 * 80 * GiB) - math.ceil(0.03 * 80 * GiB)
    assert shared == 40 * GiB - math.ceil(0.05 * 40 * GiB) - math.ceil(0.03 * 40 * GiB)


def test_a_given_reserve_replaces_the_measured_one(gpu80):
    reading = usable_capacity_bytes(0, reserve_bytes=GiB)
    assert reading.reserve_bytes == GiB and reading.capacity_bytes == 69 * GiB
    assert "given reserve" in reading.describe()
    with pytest.raises(ValueError, match="reserve"):
        usable_capacity_bytes(0, reserve_bytes=-1)


def test_a_configured_capacity_above_usable_is_kept_with_a_warning(gpu80, caplog):
    with caplog.at_level(logging.WARNING, logger="chameleon_dist.device.cuda_memory"):
        reading = usable_capacity_bytes(0, configured_capacity_bytes=75 * GiB)
    assert reading.capacity_bytes == 75 * GiB and reading.above_usable
    assert reading.usable_bytes < 75 * GiB
    [record] = caplog.records
    assert "device.capacity" in record.getMessage() and "above" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chameleon_dist.device.cuda_memory"):
        below = usable_capacity_bytes(0, configured_capacity_bytes=20 * GiB)
    assert below.capacity_bytes == 20 * GiB and not below.above_usable and caplog.records == []


def test_a_full_gpu_without_a_configured_capacity_names_the_setting(monkeypatch):
    FakeAllocator(80 * GiB, 0).install(monkeypatch)
    with pytest.raises(RuntimeError, match="device.capacity"):
        usable_capacity_bytes(0)
    assert usable_capacity_bytes(0, configured_capacity_bytes=GiB).capacity_bytes == GiB  # the user decided
    with pytest.raises(ValueError, match="device.capacity"):
        usable_capacity_bytes(0, configured_capacity_bytes=-1)


def test_cuda_device_plans_against_the_usable_capacity_and_a_given_one_wins(gpu80, caplog):
    device = CudaDevice()
    assert device.capacity_bytes == usable_capacity_bytes(0).capacity_bytes
    assert device.capacity_reading.free_bytes == 60 * GiB
    with caplog.at_level(logging.WARNING, logger="chameleon_dist.device.cuda_memory"):
        assert CudaDevice(capacity_bytes=79 * GiB).capacity_bytes == 79 * GiB
    assert any("device.capacity" in r.getMessage() for r in caplog.records)
    assert device.live_bytes() == 9 * GiB  # memory_allocated, the number the budget compares against
    gpu80.free(GiB)
    assert device.live_bytes() == 8 * GiB  # a freed block stays reserved; live bytes drop all the same


# ---- enforcement ------------------------------------------------------------------------------
def test_enforcement_sets_the_capacity_as_a_fraction_of_total(gpu80):
    previous = enforce_capacity(0, 60 * GiB)
    assert previous == 1.0 and gpu80.fractions_set == [(0.75, 0)]
    assert enforce_capacity(0, 20 * GiB) == 0.75  # returns what it replaced
    with pytest.raises(ValueError, match=r"device\.capacity.*device\.enforce_capacity: false"):
        enforce_capacity(0, 81 * GiB)
    assert len(gpu80.fractions_set) == 2


def test_cuda_device_enforces_only_when_asked(gpu80):
    device = CudaDevice()
    assert gpu80.fractions_set == [] and device.capacity_enforced is False
    device = CudaDevice(enforce_capacity=True)
    assert device.capacity_enforced is True
    assert gpu80.fractions_set == [(device.capacity_bytes / (80 * GiB), 0)]
    CudaDevice(capacity_bytes=40 * GiB, enforce_capacity=True)
    assert gpu80.fractions_set[-1] == (0.5, 0)


def test_the_setting_reaches_the_cuda_device_and_is_accepted_but_moot_on_the_emulated_one(gpu80):
    config = ChameleonConfig(device={"kind": "cuda", "enforce_capacity": True})
    device = make_device(config)
    assert isinstance(device, CudaDevice) and device.capacity_enforced
    assert gpu80.fractions_set == [(device.capacity_bytes / (80 * GiB), 0)]
    emulated = make_device(ChameleonConfig(device={"kind": "emulated", "capacity": "1GB", "enforce_capacity": True}))
    assert isinstance(emulated, EmulatedDevice) and len(gpu80.fractions_set) == 1
    assert ChameleonConfig().device.enforce_capacity is False
    with pytest.raises(ConfigError, match="device.enforce_capacity"):
        ChameleonConfig(device={"enforce_capacity": "yes"})


def test_a_passed_device_must_agree_with_the_configured_enforcement(gpu80):
    settings = ChameleonConfig(device={"enforce_capacity": True}).device
    [problem] = device_conflicts(settings, CudaDevice())
    assert problem.startswith("device.enforce_capacity:") and "not enforced" in problem
    assert device_conflicts(settings, CudaDevice(enforce_capacity=True)) == []
    assert device_conflicts(ChameleonConfig().device, CudaDevice(enforce_capacity=True)) == []  # not set


# ---- peaks ------------------------------------------------------------------------------------
def _iteration(fake: FakeAllocator, device: CudaDevice, sizes: list[int]) -> int:
    """One iteration: allocate ``sizes`` one after another (sampling live bytes after each), free them all."""
    device.reset_peak()
    for nbytes in sizes:
        fake.allocate(nbytes)
        device.live_bytes()
    for nbytes in sizes:
        fake.free(nbytes)
    return device.peak_bytes()


def test_peak_stats_are_never_reset_and_stay_the_processes_own(gpu80):
    device = CudaDevice()
    all_time_peak = 0
    for iteration in range(50):
        sizes = [(iteration % 7 + 1) * GiB, (iteration % 3) * GiB]
        _iteration(gpu80, device, sizes)
        all_time_peak = max(all_time_peak, 9 * GiB + sum(sizes))
    assert gpu80.resets == 0
    assert torch.cuda.max_memory_allocated(0) == all_time_peak  # what Megatron's memory report reads


def test_a_new_high_is_this_iterations_exact_peak(gpu80):
    device = CudaDevice()
    assert _iteration(gpu80, device, [5 * GiB]) == 14 * GiB  # the process's maximum was 9 GiB
    reader = PeakReader(0)
    gpu80.allocate(6 * GiB)
    gpu80.free(6 * GiB)
    reading = reader.read()
    assert reading.exact and reading.peak_bytes == 15 * GiB == reading.upper_bound_bytes  # no sample needed
    assert reading.peak_reserved_bytes == 15 * GiB and reading.reserved_exact


def test_below_an_earlier_peak_the_peak_is_the_highest_sample_a_lower_bound(gpu80):
    device = CudaDevice()
    _iteration(gpu80, device, [8 * GiB])  # the process peaks at 17 GiB
    assert _iteration(gpu80, device, [2 * GiB, GiB]) == 12 * GiB  # sampled after each allocation
    reading = device.backend._peak.read()
    assert not reading.exact and reading.upper_bound_bytes == 17 * GiB and not reading.reset_seen
    reader = PeakReader(0)  # nothing sampled: only the values at begin and now
    gpu80.allocate(3 * GiB)
    gpu80.free(3 * GiB)
    assert reader.peak_bytes() == 9 * GiB
    reader.begin()
    gpu80.allocate(3 * GiB)
    reader.note(gpu80.allocated_bytes)  # the dispatch layer's sample after an op
    gpu80.free(3 * GiB)
    assert reader.peak_bytes() == 12 * GiB


def test_a_reset_by_someone_else_mid_iteration_gives_the_peak_since_as_a_lower_bound(gpu80):
    reader = PeakReader(0)
    gpu80.allocate(20 * GiB)
    gpu80.free(20 * GiB)  # the process peaks at 29 GiB
    reader.begin()
    gpu80.allocate(4 * GiB)
    gpu80.reset_peak_memory_stats()  # e.g. DeepSpeed's see_memory_usage
    gpu80.allocate(2 * GiB)
    gpu80.free(6 * GiB)
    reading = reader.read()
    assert reading.reset_seen and not reading.exact
    assert reading.peak_bytes == 15 * GiB and reading.upper_bound_bytes is None


def test_a_swap_in_is_a_peak_sample(gpu80, monkeypatch):
    device = CudaDevice()
    device.backend.torch_device = torch.device("cpu")
    _iteration(gpu80, device, [8 * GiB])  # the process peaks at 17 GiB
    device.reset_peak()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        gpu80.allocate(2 * GiB)  # the swap-in's block, as the allocator would count it
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    device._allocate_device_bytes(16)
    monkeypatch.setattr(torch, "empty", real_empty)
    gpu80.free(2 * GiB)
    assert device.peak_bytes() == 11 * GiB


# ---- GPU --------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_gpu_an_allocation_over_the_enforced_capacity_raises():
    index = torch.cuda.current_device()
    torch.cuda.empty_cache()
    capacity_bytes = torch.cuda.memory_reserved(index) + 512 * MiB
    previous = enforce_capacity(index, capacity_bytes)
    try:
        fits = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # under the capacity: allowed
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
        del fits
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, index)
        torch.cuda.empty_cache()
    torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")  # allowed again once restored


@pytest.mark.gpu
@gpu
def test_gpu_capacity_and_peaks_on_the_real_device():
    index = torch.cuda.current_device()
    reading = usable_capacity_bytes(index)
    free_bytes, total_bytes = torch.cuda.mem_get_info(index)
    assert reading.total_bytes == total_bytes and 0 < reading.capacity_bytes < reading.pool_bytes <= total_bytes
    assert abs(reading.free_bytes - free_bytes) <= 64 * MiB
    earlier = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del earlier  # the process's peak is now at least 256 MiB above the current value
    reader = PeakReader(index)
    small = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    reader.sample()
    del small
    reading = reader.read()
    assert not reading.exact and reading.peak_bytes >= 64 * MiB
    reader.begin()
    big = torch.empty(int(torch.cuda.max_memory_allocated(index)) + 64 * MiB, dtype=torch.uint8, device="cuda")
    expected = torch.cuda.memory_allocated(index)
    del big
    reading = reader.read()
    assert reading.exact and reading.peak_bytes == expected
