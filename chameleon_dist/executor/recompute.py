"""Per-tensor recomputation: a saved tensor the policy marks RECOMPUTE leaves the device with no copy at all
and is rebuilt from its producer's inputs when backward needs it (NOTE [Per-tensor recompute]).

``ProducerLog`` remembers the last few forward ops (the op, its arguments and its outputs, every tensor held
weakly: the log never keeps memory alive) so that, when autograd saves a tensor the policy recomputes, its
producer is found by storage; a ``Recipe`` then holds what rebuilding it needs: the op, its non-tensor
arguments, and each tensor argument as a packed saved tensor of its own (kept, swapped or itself
recomputed), so that backward gets the inputs back the way it gets any saved tensor.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Any, Callable

import torch

from chameleon_dist.device.base import byte_view
from chameleon_dist.device.meter import storage_key
from chameleon_dist.executor.records import KeptParameter, keeps_itself
from chameleon_dist.trace.exactness import ReplayJudge
from chameleon_dist.trace.writes import WrittenTensors

logger = logging.getLogger(__name__)

# NOTE [Per-tensor recompute]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The generator marks a saved storage exactly recomputable when its producer replays bit for bit with the
# arguments it ran with (trace/exactness.py: aten, no random numbers, no atomics-based kernel, no
# uninitialised memory, nothing written in place), nothing wrote the storage after, and every input is a
# parameter or a storage that is still there (or restorable: saved for backward itself) when backward needs
# the output. The executor checks the same at run time, on what it sees then: the producer must be one of
# the last ``RING_OPS`` forward ops, must have created the storage (not a view or an in-place op on one of
# its inputs), must replay exactly with its recorded arguments (the same judge), and neither the storage
# nor any input may have been written since the producer ran: no logged op wrote it, and its version
# counter is where it was (a write the dispatch modes did not see, e.g. a kernel called with them off,
# still moves it). A tensor a custom autograd Function returned is never rebuilt from the aten op that
# allocated it: the Function's kernels may have written it outside the dispatcher. Such a kernel that
# writes an aten op's result without moving its version counter cannot be seen at all (README, "What a
# policy does").
# Its tensor inputs are packed like saved tensors (``KeptTensor`` or the
# ``SwappedTensor`` of the entry that swaps or recomputes their storage), so an input changed in place
# after the save raises as autograd would, and a swapped input comes back first. The rebuild runs the same
# aten op under ``no_grad`` with autocast off (the op was recorded after autocast chose its dtypes), and the
# result must have the original output's dtype, size, stride, offset and storage size: same op, same
# inputs, deterministic kernel, hence the same bytes. Anything else keeps the tensor on the device (counted)
# rather than guess; a rebuild that cannot happen raises, naming ``executor.allow_recompute``.

RING_OPS = 8
"""Forward ops the producer log remembers: autograd saves an op's output when a later op consumes it,
usually within a few ops (views and a weight transpose come between)."""


_NO_WRITES: frozenset[int] = frozenset()


class _Weak:
    """A tensor argument held weakly in the producer log, with where its bytes are: a temporary view (a
    weight's transpose, a reshape) dies right after the op while its storage lives on, held by a saved
    tensor or a parameter, so the recipe can re-view that storage."""

    __slots__ = ("ref", "key", "version", "dtype", "size", "stride", "offset", "holder")

    def __init__(self, tensor: torch.Tensor, holder: Any) -> None:
        self.ref = weakref.ref(tensor)
        self.key = storage_key(tensor.untyped_storage())
        self.version = tensor._version  # when the op ran: a later write moves it
        self.dtype, self.size, self.stride, self.offset = tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()
        self.holder = holder  # what else holds this storage, found while it is alive (a saved tensor, a parameter)

    def view_of(self, tensor: torch.Tensor, shift: int = 0) -> torch.Tensor:
        """This argument as a view of ``tensor``'s storage, ``shift`` elements on from where it was."""
        offset = self.offset + shift
        if (tensor.dtype == self.dtype and tensor.size() == self.size and tensor.stride() == self.stride
                and tensor.storage_offset() == offset):
            return tensor
        view = torch.empty(0, dtype=self.dtype, device=tensor.device)
        return view.set_(tensor.untyped_storage(), offset, self.size, self.stride)


def _weak(value: Any, holder_of: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return _Weak(value, holder_of(value))
    if type(value) is list or type(value) is tuple:  # (aten schemas nest at most one list deep)
        return type(value)(_Weak(v, holder_of(v)) if isinstance(v, torch.Tensor) else v for v in value)
    return value


class RecomputeUnavailable(RuntimeError):
    """A tensor planned for recomputation cannot be rebuilt exactly."""


class Recipe:
    """How to rebuild one storage: ``func(*args, **kwargs)[output_index]`` with packed tensor inputs."""

    __slots__ = ("func", "args", "kwargs", "output_index", "dtype", "size", "stride", "offset", "nbytes")

    def __init__(self, func, args, kwargs, output_index: int | None, output: "_Output") -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.output_index = output_index
        self.dtype, self.size, self.stride, self.offset = output.dtype, output.size, output.stride, output.offset
        self.nbytes = output.nbytes

    def run(self, unpack: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The rebuilt storage's bytes. ``unpack`` turns a packed input back into its tensor."""
        args = _materialize(self.args, unpack)
        kwargs = {k: _materialize(v, unpack) for k, v in self.kwargs.items()}
        with torch.no_grad(), torch._C._DisableAutocast():
            out = self.func(*args, **kwargs)
        if self.output_index is not None:
            out = out[self.output_index]
        if (not isinstance(out, torch.Tensor) or out.dtype != self.dtype or out.size() != self.size
                or out.stride() != self.stride or out.storage_offset() != self.offset
                or out.untyped_storage().nbytes() != self.nbytes):
            raise RecomputeUnavailable(
                f"recomputing {self.func} gave a tensor laid out unlike the one it replaces; set "
                "executor.allow_recompute: false to swap instead (and please report the op)"
            )
        return byte_view(out.untyped_storage())


def _materialize(value: Any, unpack: Callable[[Any], torch.Tensor]) -> Any:
    if type(value) is list or type(value) is tuple:
        return type(value)(_materialize(v, unpack) for v in value)
    if isinstance(value, _Packed):
        tensor = unpack(value.packed)
        if not isinstance(value.packed, KeptParameter):
            return value.weak.view_of(tensor)
        # a parameter, whose storage may have been swapped since (ZeRO-3 gathers it again for backward)
        kept = value.packed
        if tensor.size() != kept.size or tensor.stride() != kept.stride:
            raise RecomputeUnavailable(
                f"a parameter an op read in forward is laid out otherwise in backward ({list(kept.size)} "
                f"stride {kept.stride}, now {list(tensor.size())} stride {tensor.stride()}); set "
                "executor.allow_recompute: false to swap instead")
        return value.weak.view_of(tensor, tensor.storage_offset() - kept.offset)
    return value


class _Output:
    """A tensor result of a logged op, as it was: its storage and layout. The result object itself often
    dies right away (``mm`` inside ``matmul`` returns through ``_unsafe_view``) while its storage lives on."""

    __slots__ = ("key", "version", "dtype", "size", "stride", "offset", "nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.key, self.nbytes = storage_key(storage), storage.nbytes()
        self.version = tensor._version  # at its creation
        self.dtype, self.size, self.stride, self.offset = tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset()


class _Packed:
    """A tensor input of a recipe: packed like a saved tensor, and how to view it again."""

    __slots__ = ("packed", "weak")

    def __init__(self, packed: Any, weak: _Weak) -> None:
        self.packed = packed
        self.weak = weak


class ProducerLog:
    """The last ``RING_OPS`` forward ops, every tensor held weakly (see the module docstring), each with the
    storages it wrote in place."""

    def __init__(self, holder_of: Callable[[torch.Tensor], Any], size: int = RING_OPS) -> None:
        self._ops: collections.deque = collections.deque(maxlen=size)
        self._holder_of = holder_of  # a live tensor's storage -> what else holds it (None: nothing known)
        self._replays_exactly = ReplayJudge()
        self._written = WrittenTensors()

    def note(self, func, args, kwargs, out) -> None:
        outputs = out if type(out) is tuple or type(out) is list else (out,)
        holder_of = self._holder_of
        writes = self._written.of(func, args, kwargs)  # (pure ops: one dictionary lookup)
        written = frozenset(storage_key(t.untyped_storage()) for t in writes) if writes else _NO_WRITES
        self._ops.append((func, _weak(tuple(args), holder_of), {k: _weak(v, holder_of) for k, v in (kwargs or {}).items()},
                          tuple(_Output(o) if isinstance(o, torch.Tensor) else None for o in outputs),
                          type(out) is tuple or type(out) is list, written))

    def recipe_for(self, tensor: torch.Tensor, pack: Callable[[torch.Tensor], Any]) -> Recipe | None:
        """A recipe for ``tensor``'s storage from the op that created it, each tensor input packed with
        ``pack`` or, when the argument object died (a temporary view), taken from what held its storage when
        the op ran (a saved tensor's packed form, a parameter); None when that op is not in the log, would
        not replay exactly, the storage or an input was written since it ran, or an input can be found
        neither way (NOTE [Per-tensor recompute])."""
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        later_writes: set[int] = set()  # storages the ops after the one looked at wrote
        for func, args, kwargs, outputs, several, written in reversed(self._ops):
            index = next((i for i, o in enumerate(outputs) if o is not None and o.key == key), None)
            if index is None or outputs[index].nbytes != storage.nbytes():  # (another storage had the address)
                later_writes |= written
                continue
            output = outputs[index]
            weak_inputs = [w for v in (*args, *kwargs.values()) for w in _weak_items(v)]
            if any(w.key == key for w in weak_inputs):
                later_writes |= written
                continue  # a view of, or a write to, one of its inputs: the creator came earlier
            refusal = _refusal(func, args, kwargs, tensor, output, weak_inputs, later_writes, self._replays_exactly)
            if refusal is not None:
                logger.debug("not recomputing a %s from %s: %s", tuple(tensor.shape), func, refusal)
                return None
            packed_inputs = {}
            for w in weak_inputs:
                alive = w.ref()
                packed = pack(alive) if alive is not None else w.holder
                if packed is None:
                    return None  # an input is gone: cannot rebuild
                packed_inputs[id(w)] = _Packed(packed, w)
            return Recipe(func, _packed(args, packed_inputs), {k: _packed(v, packed_inputs) for k, v in kwargs.items()},
                          index if several else None, output)
        return None


def _packed(value: Any, packed_inputs: dict[int, _Packed]) -> Any:
    """``value`` with each weak tensor argument replaced by its packed form. (A module function, not a closure
    calling itself: that closure, its cell and the packed inputs would form a reference cycle holding device
    tensors until the garbage collector runs.)"""
    if isinstance(value, _Weak):
        return packed_inputs[id(value)]
    if type(value) is list or type(value) is tuple:
        return type(value)(_packed(v, packed_inputs) for v in value)
    return value


def _refusal(func, args, kwargs, tensor: torch.Tensor, output: _Output, weak_inputs: list[_Weak],
             later_writes: set[int], replays_exactly: ReplayJudge) -> str | None:
    """Why ``tensor``'s creator ``func`` cannot rebuild it (None: it can)."""
    if not replays_exactly(func, args, kwargs):
        return "it would not replay bit for bit (trace/exactness.py)"
    if isinstance(tensor.grad_fn, torch.autograd.function.BackwardCFunction):
        return "a custom autograd Function returned it (its kernels may have written it unseen)"
    if output.key in later_writes or tensor._version != output.version:
        return "it was written in place after its creation"
    for w in weak_inputs:
        alive = w.ref()
        if w.key in later_writes or (alive is not None and alive._version != w.version):
            return "an input was written in place after the op ran"
    return None


def _weak_items(value: Any) -> list[_Weak]:
    if isinstance(value, _Weak):
        return [value]
    if type(value) is list or type(value) is tuple:
        return [v for v in value if isinstance(v, _Weak)]
    return []


class StorageHolders:
    """What holds each storage besides the tensors the program has: the latest packed save of it (a kept
    record or a swapped one) and the protected parameters and buffers (a parameter as its ``KeptParameter``,
    with its offset as of the op). A recipe input whose own tensor
    object died (a temporary view) is found here while the op runs. Keyed by storage address and checked
    against the storage itself: addresses of dead storages get reused."""

    def __init__(self) -> None:
        self._saves: dict[int, tuple[weakref.ReferenceType, weakref.ReferenceType]] = {}
        self._parameters: dict[int, weakref.ReferenceType] = {}

    def next_attempt(self) -> "StorageHolders":
        """The holders of a new attempt: none of this one's saves, the same parameters."""
        holders = StorageHolders()
        holders._parameters = self._parameters  # (``set_parameters`` rebinds it, never changes it in place)
        return holders

    def set_parameters(self, tensors) -> None:
        """The protected parameters and buffers now."""
        self._parameters = {storage_key(t.untyped_storage()): weakref.ref(t) for t in tensors}

    def note(self, storage: torch.UntypedStorage, packed: Any) -> None:
        self._saves[storage_key(storage)] = (weakref.ref(storage), weakref.ref(packed))

    def holder_of(self, tensor: torch.Tensor) -> Any:
        """The packed save or the parameter that holds ``tensor``'s storage, or None."""
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        known = self._saves.get(key)
        if known is not None and known[0]() is storage:
            return known[1]()
        ref = self._parameters.get(key)
        parameter = ref() if ref is not None else None
        if parameter is None or parameter.untyped_storage() is not storage:
            return None  # (its storage was swapped: ZeRO-3 frees gathered weights, and the address is reused)
        return KeptParameter(parameter) if keeps_itself(parameter) else parameter
