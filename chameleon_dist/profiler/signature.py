"""The lightweight profiler: every iteration's operator sequence as integers, and its comparison.

Every aten op name gets an integer id (``OpVocabulary``, one per runtime). ``SignatureMode`` appends the
id of each op run during the iteration, negated (``~id``) when the op cannot matter to swapping: ops
outside autograd (see ``TrainingScope``: validation passes under no_grad, optimizer steps, data
preparation). The executor's own ops are not recorded, and it adds the byte size of every tensor
autograd saves.

``compare`` classifies the difference from the reference sequence (``ChangeKind``). Among the ops that
matter it measures three things: the relative change of their number (``length_change``), the cosine
similarity of their *op-pair profiles* (how often each op follows each other op; an insertion or deletion
anywhere changes only the pairs at its two ends, so a skipped expert or an extra op barely moves it while
a different program does), and the relative change of the bytes saved for backward; when the ops or the bytes
moved by at least ``length_change``, also what is new (NOTE [A new code path]). Then:

- **changed** (a new program, re-planning follows): the profile cosine is below
  ``cosine_threshold``; or the ops or the saved bytes changed by at least ``length_change`` along a new code
  path (a layer that never saved in the reference saved, or at least ``NOVEL_PAIR_SHARE`` of the ops stand at
  op pairs the reference never had); or the number of ops *and* the saved bytes both changed by at least
  ``length_change``, the ops by at least ``ROUTING_SHARE`` of the bytes' change (more or less work on more
  or less data: an added branch, another micro-batch);
- **rescaled**: the saved bytes changed by at least ``length_change`` with the same ops (a sequence length
  or batch size change), or with the number of ops changed by less than ``ROUTING_SHARE`` of that (a new
  length under MoE routing: only the expert loop's ops move): the policy applies to the new sizes, and only
  a policy that stops holding makes the runtime profile again;
- **rerouted**: the number of ops changed by at least ``length_change`` with the same saved bytes (the
  same data split differently: experts that got no token did not run);
- **absorbed**: any smaller difference (an op, its order, an ``~op``, a saved size);
- **identical**.

``Comparison.major`` is the older name of ``changed``.

NOTE [A new code path]
~~~~~~~~~~~~~~~~~~~~~~
Counts alone cannot tell routing variance from a new program: an MoE batch of another length routed otherwise
moves a few percent of the ops and a third of the saved bytes, and a branch that switches on an extra, wider
block moves a tenth of the ops and a fifth of the bytes; both fall under ``ROUTING_SHARE``. What tells them apart
is whether anything is *new*. Routing variance is the same code: the expert loop runs more or fewer times, on
other sizes, so it only changes the counts of op pairs the reference already has (a skipped expert's seam pairs
one expert's end with the next one's start, a pair the loop already had), at layers that already saved. A new
code path brings ops at sites or in an order the program never had:

- a layer (``LayerClock``: ``layers.<i>`` and its kin) that saved tensors for backward and never did in the
  reference (``Signature.saved_layers``, the executor's ``saved_bytes_by_layer``): more layers of the same kind;
- op pairs the reference never had, for at least ``NOVEL_PAIR_SHARE`` (1%) of the iteration's autograd ops
  (``novel_pair_share``): blocks of another kind, wherever they run.

Either makes a difference of at least ``length_change`` in ops or saved bytes ``changed``. A smaller difference
stays ``absorbed`` whatever is new (one extra op changes two pairs: its save stays on the device, every other
save keeps its entry). Not seen: a block of a kind the program already runs, run again inside a layer that
already saves (a loop over the same module one more time): the routing rule decides it, as before. ``changed``
can cost a profiling round on a program that only looks new; ``rescaled`` on a new program costs the budget
(the policy never covered the new saves) until it stops holding, and only then a profiling round.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Iterable, Protocol

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


class OpListener(Protocol):
    """Hears the op clock: ``on_op(n)`` once ``n`` ops of the iteration have run, when ``n >= due_op``
    (the swap executor's placed swap-outs, releases and swap-ins; NOTE [Placed swaps] in
    executor/schedule.py). The comparison is all an op with nothing due costs. While ``captures_producers``,
    it also hears every op with its arguments and result (the producers of tensors a policy recomputes)."""

    due_op: int
    captures_producers: bool  # hear every op with its arguments and result (``on_produced``)

    def on_op(self, op_count: int) -> None: ...

    def on_produced(self, func, args, kwargs, out) -> None: ...


class SignatureMode(TorchDispatchMode):
    """Records the op-id sequence of one iteration (a few list appends per op) and drives the op clock
    of ``listener``."""

    def __init__(
        self,
        vocabulary: OpVocabulary,
        scope: TrainingScope | None = None,
        ids: list[int] | None = None,
        on_write: Callable[[list[torch.Tensor]], None] | None = None,
        listener: OpListener | None = None,
    ) -> None:
        super().__init__()
        self.ids: list[int] = [] if ids is None else ids
        self._id_of = vocabulary.id_of
        self._scope = scope if scope is not None else TrainingScope()
        self.on_write = on_write  # hears of every tensor an op writes in place (see trace.writes)
        self.listener = listener
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
                ids = self.ids
                ids.append(op_id if scope.in_autograd() else ~op_id)
                listener = self.listener
                if listener is not None:
                    out = func(*args, **(kwargs or {}))
                    if listener.captures_producers:
                        listener.on_produced(func, args, kwargs, out)
                    if len(ids) >= listener.due_op:
                        listener.on_op(len(ids))
                    return out
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class Signature:
    """One iteration's sequence: all op ids (``~id`` for ops outside autograd), saved-tensor bytes, and the
    transformer layers that saved (``LayerClock``: -1 outside any; empty when nobody counted them)."""

    ids: torch.Tensor  # int64
    saved_bytes: tuple[int, ...]
    saved_layers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, ids: list[int], saved_bytes: list[int] | tuple[int, ...] = (),
           saved_layers: Iterable[int] = ()) -> "Signature":
        return cls(torch.tensor(ids, dtype=torch.int64), tuple(saved_bytes), frozenset(saved_layers))

    @property
    def num_ops(self) -> int:
        return int(self.ids.numel())

    def relevant(self) -> torch.Tensor:
        """Ids of the ops that can matter to swapping (inside autograd)."""
        return self.ids[self.ids >= 0]


class ChangeKind(enum.StrEnum):
    """How an iteration's sequence differs from the reference (see the module docstring)."""

    IDENTICAL = "identical"
    ABSORBED = "absorbed"  # a small difference the policy absorbs
    REROUTED = "rerouted"  # other ops, the same data: e.g. experts that got no token skipped
    RESCALED = "rescaled"  # the same ops on other sizes: a sequence length or batch size change
    CHANGED = "changed"  # a new program: a new policy is needed


