"""``CudaDevice``: CPU checks always run (import hygiene, the no-CUDA error, and the stream/event/pool
bookkeeping against a fake ``torch.cuda``); ``gpu`` tests need a real CUDA device and are skipped without.
"""

from __future__ import annotations

import contextlib
import gc
import math
import subprocess
import sys
import types
import weakref

import pytest
import torch

from chameleon_dist.device.base import Device
from chameleon_dist.device.cuda import CudaDevice, PinnedHostAllocator

MiB = 2**20
FAKE_FREE_BYTES = 7 * 2**30  # of the fake GPU's 8 GiB


# ---- CPU: import hygiene and the error without CUDA ------------------------------------------
def test_import_does_not_initialise_cuda():
    code = (
        "import torch, chameleon_dist.device.cuda, chameleon_dist.device\n"
        "chameleon_dist.device.CudaDevice\n"
        "assert not torch.cuda.is_initialized(), 'importing chameleon_dist.device.cuda initialised CUDA'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_without_cuda_the_error_names_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="device.kind: emulated") as info:
        CudaDevice()
    assert "device.capacity" in str(info.value)


# ---- CPU: bookkeeping against a fake torch.cuda -----------------------------------------------
class FakeStream:
    """Events recorded on a ``held`` stream stay incomplete until ``finish()`` (an in-flight copy)."""

    def __init__(self, device=None, name="copy"):
        self.name = name
        self.held = False
        self.events = []
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def wait_stream(self, other):
        pass

    def finish(self):
        self.held = False
        for event in self.events:
            event.completed = True

    synchronize = finish


class FakeEvent:
    ELAPSED_MS = 3.0

    def __init__(self, enable_timing=False, **_):
        self.enable_timing = enable_timing
        self.completed = False

    def record(self, stream):
        stream.events.append(self)
        self.completed = not stream.held

    def query(self):
        return self.completed

    def synchronize(self):
        self.completed = True

    def elapsed_time(self, end):
        return self.ELAPSED_MS


class FakeCudart:
    def __init__(self):
        self.registered = {}
        self.unregistered = []

    def cudaHostRegister(self, address, nbytes, flags):
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address):
        self.unregistered.append(address)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fake ``torch.cuda`` whose "device" memory is CPU memory and whose copies run synchronously."""
    fake = types.SimpleNamespace(compute=FakeStream(name="compute"), cudart=FakeCudart())
    properties = types.SimpleNamespace(name="Fake GPU", total_memory=8 * 2**30)
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_properties": lambda index: properties,
        "Stream": FakeStream,
        "Event": FakeEvent,
        "current_stream": lambda device=None: fake.compute,
        "stream": lambda stream: contextlib.nullcontext(),
        "device": lambda index: contextlib.nullcontext(),
        "cudart": lambda: fake.cudart,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "mem_get_info": lambda device=None: (FAKE_FREE_BYTES, properties.total_memory),
        "get_per_process_memory_fraction": lambda device=None: 1.0,
        "set_per_process_memory_fraction": lambda fraction, device=None: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "is_current_stream_capturing": lambda: False,
        # (read at call time: a test may patch the four figures)
        "memory_stats_as_nested_dict": lambda device=None: {
            "allocated_bytes": {"all": {"current": torch.cuda.memory_allocated(device),
                                        "peak": torch.cuda.max_memory_allocated(device)}},
            "reserved_bytes": {"all": {"current": torch.cuda.memory_reserved(device),
                                       "peak": torch.cuda.max_memory_reserved(device)}},
        },
    }
    for name, value in patches.items():
        monkeypatch.setattr(torch.cuda, name, value)

    def make(**kwargs) -> CudaDevice:
        device = CudaDevice(**kwargs)
        device.backend.torch_device = torch.device("cpu")  # "device" memory is CPU memory
        return device

    fake.make = make
    return fake


def test_fake_device_satisfies_protocol_and_uses_the_pinned_allocator(fake_cuda):
    device = fake_cuda.make(host_memory_budget_bytes=10 * MiB)
    assert isinstance(device, Device)
    assert device.name == "cuda:0 (Fake GPU)" and device.emulated is False
    # free + reserved (0) - 5% of that for fragmentation - 3% of free for NCCL and lazy kernels
    reserve_bytes = math.ceil(0.05 * FAKE_FREE_BYTES) + math.ceil(0.03 * FAKE_FREE_BYTES)
    assert device.capacity_bytes == FAKE_FREE_BYTES - reserve_bytes
    assert fake_cuda.make(capacity_bytes=123).capacity_bytes == 123
    assert device.host_pool._allocate is device.host_allocator
    assert isinstance(device.host_allocator, PinnedHostAllocator)

    buffer = device.host_pool.acquire(5000)  # exact size; whole private pages registered
    assert buffer.numel() == 5000
    assert fake_cuda.cudart.registered == {buffer.data_ptr(): 8192}
    address = buffer.data_ptr()
    device.host_pool.release(buffer)
    del buffer
    device.host_pool.trim()
    gc.collect()
    assert fake_cuda.cudart.unregistered == [address]


def test_fake_link_rates_are_the_ones_it_was_built_with_else_unknown(fake_cuda):
    device = fake_cuda.make()
    assert device.d2h_bytes_per_s is None and device.h2d_bytes_per_s is None  # not told: unknown
    device = fake_cuda.make(d2h_bytes_per_s=12_000_000_000, h2d_bytes_per_s=25e9)
    assert (device.d2h_bytes_per_s, device.h2d_bytes_per_s) == (12e9, 25e9)
    with pytest.raises(ValueError, match="device.h2d_bytes_per_s"):
        fake_cuda.make(h2d_bytes_per_s=0)


def test_fake_factory_passes_the_configured_link_rates(fake_cuda):
    from chameleon_dist.config import ChameleonConfig
    from chameleon_dist.device.factory import make_device

    device = make_device(ChameleonConfig(device={"kind": "cuda", "d2h_bytes_per_s": "12GB"}))
    assert isinstance(device, CudaDevice)
    assert (device.d2h_bytes_per_s, device.h2d_bytes_per_s) == (12e9, None)


def _round_trip(device, tensor):
    to_host = device.copy_to_host(tensor.untyped_storage())
    host = device.wait(to_host)
    to_device = device.copy_to_device(host)
    restored = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        device.wait(to_device).untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
    )
    device.release_host(host)
    return restored


def test_fake_round_trip_is_exact(fake_cuda):
    device = fake_cuda.make()
    base = torch.randn(1000)
    for tensor in (torch.randn(1237), torch.randn(777).bfloat16(), torch.arange(333), base[13:500]):
        assert torch.equal(_round_trip(device, tensor), tensor)


def test_fake_release_all_sources_orders_the_compute_stream_then_drops_sources(fake_cuda):
    device = fake_cuda.make()
    device._d2h_stream.held = True  # both copies still running
    storages = [torch.zeros(100).untyped_storage(), torch.zeros(50).untyped_storage()]
    handles = [device.copy_to_host(storage) for storage in storages]
    alive = [weakref.ref(storage) for storage in storages]
    del storages
    assert all(ref() is not None for ref in alive)  # the device keeps the sources while copies run
    assert device.release_all_sources() == 600
    assert fake_cuda.compute.waited == [handles[-1].event]  # one wait: copies complete in issue order
    assert all(ref() is None for ref in alive)
    assert device.release_all_sources() == 0
    assert device.stall_s() == pytest.approx(FakeEvent.ELAPSED_MS / 1000)


def test_fake_completed_sources_go_without_any_wait(fake_cuda):
    device = fake_cuda.make()
    storage = torch.zeros(10).untyped_storage()
    alive = weakref.ref(storage)
    device.copy_to_host(storage)
    del storage
    device.copy_to_host(torch.zeros(1).untyped_storage())  # drops sources of finished copies
    assert alive() is None
    assert fake_cuda.compute.waited == []


def test_fake_host_buffer_returns_to_pool_only_after_its_copy(fake_cuda):
    device = fake_cuda.make()
    host = device.wait(device.copy_to_host(torch.ones(256).untyped_storage()))
    device._h2d_stream.held = True
    to_device = device.copy_to_device(host)
    device.wait(to_device)
    device.release_host(host)  # the host->device copy still reads it
    assert device.host_pool.cached_bytes == 0 and device.host_pool.in_use_bytes == 1024
    device.copy_to_host(torch.ones(256).untyped_storage())
    assert device.host_pool.allocations == 2  # could not reuse it yet
    device._h2d_stream.finish()
    device.release_all_sources()
    assert device.host_pool.cached_bytes == 1024
    device.copy_to_host(torch.ones(256).untyped_storage())
    assert device.host_pool.allocations == 2  # reused, exact size


def test_fake_refusal_when_host_budget_is_full(fake_cuda):
    device = fake_cuda.make(host_memory_budget_bytes=1000)
    assert device.copy_to_host(torch.zeros(1000).untyped_storage()) is None
    assert device.host_pool.refusals == 1


def test_fake_stall_counts_only_unfinished_waits(fake_cuda):
    device = fake_cuda.make()
    device.wait(device.copy_to_host(torch.zeros(8).untyped_storage()))  # already done: no stall
    assert device.stall_s() == 0.0
    device._d2h_stream.held = True
    device.wait(device.copy_to_host(torch.zeros(8).untyped_storage()))
    assert device.stall_s() == pytest.approx(0.003)
    assert device.stall_s() == pytest.approx(0.003)  # pairs are summed once


def test_fake_swap_in_waits_for_an_unwaited_swap_out(fake_cuda):
    device = fake_cuda.make()
    device._d2h_stream.held = True
    to_host = device.copy_to_host(torch.zeros(8).untyped_storage())
    device.copy_to_device(to_host.result)
    assert device._h2d_stream.waited == [to_host.event]


def test_fake_dropped_unwaited_swap_in_orders_its_block(fake_cuda):
    device = fake_cuda.make()
    host = device.wait(device.copy_to_host(torch.zeros(8).untyped_storage()))
    device._h2d_stream.held = True
    to_device = device.copy_to_device(host)
    event = to_device.event
    del to_device
    gc.collect()
    assert fake_cuda.compute.waited == [event]


def test_fake_pressure_handler_is_tried_once_before_out_of_memory(fake_cuda, monkeypatch):
    device = fake_cuda.make(capacity_bytes=0)
    host = device.wait(device.copy_to_host(torch.zeros(4).untyped_storage()))
    real_empty = torch.empty
    failures = {"left": 1}

    def flaky_empty(*args, **kwargs):
        if "device" in kwargs and failures["left"]:
            failures["left"] -= 1
            raise torch.OutOfMemoryError("fake out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", flaky_empty)
    with pytest.raises(torch.OutOfMemoryError):
        device.copy_to_device(host)  # no handler: raised as is
    calls = []
    device.set_pressure_handler(lambda short_bytes: calls.append(short_bytes) or 0)
    failures["left"] = 1
    assert device.wait(device.copy_to_device(host)).numel() == 16
    assert calls == [16]
    failures["left"] = 2
    with pytest.raises(torch.OutOfMemoryError):
        device.copy_to_device(host)  # retried once only
    assert calls == [16, 16]


# ---- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_device():
    device = CudaDevice(host_memory_budget_bytes=4 * 2**30)
    yield device
    device.synchronize()
    device.release_all_sources()


@pytest.mark.gpu
@gpu
def test_gpu_round_trip_is_exact(cuda_device):
    assert isinstance(cuda_device, Device) and cuda_device.name.startswith("cuda:")
    base = torch.randn(1000, device="cuda")
    tensors = (
        torch.randn(1237, device="cuda"),
        torch.randn(777, device="cuda").bfloat16(),
        torch.arange(333, device="cuda"),
        base[13:500],
    )
    for tensor in tensors:
        to_host = cuda_device.copy_to_host(tensor.untyped_storage())
        host = cuda_device.wait(to_host)
        assert host.is_pinned()
        restored = torch.empty(0, dtype=tensor.dtype, device="cuda").set_(
            cuda_device.wait(cuda_device.copy_to_device(host)).untyped_storage(),
            tensor.storage_offset(),
            tensor.size(),
            tensor.stride(),
        )
        cuda_device.release_host(host)
        assert torch.equal(restored, tensor)


@pytest.mark.gpu
@gpu
def test_gpu_live_bytes_drop_after_release_all_sources(cuda_device):
    tensor = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with_tensor = cuda_device.live_bytes()
    to_host = cuda_device.copy_to_host(tensor.untyped_storage())
    del tensor
    assert cuda_device.live_bytes() == with_tensor  # the device keeps the source while the copy runs
    assert cuda_device.release_all_sources() == 64 * MiB
    assert cuda_device.live_bytes() == with_tensor - 64 * MiB
    cuda_device.synchronize()
    cuda_device.release_host(to_host.result)


@pytest.mark.gpu
@gpu
def test_gpu_host_pool_reuses_exact_sizes(cuda_device):
    sizes = (3 * MiB + 7, 5 * MiB, 3 * MiB + 7)
    allocations = []
    for _ in range(2):
        tensors = [torch.ones(n, dtype=torch.uint8, device="cuda") for n in sizes]
        hosts = [cuda_device.wait(cuda_device.copy_to_host(t.untyped_storage())) for t in tensors]
        for host in hosts:
            cuda_device.wait(cuda_device.copy_to_device(host))
            cuda_device.release_host(host)
        cuda_device.synchronize()
        cuda_device.release_all_sources()
        allocations.append(cuda_device.host_pool.allocations)
    assert allocations == [3, 3]  # the second iteration reuses every buffer (two share a size)
    assert cuda_device.host_pool.reserved_bytes == sum(sizes)  # exact sizes, nothing rounded up


@pytest.mark.gpu
@gpu
def test_gpu_refusal_when_host_budget_is_full():
    device = CudaDevice(host_memory_budget_bytes=1 * MiB)
    tensor = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    assert device.copy_to_host(tensor.untyped_storage()) is None
    assert device.host_pool.refusals == 1


@pytest.mark.gpu
@gpu
def test_gpu_stall_grows_when_waiting_on_a_big_copy_at_once(cuda_device):
    tensor = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    before_s = cuda_device.stall_s()
    assert before_s >= 0.0
    to_host = cuda_device.copy_to_host(tensor.untyped_storage())
    cuda_device.wait(to_host)
    assert cuda_device.stall_s() > before_s
    cuda_device.synchronize()
    cuda_device.release_host(to_host.result)


def _elapsed_ms(work) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@pytest.mark.gpu
@gpu
def test_gpu_copies_overlap_with_compute(cuda_device):
    """Lenient overlap check: (matmuls + swap-out) issued together take < 0.9x their separate times.

    Sizes aim at ~5-20 ms per part on an H100/H200: 6 bf16 8192^3 matmuls (~6.6 TFLOP) and a 512 MiB
    device->host copy (~10 ms at PCIe5 ~55 GB/s, ~20 ms on PCIe4). Perfect overlap would give
    max/sum ~0.5-0.7; serialised copies give ~1.0. Each time is the best of 3 runs (after a warm-up
    that also fills the pinned pool)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    source = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")

    def matmuls():
        for _ in range(6):
            a @ b

    def swap_out():
        to_host = cuda_device.copy_to_host(source.untyped_storage())
        cuda_device.wait(to_host)
        return to_host

    def both():
        to_host = cuda_device.copy_to_host(source.untyped_storage())
        matmuls()
        cuda_device.wait(to_host)
        return to_host

    def timed(work) -> float:
        best_ms = float("inf")
        for _ in range(4):  # the first run warms up
            handles = []
            elapsed_ms = _elapsed_ms(lambda: handles.append(work()))
            best_ms = min(best_ms, elapsed_ms)
            for handle in handles:
                if handle is not None:
                    cuda_device.release_host(handle.result)
            cuda_device.synchronize()
            cuda_device.release_all_sources()
        return best_ms

    matmul_ms, copy_ms, both_ms = timed(matmuls), timed(swap_out), timed(both)
    assert both_ms < 0.9 * (matmul_ms + copy_ms), (matmul_ms, copy_ms, both_ms)


