"""CUDA-graph capture on the emulated device (issue 37, item 10): while a capture runs, CUDA refuses event
queries and host waits, and the simulated backend's ``capture()`` does the same, so every path Chameleon takes
under a capture is checked on the CPU: the saved-tensor hooks, the op clock the profiler's dispatch modes drive
(placed swap-outs, releases and swap-ins), and a copy handle dropped by the garbage collector."""

from __future__ import annotations

import gc

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice
from chameleon_dist.device.simulated.clock import GraphCaptureQueryError


def _device() -> EmulatedDevice:
    # a link slower than a layer: policies place swap-outs at ops after their saves (the op clock's work)
    return EmulatedDevice(10**10, peak_flop_per_s=2e9, memory_bytes_per_s=2e9, launch_latency_s=1e-6,
                          host_op_s=1e-8, h2d_bytes_per_s=1e7, d2h_bytes_per_s=1e7)


class _Stack(torch.nn.Module):
    """Linear+ReLU layers; from ``capture_from`` on, the forward runs inside the backend's capture."""

    def __init__(self, backend, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.backend = backend
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.capture_from: int | None = None

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            if index == self.capture_from:
                with self.backend.capture():
                    for later in self.layers[index:]:
                        x = torch.relu(later(x))
                return x.square().mean()
            x = torch.relu(layer(x))
        return x.square().mean()


def _train(chameleon: Chameleon, device: EmulatedDevice, steps: int, capture_at: set[int]):
    torch.manual_seed(0)
    model = chameleon.attach(_Stack(device.backend))
    losses, grads, reports = [], [], []
    for step in range(steps):
        x = device.track(torch.randn(512, 256, generator=torch.Generator().manual_seed(step)))
        model.capture_from = 3 if step in capture_at else None

        def closure():
            loss = model(x)
            loss.backward()
            return loss.detach()

        losses.append(chameleon.run_iteration(closure))
        grads.append([p.grad.clone() for p in model.parameters()])
        reports.append(chameleon.last_report)
        for p in model.parameters():
            p.grad = None
    return losses, grads, reports


def test_the_simulated_capture_refuses_event_queries_and_host_waits():
    device = _device()
    backend = device.backend
    event = backend.new_event()
    event.record(backend.compute_stream)
    with backend.capture():
        assert device.is_capturing()
        with pytest.raises(GraphCaptureQueryError):
            event.query()
        with pytest.raises(GraphCaptureQueryError):
            backend.synchronize()
    assert not device.is_capturing()
    assert event.query() in (True, False)


def test_swaps_placed_inside_a_captured_region_wait_for_its_end_and_training_stays_bit_identical():
    """Policy trials place swap-outs at ops after their saves; in step 3 (a trial) the second half of the
    forward pass is captured. The op clock reaches placed ops inside the capture: issuing a copy there (which
    queries events and orders streams) would invalidate the capture. They start at the first op after it."""
    steps, captured = 14, {3}
    reference = _train(Chameleon({"enabled": False}, device=_device()), _device(), steps, captured)
    probe_device = _device()
    probe = Chameleon({"enabled": False}, device=probe_device)
    _, _, probe_reports = _train(probe, probe_device, 2, set())
    device = _device()
    chameleon = Chameleon({"memory_budget": int(probe_reports[-1].peak_device_bytes * 0.6), "min_swap_bytes": 4096},
                          device=device)
    losses, grads, reports = _train(chameleon, device, steps, captured)
    assert [reports[i].stage for i in sorted(captured)] == ["gen_policy"], [r.stage for r in reports]
    assert all(reports[i].delayed_swap_outs > 0 for i in captured), [r.delayed_swap_outs for r in reports]
    assert reports[-1].stage == "stable", [r.stage for r in reports]
    assert all(torch.equal(a, b) for a, b in zip(losses, reference[0]))
    assert all(torch.equal(a, b) for step_a, step_b in zip(grads, reference[1]) for a, b in zip(step_a, step_b))


def test_a_copy_handle_collected_during_a_capture_orders_its_stream_after_the_capture():
    device = _device()
    backend = device.backend
    device.track_module(torch.nn.Linear(1, 1))
    with device.active():
        source = torch.randn(1 << 16)
        device.track(source)
        host_handle = device.copy_to_host(source.untyped_storage())
        handle = device.copy_to_device(host_handle.result)  # never waited on: its stream must wait on the way out
        assert not handle.done()
        with backend.capture():
            del handle
            gc.collect()
        # after the capture the compute stream is ordered after the copy, as the handle's guard asked
        work = torch.ones(4) * 2
        del work
    device.synchronize()
