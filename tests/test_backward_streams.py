"""Backward on its forward's stream, as the autograd engine runs it on a GPU (issue 37, item 1).

On CUDA the engine runs each node's backward on the stream that was current when its forward ran, whatever
stream ``backward()`` was called under, and orders a node after the nodes that feed it and the caller after the
whole pass. The emulated device does the same, so a swap-in made for such a node must be allocated where it is
read: a prefetch fired while another node runs on the compute stream used to allocate its destination there,
and the block went back to the compute stream's pool while the side stream still read it (the hazard checker
raises). Device figures are fixed per test (a slow device, a fast host), so every run repeats exactly."""

from __future__ import annotations

import pytest
import torch

from chameleon_dist import Chameleon
from chameleon_dist.device.emulated import EmulatedDevice


def _lagging_device(**figures) -> EmulatedDevice:
    settings = dict(peak_flop_per_s=2e9, memory_bytes_per_s=2e9, launch_latency_s=1e-6, host_op_s=1e-8,
                    h2d_bytes_per_s=2e10, d2h_bytes_per_s=2e10)
    settings.update(figures)
    return EmulatedDevice(10**10, **settings)


class _Scaled(torch.autograd.Function):
    """A custom autograd function that saves its input and notes the stream its backward ran on."""

    streams: list = []
    backend = None

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.tanh(x * weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _Scaled.streams.append(_Scaled.backend.current_stream())
        y = torch.tanh(x * weight)
        inner = grad * (1 - y * y)
        return inner * weight, (inner * x).sum(0)


class _SidePasses(torch.nn.Module):
    """Compute layers, then a section under a side stream in forward (a custom function and linear layers, as
    communication-overlap code runs them), then compute layers again."""

    def __init__(self, backend, side, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.backend, self.side = backend, side
        self.head = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.middle = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.scale = torch.nn.Parameter(torch.ones(width) * 0.5)
        self.tail = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.head:
            x = torch.relu(layer(x))
        compute = self.backend.current_stream()
        self.side.wait_stream(compute)
        self.backend.record_stream(x, self.side)  # (a correct program: made on one stream, read on another)
        with self.backend.use_stream(self.side):
            for layer in self.middle:
                x = torch.relu(layer(x))
            x = _Scaled.apply(x, self.scale)
        compute.wait_stream(self.side)
        self.backend.record_stream(x, compute)
        for layer in self.tail:
            x = torch.relu(layer(x))
        return x.square().mean()


def _run(enabled: bool, steps: int, **settings):
    device = _lagging_device()
    backend = device.backend
    side = backend.new_stream("side")
    _Scaled.streams, _Scaled.backend = [], backend
    torch.manual_seed(0)
    model = _SidePasses(backend, side)
    chameleon = Chameleon({"enabled": enabled, "min_swap_bytes": 4096, **settings}, device=device)
    chameleon.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, grads, reports = [], [], []
    for step in range(steps):
        x = device.track(torch.randn(256, 128, generator=torch.Generator().manual_seed(step)))

        def closure():
            loss = model(x)
            loss.backward()
            return loss.detach()

        losses.append(chameleon.run_iteration(closure, optimizer=None))
        grads.append([p.grad.clone() for p in model.parameters()])
        reports.append(chameleon.last_report)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads, reports, side


def test_a_custom_function_and_linear_layers_run_their_backward_on_their_forward_stream():
    """The backward of nodes made under the side stream runs there (the engine's per-node stream), the rest
    on the compute stream, though ``backward()`` was called under the compute stream."""
    device = _lagging_device()
    backend = device.backend
    side = backend.new_stream("side")
    _Scaled.streams, _Scaled.backend = [], backend
    torch.manual_seed(0)
    model = _SidePasses(backend, side)
    device.track_module(model)
    x = device.track(torch.randn(256, 128))
    with device.active():
        loss = model(x)
        side_busy_s = side.busy_s
        compute_busy_s = backend.compute_stream.busy_s
        loss.backward()
        # the first op after the pass: the caller's stream is ordered after the side stream's backward
        after = model.head[0].weight.grad.sum()
    assert _Scaled.streams == [side]
    assert side.busy_s > side_busy_s, "the linear layers' backward under the side stream ran there"
    assert backend.compute_stream.busy_s > compute_busy_s
    assert backend.compute_stream.ready_s >= side.ready_s
    assert torch.isfinite(after)


def test_backward_called_under_a_side_stream_still_runs_compute_nodes_on_the_compute_stream():
    device = _lagging_device()
    backend = device.backend
    side = backend.new_stream("side")
    layer = torch.nn.Linear(64, 64)
    device.track_module(layer)
    x = device.track(torch.randn(32, 64))
    with device.active():
        loss = torch.relu(layer(x)).sum()
        side.wait_stream(backend.compute_stream)
        compute_busy_s = backend.compute_stream.busy_s
        side_busy_s = side.busy_s
        with backend.use_stream(side):
            loss.backward()
    compute_work_s = backend.compute_stream.busy_s - compute_busy_s
    # (the side stream runs only the root's gradient, which backward() makes on the caller's stream)
    assert 0 <= side.busy_s - side_busy_s < compute_work_s / 10, (side.busy_s - side_busy_s, compute_work_s)


@pytest.mark.parametrize("prefetch_depth", [1, 3])
def test_prefetched_swap_ins_for_a_side_stream_backward_are_allocated_where_they_are_read(prefetch_depth):
    """Every saved activation is swapped in WarmUp; unpacking one in a compute node prefetches the next ones
    backward needs, which belong to side-stream nodes. Their destinations must be allocated on the side stream
    (the block goes back to the stream that reads it), or the hazard checker raises when they die."""
    reference_losses, reference_grads, _, _ = _run(False, 3)
    losses, grads, reports, _ = _run(True, 3, executor={"prefetch_depth": prefetch_depth})
    assert sum(r.prefetched for r in reports) > 0, "the test must exercise prefetch"
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))
    assert all(torch.equal(a, b) for step_a, step_b in zip(grads, reference_grads) for a, b in zip(step_a, step_b))


