"""The detailed profiler: a ``StepTrace`` of one iteration (used only in profiling iterations).

A dispatch mode records, per op, its name id, the tensors it read and wrote (as per-iteration tensor and
storage ids), the phase and micro-batch, the innermost module and layer, and the live device bytes after
it. Storages are followed from creation to death with ``weakref.finalize``. The swap executor reports
its swaps (``on_swap_out`` / ``on_swap_in``) and autograd's saved tensors (``on_saved``), so the no-swap
memory curve can be rebuilt. The work per op is kept small: tuples and dict lookups, no formatting.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from chameleon_dist.device.base import DeviceTimer, HostTimer
from chameleon_dist.profiler.scope import LayerTimes, MicroBatchClock, TrainingScope, is_layer_path, layer_of
from chameleon_dist.profiler.signature import OpListener, OpVocabulary
from chameleon_dist.trace.exactness import ReplayJudge
from chameleon_dist.trace.writes import WrittenTensors
from chameleon_dist.trace.step_trace import (
    BACKWARD,
    FORWARD,
    OPTIMIZER,
    OTHER,
    OpRecord,
    StepTrace,
    StorageRecord,
    SwapRecord,
    TensorRecord,
)

@dataclasses.dataclass(eq=False)
class RecordedAttempt:
    """What a ``TraceRecorder`` recorded in one attempt at the iteration: an out-of-memory retry starts a new
    one (``TraceRecorder.new_attempt``), so nothing of the failed attempt is cleared field by field."""

    start_mark: Any  # the device timer's mark at the attempt's start (the trace's T_iter is device time)
    swap_base: int = 0  # swap indices handed out before this attempt (stale in it)
    ops: list[tuple] = dataclasses.field(default_factory=list)  # OpRecord fields as plain tuples (see ``finish``)
    tensors: list[TensorRecord] = dataclasses.field(default_factory=list)
    storages: list[StorageRecord] = dataclasses.field(default_factory=list)
    swaps: list[SwapRecord] = dataclasses.field(default_factory=list)
    saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    save_sites: list[str] = dataclasses.field(default_factory=list)
    inexact_ops: list[int] = dataclasses.field(default_factory=list)  # forward ops that would not replay bit for bit
    tensor_ids: dict[tuple, int] = dataclasses.field(default_factory=dict)
    # storage address -> (storage id, weak reference): an address is reused once its storage died, and
    # storages from before the iteration are not followed to their death, so identity is checked
    storage_ids: dict[int, tuple[int, weakref.ReferenceType]] = dataclasses.field(default_factory=dict)
    watched: dict[int, tuple[int, int, weakref.ReferenceType]] = dataclasses.field(default_factory=dict)  # id(ref) ->
    module_stack: list[int] = dataclasses.field(default_factory=list)  # the modules entered, innermost last
    micro_batch: int = 0
    last_phase: str = FORWARD


@dataclasses.dataclass(eq=False)
class WatchedModules:
    """The submodules a ``TraceRecorder`` watches (``watch_modules``): by module id, each one's path and layer,
    and the handles of its hooks (removed by ``finish``). Kept across attempts."""

    paths: list[str] = dataclasses.field(default_factory=list)
    layers: list[int] = dataclasses.field(default_factory=list)  # ``layer_of`` each path
    handles: list = dataclasses.field(default_factory=list)


class TraceRecorder(TorchDispatchMode):
    """Records one iteration. Enter it (after the device's metering) around the iteration; ``finish``
    returns the ``StepTrace``. ``timer`` (the device's ``timer()``; default: the host clock) times the
    layers: on a GPU it must be the device's, since host clocks in hooks measure kernel launches."""

    def __init__(
        self,
        vocabulary: OpVocabulary,
        live_bytes: Callable[[], int],
        parameter_storage_keys: set[int],
        iteration: int,
        emulated: bool,
        scope: TrainingScope | None = None,
        timer: DeviceTimer | None = None,
        micro_batches: MicroBatchClock | None = None,
        signature_ids: list[int] | None = None,
        on_write: Callable[[list[torch.Tensor]], None] | None = None,
        listener: OpListener | None = None,
    ) -> None:
        super().__init__()
        self._micro_batches = micro_batches if micro_batches is not None else MicroBatchClock()
        self._scope = scope if scope is not None else TrainingScope()
        self._id_of = vocabulary.id_of
        self._vocabulary = vocabulary
        self._live_bytes = live_bytes
        self._parameter_keys = parameter_storage_keys
        self.iteration = iteration
        self.emulated = emulated
        self._replays_exactly = ReplayJudge()
        self._modules = WatchedModules()
        self.on_write = on_write  # hears of in-place writes
        self.listener = listener  # hears the op clock (see signature.OpListener)
        self._written = WrittenTensors()
        self.layer_times = LayerTimes(timer if timer is not None else HostTimer())
        self._attempt = RecordedAttempt(start_mark=self.layer_times.timer.mark())
        self._start_live_bytes = live_bytes()
        self._finished = False
        self.signature_ids = signature_ids  # when given, the signature is taken here too (one mode)

    def new_attempt(self) -> None:
        """An out-of-memory retry starts the iteration over: forget what the failed attempt recorded (ops,
        tensors, storages, saves, swaps, layer times, the module stack its error left half-entered, the
        micro-batch count) and restart the clock, so the trace describes only the attempt that completes.
        Kept: the module hooks and paths, the parameter keys, and the live bytes at the iteration's start
        (a retry starts from the iteration's starting state). The failed attempt's storages that are still
        alive lose their death callbacks, and swap indices handed out before now are ignored, so nothing
        of the failed attempt can write into the new records. The signature list is the caller's to clear
        (the profiler shares it with ``SignatureMode``)."""
        failed = self._attempt
        failed.watched.clear()  # the weak references (and with them their death callbacks) go
        self.layer_times.reset()
        self._attempt = RecordedAttempt(start_mark=self.layer_times.timer.mark(),
                                        swap_base=failed.swap_base + len(failed.swaps))

    module_paths = property(lambda self: self._modules.paths, doc="Each watched module's path, by module id.")
    # the records of the current attempt, by their names of old
    ops = property(lambda self: self._attempt.ops, doc="The attempt's ops (OpRecord fields as tuples until finish).")
    tensors = property(lambda self: self._attempt.tensors, doc="The attempt's tensors.")
    storages = property(lambda self: self._attempt.storages, doc="The attempt's storages.")
    swaps = property(lambda self: self._attempt.swaps, doc="The attempt's swaps.")
    saves = property(lambda self: self._attempt.saves, doc="The attempt's saves: (tensor id, op index).")
    save_sites = property(lambda self: self._attempt.save_sites, doc="Each save's site, as the executor names it.")
    inexact_ops = property(lambda self: self._attempt.inexact_ops, doc="Forward ops that would not replay exactly.")

    # ---- modules ----------------------------------------------------------------------------
    def watch_modules(self, model: nn.Module) -> None:
        """Forward hooks on every submodule (removed by ``finish``) for module paths and layer times."""
        for path, module in model.named_modules():
            modules = self._modules
            module_id = len(modules.paths)
            modules.paths.append(path or type(module).__name__)
            modules.layers.append(layer_of(path))
            layer = layer_of(path) if is_layer_path(path) else -1
            modules.handles.append(module.register_forward_pre_hook(self._enter(module_id, layer)))
            modules.handles.append(module.register_forward_hook(self._leave(layer)))

    def _enter(self, module_id: int, layer: int):
        def hook(module, args):
            self._attempt.module_stack.append(module_id)
            if layer >= 0 and torch._C._current_graph_task_id() == -1:
                self.layer_times.enter(layer, args)

        return hook

    def _leave(self, layer: int):
        def hook(module, args, output):
            stack = self._attempt.module_stack
            if stack:
                stack.pop()
            if layer >= 0:
                self.layer_times.leave(layer, output)

        return hook

    # ---- notes from the executor ---------------------------------------------------------------
    def on_saved(self, tensor: torch.Tensor, site: str = "") -> None:
        """Autograd saved ``tensor``; ``site`` is where, as the executor names it (NOTE [Save-site
        matching] in executor/matching.py)."""
        if tensor.layout == torch.strided:
            tensor_id, attempt = self._tensor_id(tensor), self._attempt
            attempt.tensors[tensor_id].saved = True
            attempt.saves.append((tensor_id, len(attempt.ops)))
            attempt.save_sites.append(site)

    def on_swap_out(self, storage: torch.UntypedStorage) -> int:
        """Returns the swap's index for ``on_swap_in``/``on_restored`` (unique across attempts)."""
        storage_id, attempt = self._storage_id(storage, created_now=False), self._attempt
        attempt.swaps.append(SwapRecord(storage_id, storage.nbytes(), out_at=len(attempt.ops)))
        return attempt.swap_base + len(attempt.swaps) - 1

    def on_swap_in(self, swap_index: int, at_op: int) -> None:
        attempt = self._attempt
        swap_index -= attempt.swap_base
        if 0 <= swap_index < len(attempt.swaps):
            attempt.swaps[swap_index].restored_at = at_op

    def on_restored(self, swap_index: int, tensor: torch.Tensor) -> None:
        """Backward reads a swapped tensor from its restored copy: record those reads as reads of the
        original storage, so the trace shows the uses an iteration without swapping would have."""
        attempt = self._attempt
        swap_index -= attempt.swap_base
        if 0 <= swap_index < len(attempt.swaps) and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            attempt.storage_ids[storage._cdata] = (attempt.swaps[swap_index].storage_id, weakref.ref(storage))

    @property
    def op_count(self) -> int:
        return len(self._attempt.ops)

    # ---- ops --------------------------------------------------------------------------------
    # The hot path of profiling iterations: flat scans instead of pytree (aten schemas nest at most one
    # list deep), tuples instead of records, one weak reference per new storage.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on_write is not None:  # the swap executor hears of in-place writes (see trace.writes)
            written = self._written.of(func, args, kwargs)
            if written:
                self.on_write(written)
        if self._scope.paused:
            return func(*args, **kwargs) if kwargs else func(*args)
        name_id = self._id_of(func)
        if name_id is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        inputs: list[int] = []
        self._scan(args, inputs, False)
        if kwargs:
            self._scan(kwargs.values(), inputs, False)
            out = func(*args, **kwargs)
        else:
            out = func(*args)
        outputs: list[int] = []
        self._scan((out,), outputs, True)
        phase, attempt = self._phase(), self._attempt
        ops = attempt.ops
        if phase is FORWARD:
            if not self._replays_exactly(func, args, kwargs):
                attempt.inexact_ops.append(len(ops))
            if attempt.last_phase is BACKWARD:
                attempt.micro_batch += 1
            attempt.last_phase = FORWARD
        elif phase is BACKWARD:
            attempt.last_phase = BACKWARD
        named = self._micro_batches.current  # the schedule's identity, when it gives one
        micro_batch = attempt.micro_batch if named is None else named
        stack = attempt.module_stack
        module_id = stack[-1] if stack else -1
        layer = self._modules.layers[module_id] if stack else -1
        ops.append(
            (name_id, phase, micro_batch, module_id, layer, tuple(inputs), tuple(outputs), self._live_bytes())
        )
        if self.signature_ids is not None:  # the same rule as SignatureMode
            self.signature_ids.append(name_id if self._scope.in_autograd() else ~name_id)
        listener = self.listener  # the op clock, as SignatureMode drives it
        if listener is not None:
            if listener.captures_producers:
                listener.on_produced(func, args, kwargs, out)
            if len(ops) >= listener.due_op:
                listener.on_op(len(ops))
        return out

    def _scan(self, values, into: list[int], created_now: bool) -> None:
        tensor_id = self._tensor_id
        for value in values:
            if isinstance(value, torch.Tensor):
                if value.layout == torch.strided:
                    into.append(tensor_id(value, created_now))
            elif type(value) is list or type(value) is tuple:
                for item in value:
                    if isinstance(item, torch.Tensor) and item.layout == torch.strided:
                        into.append(tensor_id(item, created_now))

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return BACKWARD
        if self._scope.optimizer_active:
            return OPTIMIZER
        return FORWARD if self._scope.in_autograd() else OTHER

    def _storage_id(self, storage: torch.UntypedStorage, created_now: bool) -> int:
        key, attempt = storage._cdata, self._attempt
        known = attempt.storage_ids.get(key)
        if known is not None and known[1]() is storage:
            return known[0]
        storage_id = len(attempt.storages)
        if created_now:  # followed to its death; storages from before the iteration outlive it
            ref = weakref.ref(storage, self._storage_died)
            attempt.watched[id(ref)] = (key, storage_id, ref)
        else:
            ref = weakref.ref(storage)
        attempt.storage_ids[key] = (storage_id, ref)
        attempt.storages.append(
            StorageRecord(storage_id, storage.nbytes(), len(attempt.ops) if created_now else -1, -1,
                          key in self._parameter_keys)
        )
        return storage_id

    def _storage_died(self, ref: weakref.ReferenceType) -> None:
        attempt = self._attempt
        watched = attempt.watched.pop(id(ref), None)
        if watched is None or self._finished:
            return
        key, storage_id, _ = watched
        attempt.storages[storage_id].freed_at = len(attempt.ops)
        known = attempt.storage_ids.get(key)
        if known is not None and known[0] == storage_id:
            del attempt.storage_ids[key]

    def _tensor_id(self, tensor: torch.Tensor, created_now: bool = False) -> int:
        storage = tensor.untyped_storage()
        storage_id = self._storage_id(storage, created_now)
        key = (storage_id, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        attempt = self._attempt
        tensor_id = attempt.tensor_ids.get(key)
        if tensor_id is None:
            tensor_id = attempt.tensor_ids[key] = len(attempt.tensors)
            attempt.tensors.append(
                TensorRecord(
                    tensor_id, storage_id, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                    tensor.numel() * tensor.element_size(), attempt.storages[storage_id].is_parameter,
                )
            )
        return tensor_id

    # ---- result -----------------------------------------------------------------------------
    def _elapsed_s(self, end_mark) -> float:
        """Device time from the attempt's start to ``end_mark`` (after ``LayerTimes.resolve``); 0.0 when the
        device could not synchronise (a failed iteration)."""
        try:
            return self.layer_times.timer.elapsed_s(self._attempt.start_mark, end_mark)
        except RuntimeError:
            return 0.0

    def finish(self) -> StepTrace:
        """The trace. Layer times are read here, after one wait for the device (on a GPU, the iteration's
        time then includes its queued kernels too)."""
        self._finished = True
        attempt = self._attempt
        attempt.watched.clear()  # drops the death callbacks (and the cycle through them)
        for handle in self._modules.handles:
            handle.remove()
        self._modules.handles.clear()
        end_mark = self.layer_times.timer.mark()
        forward_s, backward_s = self.layer_times.resolve()
        iteration_s = self._elapsed_s(end_mark)
        attempt.ops = [OpRecord(*row) for row in attempt.ops]
        return StepTrace(
            iteration=self.iteration,
            op_names=list(self._vocabulary.names),
            module_paths=self._modules.paths,
            ops=attempt.ops,
            tensors=attempt.tensors,
            storages=attempt.storages,
            swaps=attempt.swaps,
            iteration_s=iteration_s,
            start_live_bytes=self._start_live_bytes,
            layer_times_s=forward_s,
            layer_backward_times_s=backward_s,
            saves=attempt.saves,
            save_sites=attempt.save_sites,
            inexact_ops=attempt.inexact_ops,
            emulated=self.emulated,
        )
