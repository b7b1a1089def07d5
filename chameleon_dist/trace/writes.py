"""Which tensors an aten op writes in place, read from its schema.

An op's schema marks every argument it mutates (``self`` of ``add_``, ``out=`` of ``mul.out``, each
tensor of ``_foreach_add_``'s list) with a write alias (``Tensor(a!)``). The swap executor must hear
of every such write to a storage it copied: a saved tensor changed in place after its save has to make
backward raise, as autograd does, even when nothing references the changed tensor any more. A dispatch
mode that already sees every op (the profiler's) asks ``WrittenTensors`` and reports what it finds.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NOTHING: tuple = ()

NOT_DATA_WRITES = frozenset({"record_stream", "detach_", "resize_", "resize_as_", "_resize_output_"})
"""Ops whose schema marks an argument as mutated although its bytes stay as they were and autograd's
version counter does not move (``record_stream`` only tells the allocator about a stream)."""


def mutable_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``func``'s schema says it writes; () for pure ops."""
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "_opname", None) in NOT_DATA_WRITES:
        return _NOTHING
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


class WrittenTensors:
    """``of(func, args, kwargs)``: the tensors the op is about to write. The schema lookup is cached per
    op in the instance (one per dispatch mode), so pure ops cost one dictionary lookup."""

    def __init__(self) -> None:
        self._mutable: dict[object, tuple[tuple[int, str], ...]] = {}

    def of(self, func, args, kwargs) -> tuple | list[torch.Tensor]:
        mutable = self._mutable.get(func)
        if mutable is None:
            mutable = self._mutable[func] = mutable_arguments(func)
        if not mutable:
            return _NOTHING
        written: list[torch.Tensor] = []
        for position, name in mutable:
            value = args[position] if position < len(args) else (kwargs or {}).get(name)
            if isinstance(value, torch.Tensor):
                written.append(value)
            elif isinstance(value, (list, tuple)):
                written.extend(item for item in value if isinstance(item, torch.Tensor))
        return written


class WriteWatch(TorchDispatchMode):
    """Reports every in-place write to ``on_write``: for a swap executor used without a profiler, whose
    dispatch mode would otherwise report them."""

    def __init__(self, on_write) -> None:
        super().__init__()
        self._on_write = on_write
        self._written = WrittenTensors()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        written = self._written.of(func, args, kwargs)
        if written:
            self._on_write(written)
        return func(*args, **(kwargs or {}))
