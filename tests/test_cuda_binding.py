"""The rank's own GPU (issue 24 item 4), on the fake CUDA backend of ``test_cuda_device``: the index comes
from ``LOCAL_RANK`` before anything touches a device, and an attached model on another GPU is an error
naming both devices."""

from __future__ import annotations

import types

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.cuda import CudaDevice
from tests.test_cuda_device import FakeStream, fake_cuda  # noqa: F401 - the fixture

FOUR_GPUS = 4


class _ModelOn(torch.nn.Module):
    """A module whose parameters report a CUDA device (a CPU build cannot make CUDA tensors)."""

    def __init__(self, *indices: int) -> None:
        super().__init__()
        self._fakes = [types.SimpleNamespace(device=torch.device("cuda", index)) for index in indices]

    def parameters(self, recurse: bool = True):
        return iter(self._fakes)

    def named_parameters(self, *args, **kwargs):
        return iter((f"weight{i}", fake) for i, fake in enumerate(self._fakes))

    def buffers(self, recurse: bool = True):
        return iter(())

    def named_buffers(self, *args, **kwargs):
        return iter(())


@pytest.fixture
def four_gpus(fake_cuda, monkeypatch):  # noqa: F811 - the imported fixture
    """Four fake GPUs; every device index a CUDA call is made for is recorded in ``fake_cuda.touched``."""
    fake_cuda.touched = []

    def touch(result):
        def call(device=None, *args, **kwargs):
            fake_cuda.touched.append(torch.device("cuda", device).index if isinstance(device, int) else
                                     None if device is None else torch.device(device).index)
            return result(device) if callable(result) else result
        return call

    def no_current_device():
        raise AssertionError("torch.cuda.current_device() was asked although the rank's index was known")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: FOUR_GPUS)
    monkeypatch.setattr(torch.cuda, "current_device", no_current_device)
    monkeypatch.setattr(torch.cuda, "mem_get_info", touch((7 * 2**30, 8 * 2**30)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", touch(0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", touch(0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", touch(0))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", touch(0))

    def stream(device=None, **kwargs):
        fake_cuda.touched.append(torch.device(device).index)
        return FakeStream(device)

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    return fake_cuda


def test_local_rank_picks_the_gpu_before_any_device_is_touched(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    device = CudaDevice()
    assert device.index == 2 and device.name.startswith("cuda:2")
    assert four_gpus.touched and set(four_gpus.touched) == {2}, four_gpus.touched  # nothing on cuda:0
    assert device.backend.index_source == "LOCAL_RANK=2"


def test_an_explicit_index_wins_and_without_local_rank_it_is_the_current_device(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert CudaDevice(device_index=1).index == 1
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert CudaDevice().index == 3
    monkeypatch.setenv("LOCAL_RANK", "5")  # more ranks than visible GPUs (one GPU per process): the current one
    assert CudaDevice().index == 3


def test_a_model_on_another_gpu_is_an_error_naming_both(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    chameleon = Chameleon(device=CudaDevice(capacity_bytes=2**30))
    with pytest.raises(ValueError) as info:
        chameleon.attach(_ModelOn(0, 0))
    message = str(info.value)
    assert "cuda:0" in message and "cuda:1" in message and "LOCAL_RANK=1" in message, message
    assert "set_device" in message
    explicit = CudaDevice(device_index=1, capacity_bytes=2**30)
    with pytest.raises(ValueError, match="device_index=1"):
        explicit.track_module(_ModelOn(0))


def test_a_model_on_the_runtimes_gpu_is_counted_without_a_warning(four_gpus, monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_RANK", "1")
    device = CudaDevice(capacity_bytes=2**30)
    device.track_module(_ModelOn(1, 1))
    device.track_module(torch.nn.Linear(2, 2))  # CPU parameters: counted elsewhere, warned about, not refused
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "2 parameters/buffers of Linear are not on cuda:1 (Fake GPU) (first: weight)"]
