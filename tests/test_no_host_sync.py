"""A Stable iteration makes no host-device synchronisation of Chameleon's own (issue 24, item 6), and the
saved-tensor hooks queue nothing while a CUDA graph is captured (item 7), on the fake CUDA backend of
``test_cuda_device.py``; the simulated backend's host waits are checked too (both run ``StreamDevice``)."""

from __future__ import annotations

import collections
import gc

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.executor import IterationContext, SwapExecutor
from tests.test_cuda_device import FakeEvent, FakeStream, fake_cuda  # noqa: F401 (the fixture)

_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.__bool__, torch.Tensor.numpy}


class _SyncCounter(TorchFunctionMode):
    """Counts the tensor calls that make a GPU's host wait: value reads of device tensors and blocking copies
    from them to the host (``to("cpu")`` without ``non_blocking``)."""

    def __init__(self, is_device_tensor, counts) -> None:
        super().__init__()
        self._is_device_tensor, self._counts = is_device_tensor, counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and self._is_device_tensor(source):
            if func in _HOST_READS:
                self._counts[func.__name__] += 1
            elif func is torch.Tensor.to and not kwargs.get("non_blocking", False) and \
                    any(str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")]):
                self._counts["to(cpu)"] += 1
        return func(*args, **kwargs)


@pytest.fixture
def counted(fake_cuda, monkeypatch):  # noqa: F811
    """The fake CUDA device with every synchronising call counted in ``counts``."""
    counts = collections.Counter()
    for owner, name in ((FakeEvent, "synchronize"), (FakeStream, "synchronize")):
        original = getattr(owner, name)

        def counting(self, _original=original, _name=f"{owner.__name__}.{name}"):
            counts[_name] += 1
            return _original(self)

        monkeypatch.setattr(owner, name, counting)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: counts.update(["cuda.synchronize"]))
    nested = torch.cuda.memory_stats_as_nested_dict
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: counts.update(["memory_stats"]) or {})
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict",
                        lambda device=None: counts.update(["stats_reads"]) or nested(device))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.zeros(8, dtype=torch.uint8),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: None, raising=False)
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    device = fake_cuda.make(host_memory_budget_bytes=64 * 2**20)
    host_buffers = set()
    allocate = device.host_pool._allocate

    def allocate_host(nbytes):
        buffer = allocate(nbytes)
        host_buffers.add(buffer.untyped_storage().data_ptr())
        return buffer

    device.host_pool._allocate = allocate_host
    # the fake's "device" memory is CPU memory: every tensor but the host pool's buffers is a device tensor
    device.backend.is_device_tensor = lambda t: t.device.type == "cpu" and t.untyped_storage().data_ptr() not in host_buffers
    yield device, counts, capturing
    device.synchronize()
    device.release_all_sources()
    gc.collect()
    device.host_pool.trim()
    del device
    gc.collect()  # pinned buffers are unregistered now, with this test's fake cudart, not in a later test


def _train(chameleon, model, steps, counts, is_device_tensor):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    per_iteration = []
    for step in range(steps):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad(set_to_none=False)  # gradients zeroed in place: the snapshot's fused check runs

        def closure():
            loss = model(x).square().mean()
            loss.backward()
            return loss.detach()

        counts.clear()
        with _SyncCounter(is_device_tensor, counts):
            chameleon.run_iteration(closure, optimizer=optimizer)
        per_iteration.append((chameleon.last_report, dict(counts)))
    return per_iteration


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])


