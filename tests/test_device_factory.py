"""make_device: the device a configuration asks for, with errors that name the setting."""

import math
import pytest

from chameleon_dist import Chameleon, ChameleonConfig, EmulatedDevice
from chameleon_dist.device import make_device
from chameleon_dist.device.factory import UNBOUNDED_CAPACITY_BYTES, accelerator_is_cuda


def test_emulated_device_from_config():
    config = ChameleonConfig(device={"kind": "emulated", "capacity": "64MiB", "h2d_bytes_per_s": "2GB"},
                             host_memory_budget="1GiB")
    device = make_device(config)
    assert isinstance(device, EmulatedDevice)
    assert device.capacity_bytes == 64 * 2**20
    assert device.h2d_bytes_per_s == 2e9 and device.d2h_bytes_per_s == math.inf  # an instant link
    assert device.host_pool.budget_bytes == 2**30


def test_the_caching_allocator_model_is_a_device_setting():
    config = ChameleonConfig(device={"kind": "emulated", "capacity": "64MiB", "caching_allocator": True,
                                     "expandable_segments": True})
    device = make_device(config)
    cache = device.backend.allocator.cache
    assert cache is not None and cache.expandable_segments
    assert make_device(ChameleonConfig(device={"kind": "emulated", "capacity": "64MiB"})).backend.allocator.cache is None
    with pytest.raises(Exception, match="device.caching_allocator: true"):
        ChameleonConfig(device={"kind": "emulated", "expandable_segments": True})
    with pytest.raises(Exception, match="caching_allocator"):
        ChameleonConfig(device={"kind": "cuda", "caching_allocator": True})


def test_auto_without_a_gpu_is_an_unbounded_emulated_device():
    if accelerator_is_cuda():
        pytest.skip("a CUDA device is present")
    chameleon = Chameleon()
    assert isinstance(chameleon.device, EmulatedDevice)
    assert chameleon.device.capacity_bytes == UNBOUNDED_CAPACITY_BYTES


def test_cuda_without_a_gpu_names_the_setting():
    if accelerator_is_cuda():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="device.kind"):
        make_device(ChameleonConfig(device={"kind": "cuda"}))


def test_memory_budget_resolves_against_capacity():
    chameleon = Chameleon({"memory_budget": 0.5, "device": {"kind": "emulated", "capacity": "100MB"}})
    assert chameleon.memory_budget_bytes == 50_000_000
