"""The host link's physical bound at a shape, from the emulated device's own roofline (``launch/experiments/bench_scale.py``).

A swap can hide behind compute only while the forward pass still runs: the most a policy can take off the device
without stalling is what the device-to-host link moves during the forward. From the reference run (no swap, no
recomputation: ``SavedBytesByLayer`` counts what it saves, its trace has each layer's forward time on the device
clock) this takes each micro-batch's forward layer by layer: the bytes each layer saves join a
backlog, and during that layer's forward time the link drains up to
``d2h_bytes_per_s`` x that time of it. What is left when the micro-batch's forward ends cannot move in its shadow. Bytes
saved outside the layers (the embedding's, before the first layer) join the backlog first; the head's (after the last
layer) get no forward time. The bound is optimistic in one way: a layer's bytes may start to move at its start.

Memory peaks once per micro-batch (as its forward ends, with all its activations alive): what a budget can take
off the peak is one micro-batch's movable bytes (``movable_bytes_per_micro_batch``), not the iteration's."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch


_BEFORE, _AFTER = -1, -2  # pseudo-layers of the ops outside the transformer layers


@dataclasses.dataclass(frozen=True)
class LinkBound:
    saved_bytes: int  # what autograd saved in the iteration (parameters excluded)
    movable_bytes: int  # of those, what the link can move in the forward passes' shadow
    forward_s: float  # the layers' forward device time in the iteration
    movable_bytes_per_micro_batch: int = 0  # the most one micro-batch's forward can move (the memory a peak can lose)

    @property
    def share(self) -> float:
        return self.movable_bytes / self.saved_bytes if self.saved_bytes else 1.0


class SavedBytesByLayer:
    """Counts what autograd saves in each micro-batch's forward, by transformer layer (``layers`` of ``model``, in
    order): ``saved_tensors_hooks`` that only count (each live storage once; the parameters' storages, views of
    them included, not at all) and forward hooks. A
    micro-batch starts with ``model``'s forward. ``segments``: per micro-batch, the ``(layer, bytes)`` in forward
    order, ``_BEFORE``/``_AFTER`` for what was saved outside the layers."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
        self._model = model
        self._layers = layers
        self.segments: list[list[list[int]]] = []
        self._seen: set[int] = set()
        self._current = _BEFORE
        self._hooks = []

    def __enter__(self) -> "SavedBytesByLayer":
        # (autograd also saves views of the weights, e.g. a linear's transposed weight: not activations)
        self._parameter_keys = {p.untyped_storage()._cdata for p in self._model.parameters()}
        self._hooks.append(self._model.register_forward_pre_hook(self._enter_model))
        for index, layer in enumerate(self._layers):
            self._hooks.append(layer.register_forward_pre_hook(functools.partial(self._enter_layer, index)))
            self._hooks.append(layer.register_forward_hook(functools.partial(self._leave_layer, index)))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved_hooks.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def _enter_model(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.segments.append([])
            self._current = _BEFORE

    def _enter_layer(self, index: int, module, args) -> None:
        self._current = index

    def _leave_layer(self, index: int, module, args, output) -> None:
        self._current = _AFTER if index == len(self._layers) - 1 else index

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._seen and key not in self._parameter_keys:
            self._seen.add(key)
            # (a storage's address is reused once it dies: forget it then, or a later storage goes uncounted)
            weakref.finalize(storage, self._seen.discard, key)
            if not self.segments:
                self.segments.append([])
            segment = self.segments[-1]
            if segment and segment[-1][0] == self._current:
                segment[-1][1] += storage.nbytes()
            else:
                segment.append([self._current, storage.nbytes()])
        return tensor


def link_bound(segments: list[list[list[int]]], layer_times_s: dict[int, float], d2h_bytes_per_s: float) -> LinkBound:
    """The bound (see the module docstring) for one iteration's ``SavedBytesByLayer.segments`` and the forward
    time of each layer over the iteration (``StepTrace.layer_times_s``: every micro-batch's, summed)."""
    micro_batches = max(1, len(segments))
    saved_bytes = movable_bytes = 0
    per_micro_batch = []
    for segment in segments:
        before = movable_bytes
        backlog = 0.0
        for layer, nbytes in segment:
            saved_bytes += nbytes
            backlog += nbytes
            layer_s = layer_times_s.get(layer, 0.0) / micro_batches if layer >= 0 else 0.0
            moved = min(backlog, d2h_bytes_per_s * layer_s) if layer_s > 0 else 0.0  # (no time: nothing moves)
            movable_bytes += moved
            backlog -= moved
        per_micro_batch.append(movable_bytes - before)
    return LinkBound(saved_bytes, int(movable_bytes), sum(layer_times_s.values()), int(max(per_micro_batch, default=0)))
