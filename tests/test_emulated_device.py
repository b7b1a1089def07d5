"""The emulated device (``StreamDevice`` over the simulated backend): copies on the device clock, copy
handles, stall accounting, releases, presets, host buffer pool."""

import gc
import math
import time

import pytest
import torch

from chameleon_dist.device import Device, EmulatedDevice, HostBufferPool, PRESETS
from chameleon_dist.device.base import byte_view


def _device_storage(device: EmulatedDevice, numel: int) -> torch.Tensor:
    with device.active():
        return torch.arange(numel, dtype=torch.float32)


def test_satisfies_the_device_protocol():
    assert isinstance(EmulatedDevice(capacity_bytes=1000), Device)


FIGURES = dict(peak_flop_per_s=1e12, memory_bytes_per_s=1e11, launch_latency_s=1e-6, host_op_s=1e-6)


def test_link_rates_are_the_links_and_infinite_when_instant():
    device = EmulatedDevice(capacity_bytes=1000, h2d_bytes_per_s=2e9, **FIGURES)
    assert device.h2d_bytes_per_s == 2e9 and device.h2d_bytes_per_s == device.h2d.bytes_per_s
    assert device.d2h_bytes_per_s == math.inf and device.d2h.bytes_per_s == math.inf  # an instant link
    preset = EmulatedDevice(capacity_bytes=1000, preset="h100-pcie", host_op_s=1e-6)
    h100 = next(p for p in PRESETS if p.name == "h100-pcie")
    assert preset.d2h_bytes_per_s == h100.d2h_bytes_per_s and preset.h2d_bytes_per_s == h100.h2d_bytes_per_s


def test_copies_on_one_link_are_serial_on_the_device_clock_and_waiting_is_stall():
    bandwidth_bytes_per_s = 50e6
    device = EmulatedDevice(capacity_bytes=10**9, d2h_bytes_per_s=bandwidth_bytes_per_s, duplex_factor=1.0, **FIGURES)
    tensors = [_device_storage(device, 1_250_000) for _ in range(2)]  # 5 MB each -> 0.1 s each
    wall_start_s = time.perf_counter()
    handles = [device.copy_to_host(t.untyped_storage()) for t in tensors]
    assert not handles[0].done(), "a copy issued now has not run on the device yet"
    device.wait(handles[-1])
    assert time.perf_counter() - wall_start_s < 0.1, "the simulated device never sleeps"
    device.synchronize()
    assert handles[0].done() and handles[1].done()
    copy_s = 5e6 / bandwidth_bytes_per_s
    assert device.d2h.busy_s == pytest.approx(2 * copy_s)  # back to back, not side by side
    assert device.stall_s() == pytest.approx(2 * copy_s, rel=0.01)  # the compute stream waited for both


def test_a_source_is_let_go_once_its_copy_completed():
    device = EmulatedDevice(capacity_bytes=10**9, **FIGURES)
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    del tensor
    gc.collect()
    assert device.live_bytes() == 4096, "the device holds the source until a release (4000 bytes in a 4096 block)"
    device.synchronize()
    assert device.live_bytes() == 0, "the device block goes once its copy has completed"
    back = device.copy_to_device(handle.result)
    assert device.live_bytes() == 4096, "the swap-in destination is device memory"
    assert torch.equal(device.wait(back).view(torch.float32), torch.arange(1000, dtype=torch.float32))


def test_a_planned_release_orders_the_owning_stream_and_never_blocks_the_host():
    device = EmulatedDevice(capacity_bytes=10**9, d2h_bytes_per_s=1e6, **FIGURES)  # 4 KB: 4 ms
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    del tensor
    host_s = device.clock.host_s
    assert device.release_source(handle) == 4000 and device.release_source(handle) == 0
    gc.collect()
    assert device.live_bytes() == 0, "let go at once: the compute stream waits for the copy instead"
    assert device.clock.host_s == host_s, "the host did not block"
    assert device.backend.compute_stream.ready_s >= device.d2h.ready_s