class _SideBackward(torch.autograd.Function):
    """Forward on the current stream; backward computes on a side stream it enters itself (a module that
    overlaps its backward with other work), ordered as a correct program orders it."""

    backend = None
    side = None
    streams: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        backend, side = _SideBackward.backend, _SideBackward.side
        current = backend.current_stream()
        side.wait_stream(current)
        backend.record_stream(x, side)
        backend.record_stream(grad, side)
        with backend.use_stream(side):
            _SideBackward.streams.append(backend.current_stream())
            result = 2 * x * grad
        current.wait_stream(side)
        backend.record_stream(result, current)
        return result


def _side_backward_run(enabled: bool, steps: int):
    device = _lagging_device()
    backend = device.backend
    _SideBackward.backend, _SideBackward.side, _SideBackward.streams = backend, backend.new_stream("side"), []
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(4))
    chameleon = Chameleon({"enabled": enabled, "min_swap_bytes": 4096, "executor": {"prefetch_depth": 2}},
                          device=device)
    chameleon.attach(layers)
    grads = []
    for step in range(steps):
        x = device.track(torch.randn(256, 128, generator=torch.Generator().manual_seed(step)))

        def closure():
            h = x
            for layer in layers:
                h = _SideBackward.apply(torch.tanh(layer(h)))
            h.mean().backward()

        chameleon.run_iteration(closure)
        grads.append([p.grad.clone() for p in layers.parameters()])
        for p in layers.parameters():
            p.grad = None
    return grads, _SideBackward.streams, chameleon.last_report


def test_a_stream_entered_inside_a_backward_node_is_current_there_and_swapped_inputs_stay_exact():
    reference, _, _ = _side_backward_run(False, 2)
    grads, streams, report = _side_backward_run(True, 2)  # (WarmUp: every saved tensor is swapped)
    assert streams and all(s is _SideBackward.side for s in streams)
    assert report.swapped_storages > 0
    assert all(torch.equal(a, b) for step_a, step_b in zip(grads, reference) for a, b in zip(step_a, step_b))
