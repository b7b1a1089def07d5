"""``SwapFigures``: what the swap executor did during one iteration, declared once.

This is the one list of the executor's per-iteration counts. Everything else follows from its fields:
the executor counts in a mutable twin of it (``SwapCounters`` in ``executor/context.py``, built by
``counting_twin``), the iteration report reads every field through (``report.passive_swaps`` is
``report.swaps.passive_swaps``) and writes each one as a JSON key of the same name, and the policy
controller's ``IterationOutcome`` holds the same record. A new count is a new field here (and the code
that counts it in the executor); a field's default is the value of an iteration that did nothing.

It lives in ``trace/``, the shared vocabulary, because the executor makes it and the policy reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection


@dataclasses.dataclass(frozen=True)
class SwapFigures:
    """What the executor did during one iteration, as ``IterationReport.swaps`` (after an out-of-memory retry:
    during the attempt that completed). The names are the report's JSON keys (``IterationReport.to_dict``)."""

    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swapped_storages: int = 0  # storages copied out (views of one storage share one copy)
    prefetched: int = 0
    kept_on_device_bytes: int = 0  # swaps host_memory_budget refused: those tensors stayed on the device
    passive_swaps: int = 0  # kept tensors swapped out synchronously because the device ran out of memory
    pressure_waits: int = 0  # out-of-memory averted by waiting for in-flight swap-outs (their time is stall)
    matched_exact: int = 0
    matched_fuzzy: int = 0
    unmatched: int = 0  # saved storages a policy could not place confidently (kept on the device)
    on_demand_fetches: int = 0  # planned swap-ins that had not started when backward needed the tensor
    reused_original_bytes: int = 0  # restores that reused a still-alive device original (no copy, no new bytes)
    delayed_swap_outs: int = 0  # swap-outs the policy placed after the save, issued at their op
    late_swap_outs: int = 0  # ... whose op never came (the sequence moved): issued when backward began
    # (NOTE [Placed swaps] in executor/schedule.py)
    recomputed_bytes: int = 0  # saved storages rebuilt from their producer's inputs instead of swapped
    # (NOTE [Per-tensor recompute] in executor/recompute.py)
    recompute_unavailable: int = 0  # planned recomputes kept on the device (producer not found exactly)
    skipped_entries: int = 0  # policy entries whose tensor this iteration did not save (an idle expert)
    evicted_prefetches: int = 0  # prefetched swap-ins given back under memory pressure (fetched again on use)
    # (NOTE [Relief under pressure] in executor/pressure.py)


def counting_twin(figures: type, counted_elsewhere: Collection[str], name: str, module: str) -> type:
    """A mutable dataclass named ``name`` with the fields of the dataclass ``figures`` (``SwapFigures``: their
    types and defaults), less those in ``counted_elsewhere``: the base a counter class adds its own fields to,
    so that no figure is declared twice. ``module`` is the module the twin is said to belong to (its repr,
    pickling)."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default))
              for f in dataclasses.fields(figures) if f.name not in counted_elsewhere]
    twin = dataclasses.make_dataclass(name, fields)
    twin.__module__ = module
    twin.__doc__ = (f"``{figures.__name__}``' counts but {', '.join(sorted(counted_elsewhere)) or 'none'}, mutable "
                    "(``counting_twin``).")
    return twin
