"""The memory reduction list and the swap candidates of a ``StepTrace``, scored with the paper's Eq. 2.

Reduction list: every op whose no-swap live bytes exceed the budget, with the bytes to remove there.

Candidates are storages that autograd saved in forward and that backward reads again, with an off-device
window between their last forward use and their first backward use. Never candidates: parameters (and
views of them), storages that existed before the iteration (gradients, optimizer state, framework
buffers), storages created outside the forward pass, storages smaller than ``min_swap_bytes``, and
storages whose window covers no op of the reduction list.

Eq. 2: ``score = norm(coverage) + C * norm(size ** (1/3))`` with ``norm`` dividing by the largest value
among the candidates; coverage counts the reduction-list ops inside the window.
"""

from __future__ import annotations

import bisect
import dataclasses

from chameleon_dist.trace.exactness import Replay, name_replays_exactly, op_named, schema_verdict
from chameleon_dist.trace.step_trace import BACKWARD, FORWARD, StepTrace

@dataclasses.dataclass(frozen=True, slots=True)
class Reduction:
    op_index: int
    excess_bytes: int


@dataclasses.dataclass(slots=True)
class Candidate:
    """A saved storage that could leave the device between ``last_forward_use`` and ``first_backward_use``."""

    storage_id: int
    nbytes: int
    created_at: int
    last_forward_use: int  # op index (or, when the profiled run showed it lived on, its death - 1)
    first_backward_use: int  # op index
    save_tensor_id: int  # the first tensor (view) of this storage that autograd saved
    save_op_index: int  # ops recorded when it was saved (the saving op is save_op_index - 1)
    coverage: int = 0
    score: float = 0.0
    recompute_exact: bool = False  # see ``_mark_exact_recompute``
    recompute_inputs: tuple[int, ...] = ()  # storage ids of the producer's non-parameter inputs

    @property
    def window(self) -> tuple[int, int]:
        return self.last_forward_use, self.first_backward_use


def reduction_list(curve: list[int], budget_bytes: int) -> list[Reduction]:
    return [Reduction(i, live - budget_bytes) for i, live in enumerate(curve) if live > budget_bytes]


def find_candidates(trace: StepTrace, min_swap_bytes: int = 0, judge_recompute: bool = True) -> list[Candidate]:
    """Every swappable saved storage with its window (unscored; see :func:`score_candidates`). Without
    ``judge_recompute`` no candidate is marked exact for recomputation (a swap-only caller: the planner)."""
    tensors, storages, ops = trace.tensors, trace.storages, trace.ops
    first_save: dict[int, tuple[int, int]] = {}
    saves = trace.saves or [(t.tensor_id, -1) for t in tensors if t.saved]
    for tensor_id, op_index in saves:
        first_save.setdefault(tensors[tensor_id].storage_id, (tensor_id, op_index))
    last_fwd: dict[int, int] = {}
    first_bwd: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.phase == FORWARD:
            for t in op.inputs:
                last_fwd[tensors[t].storage_id] = i
            for t in op.outputs:
                last_fwd[tensors[t].storage_id] = i
        elif op.phase == BACKWARD:
            for t in op.inputs:
                first_bwd.setdefault(tensors[t].storage_id, i)
    swapped = {swap.storage_id for swap in trace.swaps}
    found = []
    for storage_id, (tensor_id, save_op) in first_save.items():
        storage = storages[storage_id]
        if storage.is_parameter or storage.created_at < 0 or storage.nbytes < max(1, min_swap_bytes):
            continue
        if ops[storage.created_at].phase != FORWARD:
            continue
        last, first = last_fwd.get(storage_id), first_bwd.get(storage_id)
        if last is None or first is None or first <= last + 1:
            continue
        if 0 <= storage.freed_at <= first and storage_id not in swapped:
            continue  # (a storage swapped in the profiled run died at its release, not after its use)
        if storage_id in swapped and storage.freed_at > last + 1:
            # swapped in the profiled run, its device block died only at ``freed_at``: the program (a
            # residual, a module attribute) held it after its last use. It cannot be released earlier.
            last = min(storage.freed_at - 1, first - 1)
        found.append(
            Candidate(storage_id, storage.nbytes, storage.created_at, last, first, tensor_id,
                      save_op if save_op >= 0 else storage.created_at + 1)
        )
    found.sort(key=lambda c: c.created_at)
    if judge_recompute:
        _mark_exact_recompute(trace, found)
    return found