def test_fake_release_completed_sources_never_waits_and_drops_only_finished_sources(fake_cuda):
    device = fake_cuda.make()
    device._d2h_stream.held = True
    storage = torch.zeros(100).untyped_storage()
    alive = weakref.ref(storage)
    device.copy_to_host(storage)
    del storage
    assert device.release_completed_sources() == 0 and alive() is not None  # still copying: kept, no wait
    assert fake_cuda.compute.waited == []
    device._d2h_stream.finish()  # the copy lands
    assert device.release_completed_sources() == 400 and alive() is None
    assert fake_cuda.compute.waited == [] and device.stall_s() == 0


def test_fake_swaps_are_peak_samples_below_an_earlier_peak(fake_cuda, monkeypatch):
    """The process peaked earlier (50 MiB): the iteration's peak is the highest sample, taken at swaps."""
    allocated = {"now": 10 * MiB}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 50 * MiB)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    device = fake_cuda.make()
    device.reset_peak()
    allocated["now"] = 30 * MiB  # forward: a swap-out while 30 MiB are held
    host = device.wait(device.copy_to_host(torch.zeros(4).untyped_storage()))
    allocated["now"] = 12 * MiB
    device.copy_to_device(host)
    allocated["now"] = 10 * MiB
    assert device.peak_bytes() == 30 * MiB and resets == []


def test_random_state_is_the_cuda_generator_of_the_device_in_use(fake_cuda, monkeypatch):
    """A retry replays dropout masks drawn on the GPU: the device's CUDA generator, by its index."""
    generators = {0: torch.tensor([7], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: generators[device].clone(), raising=False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: generators.__setitem__(device, state),
                        raising=False)
    device = fake_cuda.make()
    state = device.random_state()
    generators[0] = torch.tensor([9], dtype=torch.uint8)  # the step drew numbers
    device.set_random_state(state)
    assert torch.equal(generators[0], torch.tensor([7], dtype=torch.uint8))
