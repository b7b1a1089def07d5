"""The emulated device: copy timing, copy handles, stall accounting, presets, host buffer pool."""

import gc
import math
import time

import pytest
import torch

from chameleon_dist.device import Device, EmulatedDevice, HostBufferPool, PRESETS, calibrate
from chameleon_dist.device.base import byte_view


def _device_storage(device: EmulatedDevice, numel: int) -> torch.Tensor:
    with device.active():
        return torch.arange(numel, dtype=torch.float32)


def test_satisfies_the_device_protocol():
    assert isinstance(EmulatedDevice(capacity_bytes=1000), Device)


def test_link_rates_are_the_links_and_infinite_when_instant():
    device = EmulatedDevice(capacity_bytes=1000, h2d_bytes_per_s=2e9)
    assert device.h2d_bytes_per_s == 2e9 and device.h2d_bytes_per_s == device.h2d.bytes_per_s
    assert device.d2h_bytes_per_s == math.inf and device.d2h.bytes_per_s is None  # an instant link
    preset = EmulatedDevice(capacity_bytes=1000, preset="h100-pcie", cpu_flop_per_s=100e9)
    assert preset.d2h_bytes_per_s == preset.calibration.d2h_bytes_per_s
    assert preset.h2d_bytes_per_s == preset.calibration.h2d_bytes_per_s


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_copy_takes_nbytes_over_bandwidth_within_20_percent(direction):
    bandwidth_bytes_per_s = 40e6
    device = EmulatedDevice(capacity_bytes=10**9, h2d_bytes_per_s=bandwidth_bytes_per_s, d2h_bytes_per_s=bandwidth_bytes_per_s)
    tensor = _device_storage(device, 2_000_000)  # 8 MB -> 0.2 s at 40 MB/s
    nbytes = tensor.untyped_storage().nbytes()
    expected_s = nbytes / bandwidth_bytes_per_s
    start_s = time.perf_counter()
    handle = device.copy_to_host(tensor.untyped_storage())
    if direction == "h2d":
        host = device.wait(handle)
        start_s = time.perf_counter()
        handle = device.copy_to_device(host)
    issued_s = time.perf_counter() - start_s
    result = device.wait(handle)
    elapsed_s = time.perf_counter() - start_s
    assert issued_s < 0.1 * expected_s, "issuing a copy must not block the training thread"
    assert abs(elapsed_s - expected_s) <= 0.2 * expected_s, (elapsed_s, expected_s)
    assert torch.equal(result, byte_view(tensor.untyped_storage()))


def test_copies_on_one_link_are_serial_and_waiting_is_stall():
    bandwidth_bytes_per_s = 50e6
    device = EmulatedDevice(capacity_bytes=10**9, d2h_bytes_per_s=bandwidth_bytes_per_s)
    tensors = [_device_storage(device, 1_250_000) for _ in range(2)]  # 5 MB each -> 0.1 s each
    start_s = time.perf_counter()
    handles = [device.copy_to_host(t.untyped_storage()) for t in tensors]
    device.wait(handles[-1])
    elapsed_s = time.perf_counter() - start_s
    assert handles[0].done() and handles[1].done()
    assert 0.16 <= elapsed_s <= 0.4, elapsed_s  # two 0.1 s copies back to back, not side by side
    assert device.stall_s() == pytest.approx(elapsed_s, rel=0.2)


def test_instant_link_and_source_released_when_copy_completes():
    device = EmulatedDevice(capacity_bytes=10**9)
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    del tensor
    device.wait(handle)
    gc.collect()
    assert device.live_bytes() == 0, "the device block goes once its copy has completed"
    back = device.copy_to_device(handle.result)
    assert device.live_bytes() == 4000, "the swap-in destination is device memory"
    assert torch.equal(device.wait(back).view(torch.float32), torch.arange(1000, dtype=torch.float32))


def test_a_restored_buffer_is_freed_when_its_user_drops_it_over_a_timed_link():
    """The link must not keep the newest copy's destination (a restored device buffer) alive: it would be
    counted as device memory until the next copy, in the next iteration's peak."""
    device = EmulatedDevice(capacity_bytes=10**9, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    del tensor
    host = device.wait(handle)
    back = device.copy_to_device(host)
    restored = device.wait(back)
    assert device.live_bytes() == 4000
    del back, restored
    gc.collect()
    assert device.live_bytes() == 0
    device.synchronize()  # draining still works without the handle


def test_swap_in_beyond_capacity_raises_out_of_memory():
    device = EmulatedDevice(capacity_bytes=6000)
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    device.wait(handle)
    with device.active():
        with pytest.raises(torch.OutOfMemoryError):
            device.copy_to_device(handle.result)


def test_preset_scales_link_to_cpu_speed():
    calibration = calibrate("ascend-910b", cpu_flop_per_s=200e9)
    preset = calibration.preset
    assert calibration.h2d_bytes_per_s == pytest.approx(200e9 * preset.h2d_bytes_per_s / preset.peak_flop_per_s)
    assert 10_000 < preset.h2d_flop_per_byte < 20_000
    device = EmulatedDevice(capacity_bytes=10**6, preset="h100-pcie", cpu_flop_per_s=100e9)
    assert device.h2d.bytes_per_s == pytest.approx(100e9 / (756e12 / 55e9))
    assert {p.name for p in PRESETS} >= {"ascend-910b", "h100-pcie"}
    with pytest.raises(ValueError, match="device.preset"):
        EmulatedDevice(capacity_bytes=10**6, preset="tpu-v9")
    with pytest.raises(ValueError, match="h2d_bytes_per_s"):
        EmulatedDevice(capacity_bytes=10**6, preset="h100-pcie", h2d_bytes_per_s=1e9, cpu_flop_per_s=1e9)


def test_preset_measures_this_cpu_when_not_told(caplog):
    caplog.set_level("INFO")
    device = EmulatedDevice(capacity_bytes=10**6, preset="ascend-910b")
    assert device.calibration.cpu_flop_per_s > 1e8
    assert "calibrated to ascend-910b" in caplog.text and "emulated" in caplog.text


def test_host_pool_exact_size_reuse_and_budget():
    pool = HostBufferPool(budget_bytes=1000)
    a = pool.acquire(400)
    pool.release(a)
    again = pool.acquire(400)
    assert again is a and pool.allocations == 1, "same size is reused, no new allocation"
    b = pool.acquire(500)
    assert pool.reserved_bytes == 900
    assert pool.acquire(200) is None and pool.refusals == 1, "over budget: refused, not crashed"
    pool.release(b)  # cached 500 can be evicted to make room for a different size
    c = pool.acquire(300)
    assert c is not None and c.numel() == 300 and pool.reserved_bytes == 700
    pool.release(again)
    pool.release(c)
    assert pool.trim() == 700 and pool.reserved_bytes == 0


def test_host_budget_refusal_returns_none():
    device = EmulatedDevice(capacity_bytes=10**9, host_memory_budget_bytes=1000)
    tensor = _device_storage(device, 1000)
    assert device.copy_to_host(tensor.untyped_storage()) is None
