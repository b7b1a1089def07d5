"""The attached modules' buffers as an iteration began, for an out-of-memory retry to give back.

NOTE [Buffers a retry gives back]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A retry runs the failed attempt's closure again, so every state that attempt changed must be as it was: the
gradients (``GradientSnapshot``), the random states (``RandomState``), and the modules' buffers. Batch norm's
running statistics are the common case: each training forward applies the momentum update in place, so a
retry would apply it twice (and ``num_batches_tracked`` would count the batch twice). ``native_batch_norm``'s
schema does not say it writes them and their version counters do not move (NOTE [Undeclared state writes] in
``trace/state_writes.py``), so nothing after the fact can tell: the buffer is kept just before the first op of
the attempt that writes it, declared (``add_``, ``copy_``: ``trace/writes.py``) or not (the table), and a retry
copies every kept buffer back into the same tensor. Only buffers that are written are copied, once per
iteration, to a host buffer of the device's pool on the writing stream, which waits for the copy on the device
(the host does not); where the pool has no room, with a blocking copy. The dispatch layer calls ``before_write``
ahead of every op of the iteration, on either backend (``DeviceDispatch.before_write``); the copies are
Chameleon's own ops, hidden from the profiler.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from chameleon_dist.device.base import Device
from chameleon_dist.retry import host_copy, kept_values
from chameleon_dist.trace.exactness import undeclared_state_written
from chameleon_dist.trace.writes import WrittenTensors


class BufferSnapshot:
    """Every buffer of ``modules`` that an attempt writes, kept as it was before the first write (NOTE [Buffers
    a retry gives back]). ``restore`` gives them back for a retry; ``close`` ends the iteration."""

    def __init__(self, modules: Iterable[nn.Module], device: Device | None,
                 hide_own_ops: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        self._device = device
        self._hide_own_ops = hide_own_ops
        self._buffers: dict[int, torch.Tensor] = {}
        for module in modules:
            for buffer in module.buffers():
                if buffer.layout == torch.strided and buffer.device.type != "meta":
                    self._buffers[buffer.untyped_storage()._cdata] = buffer
        self._written = WrittenTensors()
        self._kept: dict[int, tuple[torch.Tensor, Any]] = {}  # storage key -> (the buffer, its copy)

    def __bool__(self) -> bool:
        return bool(self._buffers)

    def before_write(self, func, args: tuple, kwargs: dict) -> None:
        """An op of the iteration is about to run: keep each buffer it writes, the first time."""
        buffers = self._buffers
        for tensor in (*self._written.of(func, args, kwargs), *undeclared_state_written(func, args, kwargs)):
            key = tensor.untyped_storage()._cdata
            buffer = buffers.get(key)
            if buffer is not None and key not in self._kept:
                with self._hide_own_ops():
                    self._kept[key] = (buffer, host_copy(self._device, buffer))

    def restore(self) -> None:
        """Every kept buffer gets its values back (the same tensor); they are kept again on the retry's first
        write."""
        if not self._kept:
            return
        if self._device is not None:
            self._device.synchronize()  # (a retry: every copy has landed)
        with torch.no_grad(), self._hide_own_ops():
            for buffer, kept in self._kept.values():
                buffer.copy_(kept_values(buffer, kept))
        self._release()

    def close(self) -> None:
        with self._hide_own_ops():
            self._release()

    def _release(self) -> None:
        for _, kept in self._kept.values():
            if not isinstance(kept, torch.Tensor):
                self._device.release_host(kept.result)
        self._kept.clear()