def test_a_restored_buffer_is_freed_when_its_user_drops_it():
    device = EmulatedDevice(capacity_bytes=10**9, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, **FIGURES)
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    del tensor
    host = device.wait(handle)
    device.release_all_sources()
    back = device.copy_to_device(host)
    restored = device.wait(back)
    assert device.live_bytes() == 4096
    del back, restored
    gc.collect()
    assert device.live_bytes() == 0
    device.synchronize()


def test_swap_in_beyond_capacity_raises_out_of_memory():
    device = EmulatedDevice(capacity_bytes=6000, **FIGURES)
    tensor = _device_storage(device, 1000)
    handle = device.copy_to_host(tensor.untyped_storage())
    device.wait(handle)
    with device.active():
        with pytest.raises(torch.OutOfMemoryError):
            device.copy_to_device(handle.result)


def test_presets_give_real_figures_and_explicit_settings_override_them():
    device = EmulatedDevice(capacity_bytes=10**6, preset="h100-pcie")
    h100 = next(p for p in PRESETS if p.name == "h100-pcie")
    assert device.model.peak_for(torch.bfloat16) == h100.dtype_peaks()["bfloat16"]
    assert {p.name for p in PRESETS} >= {"ascend-910b", "h100-pcie"}
    with pytest.raises(ValueError, match="device.preset"):
        EmulatedDevice(capacity_bytes=10**6, preset="tpu-v9")
    faster = EmulatedDevice(capacity_bytes=10**6, preset="h100-pcie", h2d_bytes_per_s=1e9)
    assert faster.h2d_bytes_per_s == 1e9 and faster.d2h_bytes_per_s == h100.d2h_bytes_per_s


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


def test_the_per_op_observer_hears_each_ops_kernel_seconds_when_on():
    """``SimulatedBackend.op_times_s``: off (None) by default; a list hears every op in order, with the
    kernel's device seconds (0.0 for ops without a kernel and for host-side work); they add up to the
    compute stream's busy time."""
    device = EmulatedDevice(capacity_bytes=10**9, **FIGURES)
    backend = device.backend
    assert backend.op_times_s is None
    with device.active():
        a = torch.ones(64, 64)
    backend.op_times_s = times = []
    busy_s = backend.kernel_busy_s
    with device.active():
        b = a @ a  # a kernel
        c = b.view(-1)  # no kernel (a view)
        d = torch.empty(8)  # no kernel (an allocation)
        with backend.host_side():
            c.sum()  # host-side work
    assert len(times) == 4, times
    assert times[0] > 0 and times[1:] == [0.0, 0.0, 0.0]
    assert sum(times) == pytest.approx(backend.kernel_busy_s - busy_s)
    backend.op_times_s = None
    with device.active():
        a + a
    assert len(times) == 4, "off again: nothing appended"
    del b, c, d


def test_a_spans_compute_time_leaves_out_its_waits_on_copies_but_not_the_hosts_own_time():
    """``EventTimer.compute_s`` (what layer times are made of): a wait on a slow copy inside a span is not the
    span's cost, and a host-bound span costs at least the host's time over it."""
    device = EmulatedDevice(2**30, preset="h100-pcie", host_op_s=1e-3, d2h_bytes_per_s=1e6)
    timer = device.timer(keep_waits=True)
    x = device.track(torch.ones(1024, 256))
    with device.active():
        start = timer.mark()
        for _ in range(5):
            x = x + 1  # 5 tiny kernels after 1 ms of host work each
        handle = device.copy_to_host(x.untyped_storage())  # 1 MiB at 1 MB/s: about a second on the link
        device.wait(handle)  # the compute stream waits for it
        y = x * 2
        end = timer.mark()
    timer.resolve()
    elapsed_s = timer.elapsed_s(start, end)
    assert elapsed_s > 1.0 and timer.waits_s(start, end) > 1.0  # the wait is in the span's device time
    assert timer.compute_s(start, end) < 0.05  # ... and not in its compute time
    assert timer.compute_s(start, end) >= 0.006  # at least the host's 6 ops (and the copy's host work) at 1 ms
    del y, handle
