"""What the swap executor receives for one iteration (``IterationContext``), what it counts meanwhile
(``SwapCounters``) and reports back at the end (``SwapFigures``, nested in ``IterationReport``; its fields,
declared once in ``trace/swap_figures.py``, are also the counters'), and what a detailed profiler hears from
it (``SwapObserver``)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager, Protocol

import torch

from chameleon_dist.executor.matching import MatchCounts
from chameleon_dist.policy.model import Policy
from chameleon_dist.trace.swap_figures import SwapFigures, counting_twin


def _unknown_op_count() -> int:
    return -1


def _unknown_site() -> str:
    return "?"


def _unnamed_micro_batch() -> int | None:
    return None


def _no_layer() -> int:
    return -1


class SwapObserver(Protocol):
    """What the detailed profiler wants to hear from the executor (profiling iterations only)."""

    def on_saved(self, tensor: torch.Tensor, site: str = "") -> None: ...

    def on_swap_out(self, storage: torch.UntypedStorage) -> int: ...

    def on_swap_in(self, swap_index: int, at_op: int) -> None: ...

    def on_restored(self, swap_index: int, tensor: torch.Tensor) -> None: ...

    @property
    def op_count(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class IterationContext:
    """Everything the executor needs from its caller for one iteration (``SwapExecutor.active``).

    Args:
        policy: what to swap (see NOTE [Save-site matching] in ``executor/matching.py``); None swaps
            every eligible tensor of at least ``min_swap_bytes`` (the paper's WarmUp behaviour).
        op_clock: the number of ops the iteration has run so far; planned swap-ins fire on it. The
            default (-1, unknown) fires them at the first unpack of backward.
        observer: the detailed profiler of a profiling iteration, told of every save, swap and restore.
        hide_own_ops: a context-manager factory under which the executor runs its own ops (copies,
            views), so that a profiler does not count them as the model's.
        writes_reported: True when the caller's dispatch mode already reports in-place writes to
            ``SwapExecutor.note_writes`` (the runtime's profiler does); else the executor watches for them
            with a dispatch mode of its own.
        site_clock: where the iteration is now ("layer:last op"), part of every save's site (NOTE
            [Save-site matching] in ``executor/matching.py``). The default knows neither.
        layer_clock: the transformer layer running now (-1: none, the default), by which the executor counts
            the bytes saved per layer (``SwapCounters.saved_bytes_by_layer``, for ``policy.variance``).
        micro_batch: the micro-batch the engine's schedule names now (``MicroBatchClock`` in
            ``profiler/scope.py``), the first part of every save's site; None (the default): the executor
            counts micro-batches itself (a forward save after a backward pass starts the next one).
    """

    policy: Policy | None = None
    op_clock: Callable[[], int] = _unknown_op_count
    observer: SwapObserver | None = None
    hide_own_ops: Callable[[], ContextManager[None]] = contextlib.nullcontext
    writes_reported: bool = False
    site_clock: Callable[[], str] = _unknown_site
    micro_batch: Callable[[], int | None] = _unnamed_micro_batch
    layer_clock: Callable[[], int] = _no_layer


_MATCH_FIGURES = {"matched_exact": "exact", "matched_fuzzy": "fuzzy", "unmatched": "unmatched",
                  "skipped_entries": "skipped"}  # SwapFigures name: the matcher's own (MatchCounts)


# The counts of ``SwapFigures`` the executor keeps itself (the matcher keeps those in _MATCH_FIGURES)
_FigureCounts = counting_twin(SwapFigures, _MATCH_FIGURES, "_FigureCounts", __name__)


@dataclasses.dataclass
class SwapCounters(_FigureCounts):
    """What the executor did during one iteration (after an out-of-memory retry: during the attempt
    that completed): every count of ``SwapFigures`` (declared there, once: the fields of ``_FigureCounts``,
    and ``matches``), and what only the runtime and the profiler read (the fields below)."""

    saved_bytes: list[int] = dataclasses.field(default_factory=list)  # every tensor autograd saved, in order
    saved_bytes_by_layer: dict[int, int] = dataclasses.field(default_factory=dict)  # ... summed per layer (-1: none)
    passive_swap_bytes: int = 0  # kept tensors swapped out synchronously under memory pressure
    matches: MatchCounts = dataclasses.field(default_factory=MatchCounts)
    prefetches_deferred: int = 0  # planned swap-ins that waited an op: they would have gone over the budget
    recomputed_storages: int = 0
    # (op count, "out" | "release" | "in", save ordinal) of each placed point the executor carried out, in
    # order: what the policy's simulator predicted, as it ran (NOTE [Placed swaps] in executor/schedule.py)
    placed: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)

    def figures(self) -> SwapFigures:
        """The counts an iteration report shows, frozen (the per-save lists stay here)."""
        return SwapFigures(**{
            field.name: getattr(self.matches, _MATCH_FIGURES[field.name]) if field.name in _MATCH_FIGURES
            else getattr(self, field.name) for field in dataclasses.fields(SwapFigures)
        })
