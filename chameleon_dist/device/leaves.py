"""The tensors in an op's arguments or outputs, found without ``torch.utils._pytree``.

Every op the devices see (the simulated backend, the meter) is walked for its tensors two or three times.
Aten ops take and return tensors, scalars and None, in tuples, lists (``torch.return_types`` are tuples) and
the kwargs dict; pytree's general walk (registered node types, namedtuple checks per node) was a fifth of the
simulated device's time per op. ``tensor_leaves`` walks exactly those containers.
"""

from __future__ import annotations

import torch


def tensor_leaves(obj: object) -> list[torch.Tensor]:
    """Every tensor in ``obj``, depth first, in order, through tuples, lists and dict values."""
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: object, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _collect(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, found)
