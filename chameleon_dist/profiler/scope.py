"""``TrainingScope``: what the profiler needs to know about where the training thread is.

Whether an op belongs to the model's autograd work cannot be read from the grad mode alone: custom
autograd functions (Megatron's parallel linear layers, for one) run their forward with grad disabled.
So an op counts as part of autograd when grad is on, when it runs inside a backward pass, or when it
runs inside the forward of an attached model that was entered with grad on. A validation pass under
``torch.no_grad()`` enters the model with grad off and stays outside. ``quiet()`` hides the executor's
own bookkeeping ops (copies, restores) from the profiler, so the sequence describes the model only.

``LayerClock``: which transformer layer (a module at ``layers.<i>``, ``blocks.<i>``, ``h.<i>`` or
``layer.<i>``) of the attached models is running, in every iteration (two hooks per layer call).
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch
from torch import nn


_LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks|h|layer)\.(\d+)(?:\.|$)")


def layer_of(module_path: str) -> int:
    """The transformer-layer index in a module path such as ``decoder.layers.3.mlp`` (else -1)."""
    match = _LAYER_PATTERN.search(module_path)
    return int(match.group(1)) if match else -1


def is_layer_path(path: str) -> bool:
    """Whether ``path`` names a transformer layer itself (``layers.3``, not ``layers.3.mlp``)."""
    match = _LAYER_PATTERN.search(path)
    return bool(match) and match.end() == len(path)


class LayerClock:
    """The transformer layer running now (-1: none), from hooks on the layer modules of watched models."""

    def __init__(self) -> None:
        self._stack: list[int] = []

    def watch(self, model: nn.Module) -> None:
        for path, module in model.named_modules():
            if is_layer_path(path):
                module.register_forward_pre_hook(self._enter(layer_of(path)))
                module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, layer: int):
        def hook(module, args) -> None:
            self._stack.append(layer)

        return hook

    def _leave(self, module, args, output) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def layer(self) -> int:
        return self._stack[-1] if self._stack else -1

    def reset(self) -> None:
        """Forget layers an exception left entered (an iteration starts over)."""
        self._stack.clear()


class TrainingScope:
    def __init__(self) -> None:
        self._entered_with_grad: list[bool] = []
        self._grad_forwards = 0
        self.paused = False

    def watch(self, model: nn.Module) -> None:
        """Hooks on the model's own forward (one pair per call of the whole model, not per layer)."""
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module, args) -> None:
        grad = torch.is_grad_enabled()
        self._entered_with_grad.append(grad)
        self._grad_forwards += grad

    def _leave(self, module, args, output) -> None:
        if self._entered_with_grad:
            self._grad_forwards -= self._entered_with_grad.pop()

    def in_autograd(self) -> bool:
        return torch.is_grad_enabled() or self._grad_forwards > 0 or torch._C._current_graph_task_id() != -1

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        before = self.paused
        self.paused = True
        try:
            yield
        finally:
            self.paused = before