@dataclasses.dataclass(frozen=True)
class Comparison:
    num_ops: int
    reference_num_ops: int
    length_change: float  # relative, among the ops inside autograd
    cosine: float  # of the op-pair profiles of the ops inside autograd
    saved_bytes_change: float  # relative
    differs: bool  # any difference at all (ops, their order, ~ops, or saved sizes): reported only
    changed: bool  # a new program: a new policy is needed
    reason: str
    kind: ChangeKind = ChangeKind.IDENTICAL
    novel_pair_share: float = 0.0  # share of the autograd ops at op pairs the reference never had (NOTE [A new code path])
    novel_layers: tuple[int, ...] = ()  # layers that saved tensors and never did in the reference

    @property
    def major(self) -> bool:
        """The older name of ``changed``."""
        return self.changed


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two integer sequences, the shorter one zero-padded to the longer one's length (the
    paper's positional test; ``compare`` uses ``pair_profile_cosine``)."""
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


def _pairs(ids: torch.Tensor, base: int) -> torch.Tensor:
    """Each op's pair with the op before it (the first op pairs with a start marker), as one integer."""
    previous = torch.cat([torch.full((1,), base - 1, dtype=torch.int64), ids[:-1]]) if ids.numel() else ids
    return previous * base + ids


def pair_profile_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of how often each op follows each other op in ``a`` and in ``b``. Inserting or
    deleting k ops anywhere changes at most k + 1 pairs; repeating a stretch (another expert, another
    layer of the same kind) scales counts that are already there."""
    if a.numel() == 0 and b.numel() == 0:
        return 1.0
    if a.numel() == 0 or b.numel() == 0:
        return 0.0
    base = int(max(a.max(), b.max())) + 2  # (+1 for the start marker)
    pairs, inverse = torch.unique(torch.cat([_pairs(a, base), _pairs(b, base)]), return_inverse=True)
    x = torch.bincount(inverse[: a.numel()], minlength=pairs.numel()).to(torch.float64)
    y = torch.bincount(inverse[a.numel():], minlength=pairs.numel()).to(torch.float64)
    return float(x @ y) / float(x.norm() * y.norm())


def novel_pair_share(a: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of the ops of ``a`` whose pair with the op before it (``_pairs``) never occurs in ``reference``
    (NOTE [A new code path])."""
    if a.numel() == 0:
        return 0.0
    if reference.numel() == 0:
        return 1.0
    base = int(max(a.max(), reference.max())) + 2
    novel = ~torch.isin(_pairs(a, base), _pairs(reference, base))
    return float(novel.sum()) / a.numel()


