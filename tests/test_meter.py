"""Exact metering of the emulated device: hand-computed byte counts for every kind of allocation."""

import gc

import pytest
import torch

from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.meter import EmulatedOutOfMemoryError, StorageMeter
from chameleon_dist.device.simulated.memory import block_bytes

F32 = 4


def test_allocation_view_inplace_and_free_are_counted_exactly():
    meter = StorageMeter(capacity_bytes=10**6)
    with meter:
        a = torch.empty(100)
        assert meter.live_bytes == 100 * F32
        view = a[10:20].view(2, 5).t()
        assert meter.live_bytes == 100 * F32, "views share their storage and cost nothing"
        a.add_(1.0)
        a[0:5].mul_(2.0)
        assert meter.live_bytes == 100 * F32, "in-place ops allocate nothing"
        b = a * 2
        assert meter.live_bytes == 200 * F32
        del a
        assert meter.live_bytes == 200 * F32, "a view keeps the storage alive"
        del view
        gc.collect()
        assert meter.live_bytes == 100 * F32, "bytes return when the last view dies"
        c = torch.empty(0, dtype=torch.float64)
        torch.add(b.double(), 1.0, out=c)  # resizes c's storage from 0 to 800 bytes
        assert meter.live_bytes == 100 * F32 + 100 * 8
        del b, c
    assert meter.live_bytes == 0
    assert meter.peak_bytes == 100 * F32 + 100 * 8 + 100 * 8  # b, the double temporary, and c at once


def test_parameters_gradients_and_optimizer_state():
    """Every buffer counts as the caching allocator counts it: one block per storage, rounded to 512 bytes."""
    model = torch.nn.Linear(32, 16)  # made outside the meter: counted only once tracked
    params_bytes = block_bytes(32 * 16 * F32) + block_bytes(16 * F32)
    device = EmulatedDevice(capacity_bytes=10**7)
    device.track_module(model)
    assert device.live_bytes() == params_bytes
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 32)
    batch_bytes = block_bytes(8 * 32 * F32)
    with device.active():
        xd = x.clone()  # the batch "moved to the device": 8*32 floats
        assert device.live_bytes() == params_bytes + batch_bytes
        model(xd).sum().backward()
        after_backward = device.live_bytes()
        # gradients: one per parameter, same sizes as the parameters
        assert after_backward == params_bytes + batch_bytes + params_bytes
        optimizer.step()
        # Adam: exp_avg and exp_avg_sq per parameter plus a one-element float32 step per parameter
        state_bytes = 2 * params_bytes + 2 * block_bytes(F32)
        assert device.live_bytes() == after_backward + state_bytes
        optimizer.zero_grad(set_to_none=True)
        assert device.live_bytes() == params_bytes + batch_bytes + state_bytes
        del xd
    assert device.live_bytes() == params_bytes + state_bytes


def test_out_of_memory_exactly_at_capacity():
    meter = StorageMeter(capacity_bytes=1000 * F32)
    with meter:
        keep = torch.empty(600)
        fits = torch.empty(400)  # exactly at capacity: allowed
        assert meter.live_bytes == meter.capacity_bytes
        del fits
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(401)
        assert isinstance(info.value, EmulatedOutOfMemoryError)
        assert info.value.op_name == "aten.empty.memory_format"
        assert info.value.requested_bytes == 401 * F32
        assert "device.capacity" in str(info.value)
        assert meter.live_bytes == 600 * F32, "the failed allocation is not counted"
        ok = torch.empty(400)
        assert meter.live_bytes == meter.capacity_bytes
    del keep, ok


def test_pressure_handler_runs_before_out_of_memory():
    meter = StorageMeter(capacity_bytes=1000 * F32)
    held = []
    calls = []

    def release(short_bytes):
        calls.append(short_bytes)
        freed = sum(t.numel() * F32 for t in held)
        held.clear()
        return freed

    meter.pressure_handler = release
    with meter:
        held.append(torch.empty(800))
        survivor = torch.empty(500)  # fits only once the handler dropped the 800
    assert calls == [300 * F32]
    assert meter.live_bytes == 500 * F32
    del survivor


def test_timeline_and_paused_region():
    meter = StorageMeter(capacity_bytes=10**6)
    with meter, meter.recording_timeline() as samples:
        a = torch.empty(10)
        with meter.paused():
            host = torch.empty(1000)  # host-side buffer: not device memory
        b = a + 1
    assert meter.live_bytes == 20 * F32
    assert samples == [0, 10 * F32, 20 * F32]
    del a, b, host


def test_tensors_made_from_python_data_are_counted():
    meter = StorageMeter(capacity_bytes=10**6)
    with meter:
        step = torch.tensor(0.0)
        table = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
        assert meter.live_bytes == F32 + 6 * 8
    del step, table


def test_out_of_memory_message_says_whether_swapping_is_on():
    """Without a pressure handler (Chameleon disabled or absent) the advice is to enable swapping; with one
    installed, swapping is on already and could not free enough, so it must not say "enable"."""
    meter = StorageMeter(capacity_bytes=100 * F32)
    with meter, pytest.raises(EmulatedOutOfMemoryError) as off:
        torch.empty(101)
    assert not off.value.swapping
    assert "swapping is off" in str(off.value) and "enabled: true" in str(off.value)

    meter.pressure_handler = lambda short_bytes: 0  # what the runtime installs when enabled
    with meter, pytest.raises(EmulatedOutOfMemoryError) as on:
        torch.empty(101)
    assert on.value.swapping
    message = str(on.value)
    assert "swapping is on" in message and "nable" not in message
    assert "min_swap_bytes" in message and "device.capacity" in message


def test_tensor_leaves_finds_what_pytree_finds_in_op_arguments_and_results():
    from torch.utils._pytree import tree_leaves

    from chameleon_dist.device.leaves import tensor_leaves

    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    structures = [
        ((a, [b, 2.0, None], {"out": c, "dim": 1}), {}),
        torch.max(torch.ones(2, 3), dim=1),  # a torch.return_types structseq
        ([a, (b, [c])], {"x": [a]}),
        (1, "s", torch.float32, None),
    ]
    for obj in structures:
        expected = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
        found = tensor_leaves(obj)
        assert len(found) == len(expected) and all(x is y for x, y in zip(found, expected)), obj
