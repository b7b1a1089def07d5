"""What of a DeepSpeed engine the swap path must never take, beyond the parameters ``attach`` protects.

- **Pipeline receive buffers.** A ``PipelineEngine`` receives activations and gradients into buffers it
  reuses for every micro-batch (``pipe_recv_buf``, ``grad_layer``, ``meta_buffer``); what a stage trains on
  is a clone. The buffers are protected the moment a receive instruction made them (the engine's copy of
  the instruction map wraps ``RecvActivation`` and ``RecvGrad``) and again when each iteration begins.
- **ZeRO-3's gathered parameters.** ZeRO-3 keeps each rank's partition and gathers a module's full
  parameters for its forward; ``param.data`` is then the gathered copy, released after the module. A view
  of it saved for backward would be a copy moved out and back for nothing. Each module's own gathered
  parameters are protected from its forward pre-hook (registered after DeepSpeed's, so they are gathered
  by then) until its forward hook, when ZeRO-3 may free them and their addresses may be reused. Nothing
  here holds a gathered storage past its module's forward (a forward that raised lets go at the next one),
  and a saved parameter is handed back to autograd as itself (``executor/records.py`` ``KeptParameter``):
  ZeRO-3's release (``param.data = ...``) frees the gathered weight with Chameleon as without it.

Gradient buckets and partitions and the optimizer state are never saved for backward, so autograd's pack
hook never sees them; the ZeRO-1/2 flat buffers the parameters live in are the parameters' storages.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def pipeline_buffers(engine: Any) -> list[torch.Tensor]:
    """The receive buffers a ``PipelineEngine`` reuses (none before its first receive)."""
    return [t for name in ("pipe_recv_buf", "grad_layer", "meta_buffer") for t in _tensors(getattr(engine, name, None))]


def protect_engine_buffers(executor: Any, engine: Any, instructions: dict, schedule: Any) -> None:
    """Protect a ``PipelineEngine``'s receive buffers: from every iteration's start, and the moment a receive
    instruction (in ``instructions``, the engine's own copy of the map) has made them."""
    executor.protect(lambda: pipeline_buffers(engine))

    def protecting(original: Any) -> Any:
        def run(engine_self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(engine_self, *args, **kwargs)
            for buffer in pipeline_buffers(engine_self):
                executor.protect_now(buffer)
            return result

        return run

    for kind in (schedule.RecvActivation, schedule.RecvGrad):
        instructions[kind] = protecting(instructions[kind])


def protect_gathered_parameters(executor: Any, module: nn.Module) -> list[Any]:
    """ZeRO-3: protect each module's gathered parameters during its forward; returns the hook handles."""
    handles = []
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        if not own:
            continue
        added: list[torch.Tensor] = []

        def released(mod: nn.Module, args: Any, output: Any, added: list = added) -> None:
            for data in added:
                executor.unprotect_now(data)
            added.clear()

        def gathered(mod: nn.Module, args: Any, own: list = own, added: list = added) -> None:
            released(mod, args, None)  # (a forward that raised left its gathered data here: let it go)
            added.extend(p.data for p in own if p.data.numel() and executor.protect_now(p.data))

        handles.append(sub.register_forward_pre_hook(gathered))
        handles.append(sub.register_forward_hook(released))
    return handles
