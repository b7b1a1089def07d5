"""``TrainingScope``: what the profiler needs to know about where the training thread is.

Whether an op belongs to the model's autograd work cannot be read from the grad mode alone: custom
autograd functions (Megatron's parallel linear layers, for one) run their forward with grad disabled.
So an op counts as part of autograd when grad is on, when it runs inside a backward pass, or when it
runs inside the forward of an attached model that was entered with grad on. A validation pass under
``torch.no_grad()`` enters the model with grad off and stays outside. ``quiet()`` hides the executor's
own bookkeeping ops (copies, restores) from the profiler, so the sequence describes the model only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


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
