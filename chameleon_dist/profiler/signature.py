"""The lightweight profiler: every iteration's operator sequence as integers, and its comparison.

Every aten op name gets an integer id (``OpVocabulary``, one per runtime). ``SignatureMode`` appends the
id of each op run during the iteration, negated (``~id``) when the op cannot matter to swapping: ops
outside autograd (see ``TrainingScope``: validation passes under no_grad, optimizer steps, data
preparation). The executor's own ops are not recorded, and it adds the byte size of every tensor
autograd saves.

``compare`` says whether the sequence ``differs`` at all (any op, its order, an ``~op`` or a saved size:
reported only) and whether it ``changed`` in the paper's sense, the test that can trigger re-planning:
among the ops that matter, the length differs by at least ``length_change`` or the cosine similarity of
the id sequences (zero-padded to one length) is below ``cosine_threshold``, or the bytes saved for
backward differ by at least ``length_change``. ``major`` is the older name of ``changed``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.profiler.scope import TrainingScope
from chameleon_dist.trace.writes import WrittenTensors


class OpVocabulary:
    """Aten op -> small integer id, in order of first appearance. Profiler markers (``record_function``
    enter/exit, e.g. around ``Optimizer.step``) are not computation: their id is None."""

    def __init__(self) -> None:
        self._ids: dict[object, int | None] = {}
        self.names: list[str] = []

    def id_of(self, func) -> int | None:
        try:
            return self._ids[func]
        except KeyError:
            pass
        if getattr(func, "namespace", None) == "profiler":
            op_id = self._ids[func] = None
        else:
            op_id = self._ids[func] = len(self.names)
            self.names.append(str(func))
        return op_id

    def __len__(self) -> int:
        return len(self.names)


class SignatureMode(TorchDispatchMode):
    """Records the op-id sequence of one iteration (a few list appends per op)."""

    def __init__(
        self,
        vocabulary: OpVocabulary,
        scope: TrainingScope | None = None,
        ids: list[int] | None = None,
        on_write: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        super().__init__()
        self.ids: list[int] = [] if ids is None else ids
        self._id_of = vocabulary.id_of
        self._scope = scope if scope is not None else TrainingScope()
        self.on_write = on_write  # hears of every tensor an op writes in place (see trace.writes)
        self._written = WrittenTensors()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on_write is not None:
            written = self._written.of(func, args, kwargs)
            if written:
                self.on_write(written)
        scope = self._scope
        if not scope.paused:
            op_id = self._id_of(func)
            if op_id is not None:
                self.ids.append(op_id if scope.in_autograd() else ~op_id)
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class Signature:
    """One iteration's sequence: all op ids (``~id`` for ops outside autograd) and saved-tensor bytes."""

    ids: torch.Tensor  # int64
    saved_bytes: tuple[int, ...]

    @classmethod
    def of(cls, ids: list[int], saved_bytes: list[int] | tuple[int, ...] = ()) -> "Signature":
        return cls(torch.tensor(ids, dtype=torch.int64), tuple(saved_bytes))

    @property
    def num_ops(self) -> int:
        return int(self.ids.numel())

    def relevant(self) -> torch.Tensor:
        """Ids of the ops that can matter to swapping (inside autograd)."""
        return self.ids[self.ids >= 0]


@dataclasses.dataclass(frozen=True)
class Comparison:
    num_ops: int
    reference_num_ops: int
    length_change: float  # relative, among the ops inside autograd
    cosine: float
    saved_bytes_change: float  # relative
    differs: bool  # any difference at all (ops, their order, ~ops, or saved sizes): reported only
    changed: bool  # the paper's test failed (length, cosine or saved bytes): a new policy is needed
    reason: str

    @property
    def major(self) -> bool:
        """The older name of ``changed``."""
        return self.changed


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two integer sequences, the shorter one zero-padded to the longer one's length."""
    n = max(a.numel(), b.numel())
    if n == 0:
        return 1.0
    x = torch.zeros(n, dtype=torch.float64)
    y = torch.zeros(n, dtype=torch.float64)
    # ids start at 0: shift by one so that the first op name still counts
    x[: a.numel()] = a.to(torch.float64) + 1
    y[: b.numel()] = b.to(torch.float64) + 1
    denominator = float(x.norm() * y.norm())
    return float(x @ y) / denominator if denominator else 1.0


def _relative(new: float, old: float) -> float:
    if old == 0:
        return 0.0 if new == 0 else 1.0
    return abs(new - old) / old


def compare(current: Signature, reference: Signature | None, length_change: float, cosine_threshold: float) -> Comparison:
    if reference is None:
        return Comparison(current.num_ops, 0, 0.0, 1.0, 0.0, False, False, "no reference sequence yet")
    relevant, reference_relevant = current.relevant(), reference.relevant()
    length = _relative(relevant.numel(), reference_relevant.numel())
    cosine = cosine_similarity(relevant, reference_relevant)
    saved = _relative(sum(current.saved_bytes), sum(reference.saved_bytes))
    differs = not (torch.equal(current.ids, reference.ids) and current.saved_bytes == reference.saved_bytes)
    reasons = []
    if length >= length_change:
        reasons.append(f"length changed by {length:.1%} (profiler.length_change {length_change:.0%})")
    if cosine < cosine_threshold:
        reasons.append(f"cosine similarity {cosine:.3f} < profiler.cosine_threshold {cosine_threshold}")
    if saved >= length_change:
        reasons.append(f"bytes saved for backward changed by {saved:.1%}")
    if reasons:
        reason = "; ".join(reasons)
    elif differs:
        reason = f"minor difference absorbed (length {length:.1%}, cosine {cosine:.3f}, saved bytes {saved:.1%})"
    else:
        reason = "identical"
    return Comparison(current.num_ops, reference.num_ops, length, cosine, saved, differs, bool(reasons), reason)
