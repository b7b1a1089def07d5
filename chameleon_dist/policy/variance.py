"""What the saved bytes of the recent iterations say a policy must expect (issue 27, item 1).

A policy is generated from one traced iteration, but routing (which experts get tokens, and how many) and
shapes (a sequence length or batch size that recurs) move the bytes each layer saves from one iteration to
the next. ``SavedBytesSpread`` keeps, for the last ``WINDOW`` completed iterations, the bytes autograd
saved per transformer layer (the executor counts them at every save; -1 outside any layer), and
``worst_case`` says, per layer, how much more than in the traced iteration the most it saved was. The
controller generates its policies from the trace grown by those factors (``policy.scaling.grown``): a
policy that fits what the layers that vary saved at most, rather than only the one routing and the one
length in the trace, so that a shape seen before does not overshoot the first time it comes back.

Only growth counts: a layer that saved less than in the trace keeps the traced size (the trace is the
measurement; a policy for a smaller shape would overshoot the traced one). The window forgets a new
program's predecessors once ``clear`` is called (the operator sequence changed).
"""

from __future__ import annotations

import collections
from typing import Mapping

WINDOW = 16
"""Completed iterations remembered: enough for a few cycles of recurring lengths or a routing's spread, few
enough that a shape the job stopped using is forgotten."""

GROWTH_TOLERANCE = 0.05
"""A layer is grown only when it saved this much (relative) more than in the trace: timing and rounding
moves are not shapes."""


class SavedBytesSpread:
    """Per-layer saved bytes of the last ``window`` completed iterations (``note``), and the worst case they
    imply for a traced iteration (``worst_case``)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._seen: collections.deque[dict[int, int]] = collections.deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._seen)

    def note(self, saved_bytes_by_layer: Mapping[int, int]) -> None:
        """One completed iteration's saved bytes per layer (nothing when the executor counted none)."""
        if saved_bytes_by_layer:
            self._seen.append(dict(saved_bytes_by_layer))

    def clear(self) -> None:
        self._seen.clear()

    def worst_case(self, traced: Mapping[int, int]) -> tuple[dict[int, float], float]:
        """Per layer of ``traced`` (the traced iteration's saved bytes per layer), the most that layer saved in
        the iterations seen over what it saved in the trace where that is more than ``GROWTH_TOLERANCE`` above
        it, else 1.0; and the same for the iteration's total (for the ops of no layer ``traced`` names).
        ({}, 1.0) when nothing seen saved more than the trace anywhere."""
        growth: dict[int, float] = {}
        for layer, traced_bytes in traced.items():
            most = max((seen.get(layer, 0) for seen in self._seen), default=0)
            growth[layer] = _ratio(most, traced_bytes)
        traced_total = sum(traced.values())
        total = _ratio(max((sum(seen.values()) for seen in self._seen), default=0), traced_total)
        if total == 1.0 and all(g == 1.0 for g in growth.values()):
            return {}, 1.0
        return growth, total


def _ratio(most: int, traced: int) -> float:
    """``most / traced`` where that is more than ``1 + GROWTH_TOLERANCE``, else 1.0."""
    return most / traced if traced > 0 and most > (1 + GROWTH_TOLERANCE) * traced else 1.0
