"""Never-swapped storages (``SwapExecutor.protect_now`` / ``protect``): protection follows the storage, not
its address, which the allocator hands to the next storage once the protected one is freed."""

from __future__ import annotations

import numpy
import torch

from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.executor import protection, swap


def test_a_freed_protected_storage_does_not_protect_the_next_one_at_its_address(monkeypatch):
    """ZeRO-3 gathers a layer's parameters (protected) and frees them after its forward; activations then get
    their addresses. Protection by address alone kept those activations on the device, where the trace had
    counted them movable: policy entries did not fire and peaks went over their predictions."""
    # The allocator reuses a freed storage's address only now and then; two storages over one numpy buffer
    # share their data address for sure, so the test keys storages by it (as the allocator would hand it on).
    monkeypatch.setattr(protection, "storage_key", lambda storage: storage.data_ptr())  # (where protection keys)
    executor = swap.SwapExecutor(EmulatedDevice(2**30), min_swap_bytes=0)
    memory = numpy.zeros(4096, dtype=numpy.float32)
    gathered = torch.from_numpy(memory)
    assert executor.protect_now(gathered) and executor.is_protected(gathered)
    assert not executor.protect_now(gathered[10:])  # a view: the same storage, protected already
    key = gathered.untyped_storage().data_ptr()
    del gathered  # the storage is freed; its address is not
    activation = torch.from_numpy(memory)  # a new storage at that address
    assert activation.untyped_storage().data_ptr() == key
    assert not executor.is_protected(activation)
    assert key not in executor.protected_keys()
    assert executor.protect_now(activation) and executor.is_protected(activation)


def test_a_live_protected_storage_stays_protected_through_any_view():
    executor = swap.SwapExecutor(EmulatedDevice(2**30), min_swap_bytes=0)
    buffer = torch.empty(64, 64)
    executor.protect_now(buffer[:8])  # protecting a temporary view protects the storage
    assert executor.is_protected(buffer) and executor.is_protected(buffer.t())
    executor.unprotect_now(buffer)
    assert not executor.is_protected(buffer)
