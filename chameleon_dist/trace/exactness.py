"""Whether an op, run again on the same inputs, gives the same bytes and leaves the random state where it was:
the one judge of exactness for per-tensor recomputation (NOTE [Per-tensor recompute] in
executor/recompute.py). The policy asks it about the ops a trace recorded (the recorder judged each one with
its arguments), the executor about the op it is about to keep as a recipe.

Read from the op's schema and, where the answer depends on them, its arguments (the first rule that
applies decides):

- outside the ``aten`` namespace: refused. A custom op's kernel (Transformer Engine, apex, flash-attn,
  Triton), a collective (``_c10d_functional``: replayed on one rank, it waits for the others forever):
  nothing says they replay.
- a mutable schema (in place, ``out=``, a buffer written on the side and declared, as
  ``_native_batch_norm_legit``'s running stats): refused; the op changed state the replay would change again.
- refused by name: kernels that accumulate with atomics on a GPU, so the order of the additions (and the
  bits of the sum) changes from run to run (``ATOMICS``), kernels whose output is uninitialised memory
  that something else fills (``UNINITIALISED``), and ``rrelu_with_noise``.
- a ``Generator`` argument (bernoulli, normal, ``_fused_dropout``): refused, whatever its value (None
  means the default generator).
- tagged ``nondeterministic_bitwise``: refused.
- a ``dropout_p`` argument above zero: refused (the fused attention kernels draw their dropout mask
  inside; their backward kernels regenerate it). At zero they touch no generator.
- tagged ``nondeterministic_seeded`` (it draws from the default generator): exact only where its
  arguments say it draws nothing: ``train``/``training`` false; a ``dropout_p`` of zero (flash, efficient,
  cuDNN and CPU flash attention, sdpa's math path); a ``p`` of zero for the composite dropouts, which then
  return their input (``ZERO_P_DRAWS_NOTHING``; ``native_dropout`` draws even at p=0: refused unless
  ``train`` is false). ``p`` is read only on these ops: ``norm``'s or ``dist``'s ``p`` is an exponent.
- a write its schema does not declare (``UNDECLARED_STATE_WRITES`` in trace/state_writes.py: batch norm's
  running statistics, updated in place while training): refused where the arguments say it writes
  (``training`` true and a running statistic given) or are not known; exact otherwise, when the rules
  above let it.
- anything else: exact.

The rules about random numbers (a ``Generator`` argument, ``dropout_p``, ``nondeterministic_seeded`` with its
``train``/``p`` arguments) are ``draws_random_numbers``, and the undeclared writes ``writes_undeclared_state``:
the dispatch layer's ``retryable`` asks the same two (device/dispatch.py, NOTE [Relief inside the op]).
"""

from __future__ import annotations

import enum
import importlib
from typing import Any

from chameleon_dist.trace.state_writes import UNDECLARED_STATE_WRITES

def _torch() -> Any:
    """torch, imported on first use: the planner runs the policy generator on coarse traces whose op names
    are not torch ops, and must not pay torch's import (``chameleon-plan`` stays torch-free)."""
    return importlib.import_module("torch")


ATOMICS = frozenset({
    "bincount", "histc", "index_add", "index_copy", "index_reduce", "index_put", "_unsafe_index_put", "put",
    "scatter", "scatter_add", "scatter_reduce", "embedding_dense_backward", "embedding_backward",
    "_embedding_bag_backward", "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward",
    "kthvalue", "median", "nanmedian",
    "_flash_attention_backward", "_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_cudnn_attention_backward",
})
"""aten ops whose CUDA kernels add with atomics, or pick one of several writers to the same element
(``index_put``/``scatter``/``index_copy``/``put`` with repeated indices, which PyTorch documents as
nondeterministic even without ``accumulate``), or return tie-breaking indices in no fixed order
(``kthvalue``, ``median``). Refused whatever their arguments."""

UNINITIALISED = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "_empty_affine_quantized", "_empty_per_channel_affine_quantized",
})
"""aten ops whose output is uninitialised memory: the bytes that matter were written by whatever filled it
(``copy_``, an out= kernel, a kernel outside the dispatcher), never by this op."""

