"""The detailed profiler: a ``StepTrace`` of one iteration (used only in profiling iterations).

A dispatch mode records, per op, its name id, the tensors it read and wrote (as per-iteration tensor and
storage ids), the phase and micro-batch, the innermost module and layer, and the live device bytes after
it. Storages are followed from creation to death with ``weakref.finalize``. The swap executor reports
its swaps (``on_swap_out`` / ``on_swap_in``) and autograd's saved tensors (``on_saved``), so the no-swap
memory curve can be rebuilt. The work per op is kept small: tuples and dict lookups, no formatting.
"""

from __future__ import annotations

import re
import time
import weakref
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from chameleon_dist.profiler.scope import TrainingScope
from chameleon_dist.profiler.signature import OpVocabulary
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

_LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|blocks|h|layer)\.(\d+)(?:\.|$)")


def layer_of(module_path: str) -> int:
    """The transformer-layer index in a module path such as ``decoder.layers.3.mlp`` (else -1)."""
    match = _LAYER_PATTERN.search(module_path)
    return int(match.group(1)) if match else -1


class TraceRecorder(TorchDispatchMode):
    """Records one iteration. Enter it (after the device's metering) around the iteration; ``finish``
    returns the ``StepTrace``."""

    def __init__(
        self,
        vocabulary: OpVocabulary,
        live_bytes: Callable[[], int],
        parameter_storage_keys: set[int],
        iteration: int,
        emulated: bool,
        scope: TrainingScope | None = None,
    ) -> None:
        super().__init__()
        self._scope = scope if scope is not None else TrainingScope()
        self._id_of = vocabulary.id_of
        self._vocabulary = vocabulary
        self._live_bytes = live_bytes
        self._parameter_keys = parameter_storage_keys
        self.iteration = iteration
        self.emulated = emulated
        self.ops: list[OpRecord] = []
        self.tensors: list[TensorRecord] = []
        self.storages: list[StorageRecord] = []
        self.swaps: list[SwapRecord] = []
        self.module_paths: list[str] = []
        self.optimizer_active = False
        self._tensor_ids: dict[tuple, int] = {}
        # storage address -> (storage id, weak reference): an address is reused once its storage died, and
        # storages from before the iteration are not followed to their death, so identity is checked
        self._storage_ids: dict[int, tuple[int, weakref.ReferenceType]] = {}
        self._module_stack: list[int] = []
        self._layer_start_s: dict[int, float] = {}
        self.layer_times_s: dict[int, float] = {}
        self._micro_batch = 0
        self._last_phase = FORWARD
        self._start_s = time.perf_counter()
        self._start_live_bytes = live_bytes()
        self._handles: list = []
        self._finished = False

    # ---- modules ----------------------------------------------------------------------------
    def watch_modules(self, model: nn.Module) -> None:
        """Forward hooks on every submodule (removed by ``finish``) for module paths and layer times."""
        for path, module in model.named_modules():
            module_id = len(self.module_paths)
            self.module_paths.append(path or type(module).__name__)
            layer = layer_of(path) if _is_layer_path(path) else -1
            self._handles.append(module.register_forward_pre_hook(self._enter(module_id, layer)))
            self._handles.append(module.register_forward_hook(self._leave(layer)))

    def _enter(self, module_id: int, layer: int):
        def hook(module, args):
            self._module_stack.append(module_id)
            if layer >= 0 and torch._C._current_graph_task_id() == -1:
                self._layer_start_s[layer] = time.perf_counter()

        return hook

    def _leave(self, layer: int):
        def hook(module, args, output):
            if self._module_stack:
                self._module_stack.pop()
            start = self._layer_start_s.pop(layer, None) if layer >= 0 else None
            if start is not None:
                self.layer_times_s[layer] = self.layer_times_s.get(layer, 0.0) + time.perf_counter() - start

        return hook

    # ---- notes from the executor ---------------------------------------------------------------
    def on_saved(self, tensor: torch.Tensor) -> None:
        if tensor.layout == torch.strided:
            self.tensors[self._tensor_id(tensor)].saved = True

    def on_swap_out(self, storage: torch.UntypedStorage) -> int:
        storage_id = self._storage_id(storage, created_now=False)
        self.swaps.append(SwapRecord(storage_id, storage.nbytes(), out_at=len(self.ops)))
        return len(self.swaps) - 1

    def on_swap_in(self, swap_index: int, at_op: int) -> None:
        if 0 <= swap_index < len(self.swaps):
            self.swaps[swap_index].restored_at = at_op

    @property
    def op_count(self) -> int:
        return len(self.ops)

    # ---- ops --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._scope.paused:
            return func(*args, **kwargs)
        name_id = self._id_of(func)
        if name_id is None:
            return func(*args, **kwargs)
        input_ids = tuple(self._tensor_id(t) for t in tree_leaves((args, kwargs)) if _traceable(t))
        out = func(*args, **kwargs)
        output_ids = tuple(self._tensor_id(t, created_now=True) for t in tree_leaves(out) if _traceable(t))
        phase = self._phase()
        if phase == FORWARD and self._last_phase == BACKWARD:
            self._micro_batch += 1
        self._last_phase = phase if phase in (FORWARD, BACKWARD) else self._last_phase
        module_id = self._module_stack[-1] if self._module_stack else -1
        layer = layer_of(self.module_paths[module_id]) if module_id >= 0 else -1
        self.ops.append(
            OpRecord(name_id, phase, self._micro_batch, module_id, layer, input_ids, output_ids, self._live_bytes())
        )
        return out

    def _phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return BACKWARD
        if self.optimizer_active:
            return OPTIMIZER
        return FORWARD if self._scope.in_autograd() else OTHER

    def _storage_id(self, storage: torch.UntypedStorage, created_now: bool) -> int:
        key = storage._cdata
        known = self._storage_ids.get(key)
        if known is not None and known[1]() is storage:
            return known[0]
        storage_id = len(self.storages)
        self._storage_ids[key] = (storage_id, weakref.ref(storage))
        self.storages.append(
            StorageRecord(storage_id, storage.nbytes(), len(self.ops) if created_now else -1, -1, key in self._parameter_keys)
        )
        if created_now:  # storages from before the iteration (parameters, inputs) outlive it
            weakref.finalize(storage, _storage_died, weakref.ref(self), key, storage_id)
        return storage_id

    def storage_died(self, key: int, storage_id: int) -> None:
        if not self._finished:
            self.storages[storage_id].freed_at = len(self.ops)
            known = self._storage_ids.get(key)
            if known is not None and known[0] == storage_id:
                del self._storage_ids[key]

    def _tensor_id(self, tensor: torch.Tensor, created_now: bool = False) -> int:
        storage = tensor.untyped_storage()
        storage_id = self._storage_id(storage, created_now)
        key = (storage_id, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        tensor_id = self._tensor_ids.get(key)
        if tensor_id is None:
            tensor_id = self._tensor_ids[key] = len(self.tensors)
            self.tensors.append(
                TensorRecord(
                    tensor_id, storage_id, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                    tensor.numel() * tensor.element_size(), self.storages[storage_id].is_parameter,
                )
            )
        return tensor_id

    # ---- result -----------------------------------------------------------------------------
    def finish(self) -> StepTrace:
        self._finished = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return StepTrace(
            iteration=self.iteration,
            op_names=list(self._vocabulary.names),
            module_paths=self.module_paths,
            ops=self.ops,
            tensors=self.tensors,
            storages=self.storages,
            swaps=self.swaps,
            iteration_s=time.perf_counter() - self._start_s,
            start_live_bytes=self._start_live_bytes,
            layer_times_s=dict(self.layer_times_s),
            emulated=self.emulated,
        )


def _storage_died(recorder_ref: "weakref.ReferenceType[TraceRecorder]", key: int, storage_id: int) -> None:
    recorder = recorder_ref()
    if recorder is not None:
        recorder.storage_died(key, storage_id)


def _traceable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


def _is_layer_path(path: str) -> bool:
    match = _LAYER_PATTERN.search(path)
    return bool(match) and match.end() == len(path)