def test_a_stable_iteration_on_the_cuda_backend_calls_no_synchronising_api(counted):
    """Counted: event/stream/device synchronize, ``.item()``/``.tolist()``/``.cpu()``/blocking ``to("cpu")`` of a
    device tensor, and ``memory_stats`` (flattened and sorted). Before the fix every iteration synchronised
    the device twice (stall and iteration times) and the gradient snapshot read ``.tolist()``."""
    device, counts, _ = counted
    chameleon = Chameleon({"min_swap_bytes": 0, "memory_budget": "1GB"}, device=device)
    model = chameleon.attach(_mlp())
    runs = _train(chameleon, model, 12, counts, device.is_device_tensor)
    stable = [(report, calls) for report, calls in runs if report.stage == "stable"]
    assert len(stable) >= 3, [report.stage for report, _ in runs]
    for report, calls in stable:
        assert {name: n for name, n in calls.items() if name != "stats_reads"} == {}, (report.iteration, calls)
        assert calls.get("stats_reads", 0) <= 4, calls  # the iteration's peak: a few reads, none per op
    warmup_calls = runs[0][1]
    assert warmup_calls.get("cuda.synchronize", 0) >= 1  # WarmUp still waits for its own times (the check counts)


def test_stable_iterations_of_the_emulated_device_make_the_host_wait_no_more_than_without_chameleon():
    """The simulated backend runs the same ``StreamDevice`` code: Chameleon's own host waits in Stable (its
    timer, stall reads, the gradient snapshot, pressure relief) would move the host clock to the device."""

    def waits(enabled: bool) -> list[int]:
        device = EmulatedDevice(10**9, peak_flop_per_s=1e10, memory_bytes_per_s=1e10, host_op_s=1e-7,
                                d2h_bytes_per_s=1e10, h2d_bytes_per_s=1e10)
        chameleon = Chameleon({"enabled": enabled, "min_swap_bytes": 4096, "memory_budget": 3 * 2**20}, device=device)
        model = chameleon.attach(_mlp())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        clock = device.backend.clock
        found = []
        for step in range(12):
            x = device.track(torch.randn(64, 256, generator=torch.Generator().manual_seed(step)))
            optimizer.zero_grad(set_to_none=False)

            def closure():
                loss = model(x).square().mean()
                loss.backward()
                return loss.detach()

            host_s, device_s = clock.host_s, clock.device_idle_s()
            chameleon.run_iteration(closure, optimizer=optimizer)
            if chameleon.last_report.stage == "stable":
                # the host never jumped to the device's time: it only advanced by its own work per op
                found.append(int(clock.host_s >= device_s and clock.host_s > host_s + 1e-3))
        return found

    stable = waits(True)
    assert len(stable) >= 2 and sum(stable) == 0, stable


def test_under_graph_capture_the_hooks_keep_everything_and_queue_nothing(counted, monkeypatch):
    from chameleon_dist.executor.capture import GraphCaptureSwapError
    device, counts, capturing = counted
    executor = SwapExecutor(device, min_swap_bytes=0)
    device.set_pressure_handler(executor.relieve_pressure)
    layer = nn.Linear(256, 256)
    executor.protect(layer)
    x = torch.randn(64, 256, requires_grad=True)
    queued = collections.Counter()
    for owner, name in ((FakeEvent, "query"), (FakeStream, "wait_stream"), (FakeStream, "wait_event")):
        original = getattr(owner, name)

        def spy(self, *args, _original=original, _name=name):
            queued[_name] += capturing["now"]
            return _original(self, *args)

        monkeypatch.setattr(owner, name, spy)
    with executor.active(IterationContext()) as swap_counters:
        capturing["now"] = True
        out = torch.nn.functional.gelu(layer(x)).sum()
        out.backward()
        capturing["now"] = False
    assert swap_counters.swapped_storages == 0 and swap_counters.swap_out_bytes == 0
    assert sum(queued.values()) == 0 and device.host_pool.allocations == 0, queued
    reference = torch.nn.functional.gelu(layer(x.detach().requires_grad_()))
    assert torch.equal(out.detach(), reference.sum().detach())

    # a tensor swapped out before the capture cannot come back inside it
    with executor.active(IterationContext()) as swap_counters:
        y = torch.sin(x * 2)
        assert swap_counters.swapped_storages >= 1
        capturing["now"] = True
        with pytest.raises(GraphCaptureSwapError, match="graph capture"):
            y.sum().backward()
        capturing["now"] = False