NOISE = frozenset({"rrelu_with_noise"})
"""Random (training) or written through its ``noise`` buffer; refused by name as well as by schema."""

ZERO_P_DRAWS_NOTHING = frozenset({"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})
"""Seeded ops whose ``p`` is a dropout probability and that return their input, drawing nothing, at p=0."""

_TRAIN_ARGUMENTS = ("train", "training")


class Replay(enum.Enum):
    """What the schema alone says about replaying an op."""

    EXACT = "exact"
    REFUSED = "refused"
    BY_ARGUMENTS = "by_arguments"  # depends on the values of its arguments (``replays_exactly``)


def schema_verdict(func: Any) -> Replay:
    """The verdict of the module docstring's rules that need no argument values."""
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "namespace", None) != "aten":
        return Replay.REFUSED
    if schema.is_mutable:
        return Replay.REFUSED
    name = getattr(func, "_opname", "")
    if name in ATOMICS or name in UNINITIALISED or name in NOISE:
        return Replay.REFUSED
    if _torch().Tag.nondeterministic_bitwise in getattr(func, "tags", ()):
        return Replay.REFUSED
    draws = _draw_verdict(func)
    if draws is Replay.REFUSED:
        return Replay.REFUSED
    return Replay.BY_ARGUMENTS if name in UNDECLARED_STATE_WRITES else draws


def replays_exactly(func: Any, args: tuple = (), kwargs: dict | None = None, verdict: Replay | None = None) -> bool:
    """Whether running ``func(*args, **kwargs)`` again gives the same bytes and draws no random numbers
    (``verdict``: ``schema_verdict(func)``, when the caller has it)."""
    verdict = schema_verdict(func) if verdict is None else verdict
    if verdict is not Replay.BY_ARGUMENTS:
        return verdict is Replay.EXACT
    values = _ArgumentValues(func._schema, args, kwargs or {})
    write = UNDECLARED_STATE_WRITES.get(func._opname)
    if write is not None and write.writes(values):
        return False
    return _draws_nothing(func, values)


def draws_random_numbers(func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether ``func(*args, **kwargs)`` draws from a random generator: a ``Generator`` argument; a
    ``dropout_p`` above zero (or not known to be zero); tagged ``nondeterministic_seeded`` unless ``train``/
    ``training`` is false, ``dropout_p`` is zero, or ``p`` is zero on ``ZERO_P_DRAWS_NOTHING`` (the module
    docstring's rules). Fused attention at ``dropout_p == 0`` draws nothing, whatever its tag says."""
    verdict = _draw_verdict(func)
    if verdict is not Replay.BY_ARGUMENTS:
        return verdict is Replay.REFUSED
    return not _draws_nothing(func, _ArgumentValues(func._schema, args, kwargs or {}))


def writes_undeclared_state(func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether ``func(*args, **kwargs)`` writes state its schema does not declare (NOTE [Undeclared state
    writes] in trace/state_writes.py): batch norm's running statistics while training."""
    write = UNDECLARED_STATE_WRITES.get(getattr(func, "_opname", ""))
    if write is None or getattr(func, "namespace", None) != "aten":
        return False
    return write.writes(_ArgumentValues(func._schema, args, kwargs or {}))


def undeclared_state_written(func: Any, args: tuple = (), kwargs: dict | None = None) -> list:
    """The tensors ``func(*args, **kwargs)`` writes although its schema does not say so (NOTE [Undeclared state
    writes] in trace/state_writes.py): batch norm's running statistics while training; [] for any other call."""
    write = UNDECLARED_STATE_WRITES.get(getattr(func, "_opname", ""))
    if write is None or getattr(func, "namespace", None) != "aten":
        return []
    values = _ArgumentValues(func._schema, args, kwargs or {})
    if not write.writes(values):
        return []
    torch = _torch()
    return [t for t in (values.get(name) if values.known(name) else None for name in write.written)
            if isinstance(t, torch.Tensor)]


def _draw_verdict(func: Any) -> Replay:
    """What the schema alone says about drawing random numbers: EXACT (never draws), REFUSED (draws, or
    nothing says it does not), BY_ARGUMENTS (``_draws_nothing`` decides)."""
    arguments = func._schema.arguments
    if any(_is_generator(a.type) for a in arguments):
        return Replay.REFUSED
    names = {a.name for a in arguments}
    if _torch().Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        if names & {"dropout_p", *_TRAIN_ARGUMENTS} or (func._opname in ZERO_P_DRAWS_NOTHING and "p" in names):
            return Replay.BY_ARGUMENTS
        return Replay.REFUSED
    return Replay.BY_ARGUMENTS if "dropout_p" in names else Replay.EXACT


def _draws_nothing(func: Any, values: "_ArgumentValues") -> bool:
    """The argument half of ``_draw_verdict``'s BY_ARGUMENTS (true also for an op that never draws)."""
    for train in _TRAIN_ARGUMENTS:
        if values.has(train) and values.get(train) is False:
            return True
    if values.has("dropout_p"):
        return _is_zero(values.get("dropout_p"))
    if _torch().Tag.nondeterministic_seeded not in func.tags:
        return True  # (a ``dropout_p`` is all that made it depend on its arguments)
    return func._opname in ZERO_P_DRAWS_NOTHING and values.has("p") and _is_zero(values.get("p"))


def op_named(name: str) -> Any | None:
    """The op overload ``name`` ("aten.gelu.default", as a trace writes it) stands for; None when it names none."""
    parts = name.split(".")
    if len(parts) != 3:
        return None
    namespace, op, overload = parts
    try:
        return getattr(getattr(getattr(_torch().ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None


def name_replays_exactly(name: str) -> bool:
    """For a trace that recorded no judgement of its ops' arguments: exact only when the schema alone says
    so (an op that depends on its arguments, or a name that resolves to no op, is refused)."""
    func = op_named(name)
    return func is not None and schema_verdict(func) is Replay.EXACT


class ReplayJudge:
    """``replays_exactly`` with the schema verdict cached per op in the instance (one per recorder or
    producer log): an op whose schema decides costs one dictionary lookup."""

    def __init__(self) -> None:
        self._verdicts: dict[Any, Replay] = {}

    def __call__(self, func: Any, args: tuple = (), kwargs: dict | None = None) -> bool:
        verdict = self._verdicts.get(func)
        if verdict is None:
            verdict = self._verdicts[func] = schema_verdict(func)
        if verdict is Replay.EXACT:
            return True
        if verdict is Replay.REFUSED:
            return False
        return replays_exactly(func, args, kwargs, verdict)


class _ArgumentValues:
    """An op's argument values by schema name: positional, keyword, else the schema's default."""

    __slots__ = ("_schema", "_args", "_kwargs", "_positions")

    def __init__(self, schema: Any, args: tuple, kwargs: dict) -> None:
        self._schema, self._args, self._kwargs = schema, args, kwargs
        self._positions = {a.name: i for i, a in enumerate(schema.arguments)}

    def has(self, name: str) -> bool:
        return name in self._positions

    def known(self, name: str) -> bool:
        """Whether the call gives ``name`` a value: passed, or defaulted by the schema."""
        position = self._positions.get(name)
        if position is None:
            return False
        return (position < len(self._args) or name in self._kwargs
                or self._schema.arguments[position].has_default_value())

    def get(self, name: str) -> Any:
        position = self._positions[name]
        if position < len(self._args):
            return self._args[position]
        if name in self._kwargs:
            return self._kwargs[name]
        return self._schema.arguments[position].default_value


def _is_generator(argument_type: Any) -> bool:
    """``Generator`` or ``Generator?`` (the schema's type objects print as "Generator", "Optional[Generator]")."""
    if isinstance(argument_type, _torch().OptionalType):
        argument_type = argument_type.getElementType()
    return str(argument_type) == "Generator"


def _is_zero(value: Any) -> bool:
    """A probability argument that is exactly zero (a Python number; a tensor or anything else: not known)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