def _mark_exact_recompute(trace: StepTrace, candidates: list[Candidate]) -> None:
    """Recompute is exact (NOTE [Per-tensor recompute] in executor/recompute.py) when the producer op
    replays bit for bit with the arguments it ran with (``op_replays_exactly``), the storage is one of its
    outputs and was not written after, and every input is a parameter, a storage alive until the
    candidate's first backward use, or a saved storage (a candidate itself) that backward needs no earlier:
    one the executor brings back, kept, swapped or recomputed, when it rebuilds this one."""
    by_storage = {c.storage_id: c for c in candidates}
    written = set()  # storages some op modified in place (recomputing their producer would miss that)
    for op in trace.ops:
        if _writes(trace.op_names[op.name_id]):
            written.update(trace.tensors[t].storage_id for t in op.outputs)
    inexact = None if trace.inexact_ops is None else frozenset(trace.inexact_ops)
    for c in candidates:
        op = trace.ops[c.created_at]
        if not op_replays_exactly(trace, c.created_at, inexact) or c.storage_id in written:
            continue
        if c.storage_id not in {trace.tensors[t].storage_id for t in op.outputs}:
            continue
        inputs, ok = [], bool(op.inputs)
        for t in op.inputs:
            storage_id = trace.tensors[t].storage_id
            storage = trace.storages[storage_id]
            if storage.is_parameter:
                continue
            saved = by_storage.get(storage_id)
            alive = storage.freed_at < 0 or storage.freed_at > c.first_backward_use
            restorable = saved is not None and saved.first_backward_use >= c.first_backward_use
            if storage_id == c.storage_id or storage_id in written or not (alive or restorable):
                ok = False
                break
            inputs.append(storage_id)
        c.recompute_exact = ok
        c.recompute_inputs = tuple(dict.fromkeys(inputs))


def op_replays_exactly(trace: StepTrace, op_index: int, inexact: frozenset[int] | None = None) -> bool:
    """Whether the trace's op ``op_index`` would give the same bytes run again (trace/exactness.py): as the
    recorder judged it with its arguments (``trace.inexact_ops``; ``inexact``: the same as a set), and
    refused in any case when its schema alone refuses it; a trace that recorded no judgement is judged by
    the op's schema alone (an op whose verdict depends on its arguments is refused then)."""
    name = trace.op_names[trace.ops[op_index].name_id]
    if trace.inexact_ops is None:
        return name_replays_exactly(name)
    if inexact is None:
        inexact = frozenset(trace.inexact_ops)
    func = op_named(name)
    return func is not None and schema_verdict(func) is not Replay.REFUSED and op_index not in inexact


def _writes(op_name: str) -> bool:
    """The op writes in place: its schema is mutable (an in-place op, ``out=``); by its name ("add_",
    ".out") when the name resolves to no op."""
    func = op_named(op_name)
    if func is not None:
        return func._schema.is_mutable
    parts = op_name.split(".")
    base = parts[1] if len(parts) > 1 else parts[0]
    return base.endswith("_") or (len(parts) > 2 and parts[2] == "out")


def score_candidates(candidates: list[Candidate], reductions: list[Reduction], size_weight: float) -> list[Candidate]:
    """Eq. 2 scores; returns the candidates that cover any reduction op, best first (ties: earlier first)."""
    points = [r.op_index for r in reductions]
    for c in candidates:
        lo, hi = c.window
        c.coverage = bisect.bisect_left(points, hi) - bisect.bisect_right(points, lo)
    useful = [c for c in candidates if c.coverage > 0]
    if not useful:
        return []
    max_cover = max(c.coverage for c in useful)
    max_size = max(c.nbytes for c in useful) ** (1 / 3)
    for c in useful:
        c.score = c.coverage / max_cover + size_weight * (c.nbytes ** (1 / 3)) / max_size
    useful.sort(key=lambda c: (-c.score, c.created_at))
    return useful
