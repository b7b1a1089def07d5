"""The models of ``launch/bench/gpu_probes.py``, written against the device backend's stream calls (``new_stream``,
``use_stream``, ``record_stream``, ``wait_stream``), so the same model runs on a GPU's streams and on the emulated
device's.

- ``Tower``: a stack of MLP blocks (Linear, GELU, Linear, LayerNorm), deterministic on a GPU under
  ``torch.use_deterministic_algorithms`` (no attention kernel), whose saved activations are what swap moves.
- ``SideStreamNet``: compute layers, then a section on a side stream in forward (Linear, BatchNorm1d, ReLU),
  then a function whose backward enters a side stream itself (a module that overlaps its backward with other
  work), then compute layers again. Its backward runs on the streams its forward ran on (the autograd engine's
  rule), and BatchNorm's running statistics are state that must come out the same with swap as without.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Tower(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                                  nn.LayerNorm(width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


class SideBackward(torch.autograd.Function):
    """``x * tanh(x)`` in forward on the current stream; the backward computes on ``side``, which it enters itself,
    ordered as a correct program orders it (the side stream waits for the current one, the current one for the
    result, and both tensors are recorded on the stream that reads them)."""

    @staticmethod
    def forward(ctx, x, backend, side):
        ctx.save_for_backward(x)
        ctx.backend, ctx.side = backend, side
        return x * torch.tanh(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        backend, side = ctx.backend, ctx.side
        current = backend.current_stream()
        side.wait_stream(current)
        backend.record_stream(x, side)
        backend.record_stream(grad, side)
        with backend.use_stream(side):
            t = torch.tanh(x)
            result = grad * (t + x * (1 - t * t))
        current.wait_stream(side)
        backend.record_stream(result, current)
        return result, None, None


class SideStreamNet(nn.Module):
    def __init__(self, backend, width: int, depth: int) -> None:
        super().__init__()
        self.backend = backend
        self.side = backend.new_stream("probe-side")
        self.head = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.middle = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
                                    for _ in range(depth))
        self.tail = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend, side = self.backend, self.side
        for layer in self.head:
            x = F.relu(layer(x))
        compute = backend.current_stream()
        side.wait_stream(compute)
        backend.record_stream(x, side)
        with backend.use_stream(side):
            for block in self.middle:
                x = block(x)
        compute.wait_stream(side)
        backend.record_stream(x, compute)
        x = SideBackward.apply(x, backend, side)
        for layer in self.tail:
            x = F.relu(layer(x))
        return x.square().mean()


def model_state(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers (BatchNorm's running statistics and batch count), in order."""
    return [t.detach() for t in (*model.parameters(), *model.buffers())]