NOVEL_PAIR_SHARE = 0.01
"""A difference at least ``length_change`` in ops or saved bytes is a new code path (``changed``) when at least
this share of the iteration's autograd ops stand at op pairs the reference never had (NOTE [A new code path])."""

ROUTING_SHARE = 0.5
"""When the number of ops and the saved bytes both changed by at least ``length_change`` but the ops by less
than this share of the bytes' change, the iteration is ``rescaled``, not ``changed``: more work on more data
(another micro-batch, an added branch) moves both alike, while a new sequence length under MoE routing moves
the bytes and only the expert loop's ops (issue 27)."""


def _relative(new: float, old: float) -> float:
    if old == 0:
        return 0.0 if new == 0 else 1.0
    return abs(new - old) / old


def compare(current: Signature, reference: Signature | None, length_change: float, cosine_threshold: float) -> Comparison:
    if reference is None:
        return Comparison(current.num_ops, 0, 0.0, 1.0, 0.0, False, False, "no reference sequence yet")
    relevant, reference_relevant = current.relevant(), reference.relevant()
    length = _relative(relevant.numel(), reference_relevant.numel())
    same_ops = torch.equal(relevant, reference_relevant)
    cosine = 1.0 if same_ops else pair_profile_cosine(relevant, reference_relevant)
    saved = _relative(sum(current.saved_bytes), sum(reference.saved_bytes))
    differs = not (torch.equal(current.ids, reference.ids) and current.saved_bytes == reference.saved_bytes)
    more_ops, more_bytes = length >= length_change, saved >= length_change
    measured = f"ops {length:.1%}, op-pair cosine {cosine:.3f}, saved bytes {saved:.1%}"
    novel_share, novel_layers = 0.0, ()
    if (more_ops or more_bytes) and cosine >= cosine_threshold:  # (only a difference that large can be a new path)
        novel_share = 0.0 if same_ops else novel_pair_share(relevant, reference_relevant)
        if current.saved_layers and reference.saved_layers:
            novel_layers = tuple(sorted(current.saved_layers - reference.saved_layers))
    if cosine < cosine_threshold:
        kind = ChangeKind.CHANGED
        reason = f"op-pair cosine {cosine:.3f} < profiler.cosine_threshold {cosine_threshold} ({measured})"
    elif more_ops and more_bytes and length >= ROUTING_SHARE * saved:
        kind = ChangeKind.CHANGED
        reason = (f"the number of ops ({length:.1%}) and the bytes saved for backward ({saved:.1%}) both changed "
                  f"by at least profiler.length_change {length_change:.0%}")
    elif novel_layers:
        kind = ChangeKind.CHANGED
        reason = (f"a new code path: layers {list(novel_layers)} saved tensors for backward and never did in the "
                  f"reference, with a difference of at least profiler.length_change {length_change:.0%} ({measured})")
    elif novel_share >= NOVEL_PAIR_SHARE:
        kind = ChangeKind.CHANGED
        reason = (f"a new code path: {novel_share:.1%} of the ops follow each other in ways the reference never had "
                  f"(at least NOVEL_PAIR_SHARE {NOVEL_PAIR_SHARE:.0%}), with a difference of at least "
                  f"profiler.length_change {length_change:.0%} ({measured})")
    elif more_ops and more_bytes:
        kind = ChangeKind.RESCALED
        reason = (f"other sizes, rerouted: bytes saved for backward changed by {saved:.1%}, the number of ops by "
                  f"only {length:.1%} (routing and shape, not more work)")
    elif more_bytes:
        kind, reason = ChangeKind.RESCALED, f"same ops on other sizes: bytes saved for backward changed by {saved:.1%}"
    elif more_ops:
        kind, reason = ChangeKind.REROUTED, f"other ops on the same data: the number of ops changed by {length:.1%}"
    elif differs:
        kind, reason = ChangeKind.ABSORBED, f"minor difference absorbed ({measured})"
    else:
        kind, reason = ChangeKind.IDENTICAL, "identical"
    changed = kind == ChangeKind.CHANGED
    return Comparison(current.num_ops, reference.num_ops, length, cosine, saved, differs, changed, reason, kind,
                      novel_share, novel_layers)
