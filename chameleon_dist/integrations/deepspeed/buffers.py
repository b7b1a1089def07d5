"""The device memory a DeepSpeed engine holds before its first iteration, counted by the emulated device at
install (``track_engine_buffers``), as ``attach`` counts the module's parameters.

A GPU's allocator counts every buffer DeepSpeed made while ``deepspeed.initialize`` ran; the emulated device
meters only what ops make inside an iteration, so without this a ZeRO-3 rank would start its first iteration
at almost nothing: its parameter partitions (``param.ds_tensor``; ``param.data`` is an empty placeholder
between gathers), the optimizer's flat fp32 partitions, its gradient partition buffer and reduce buckets
would never be counted. What is counted:

- every parameter's ZeRO-3 partition (``ds_tensor``), unless ``offload_param`` keeps it in host memory;
- every tensor the engine's optimizer holds in its attributes (the ZeRO optimizers' flat buffers, partitions
  and buckets, nested in lists, tuples and dicts) and in the wrapped torch optimizer's ``state``, unless
  ``offload_optimizer`` keeps them in host memory.

Each storage counts once (views of a flat buffer share it) and until it dies; gathered parameters and their
all-gather buffers, made inside the iteration, are metered by the dispatch layer as any op's output. On a GPU
``track`` does nothing: the caching allocator has counted them already.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

CONTAINER_DEPTH = 3
"""How deep lists, tuples and dicts inside the optimizer are searched (ZeRO keeps lists of lists of tensors)."""


def _tensors_in(value: Any, depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth - 1)


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """What a DeepSpeed optimizer (a ZeRO optimizer, or a torch optimizer) holds, and its wrapped torch
    optimizer's state."""
    seen: set[int] = set()
    for holder in (optimizer, getattr(optimizer, "optimizer", None)):
        if holder is None or id(holder) in seen or not hasattr(holder, "__dict__"):
            continue
        seen.add(id(holder))
        for value in vars(holder).values():
            yield from _tensors_in(value, CONTAINER_DEPTH)
        state = getattr(holder, "state", None)
        if isinstance(holder, torch.optim.Optimizer) and isinstance(state, dict):
            yield from _tensors_in(state, CONTAINER_DEPTH)


def engine_device_tensors(engine: Any) -> list[torch.Tensor]:
    """The device tensors ``engine`` made outside any iteration (see the module docstring)."""
    found: list[torch.Tensor] = []
    if not _offloads(engine, "zero_offload_param"):
        found += [p.ds_tensor for p in engine.module.parameters() if isinstance(getattr(p, "ds_tensor", None), torch.Tensor)]
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and not _offloads(engine, "zero_offload_optimizer"):
        found += list(_optimizer_tensors(optimizer))
    return [t for t in found if t.layout == torch.strided and t.device.type != "meta"]


def _offloads(engine: Any, setting: str) -> bool:
    offload = getattr(engine, setting, None)
    return bool(offload()) if callable(offload) and engine.zero_optimization_stage() > 0 else False


def track_engine_buffers(device: Any, engine: Any) -> int:
    """Count ``engine``'s device buffers on ``device`` (``Device.track``); returns the live bytes this added."""
    before_bytes = device.live_bytes()
    for tensor in engine_device_tensors(engine):
        device.track(tensor)
    added_bytes = device.live_bytes() - before_bytes
    logger.info("counting %s of DeepSpeed's own device buffers (partitions, optimizer buffers)", format_bytes(added_bytes))
    return added_bytes
