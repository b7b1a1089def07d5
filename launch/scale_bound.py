"""The host link's physical bound at a shape, from the emulated device's own roofline (``launch/bench_scale.py``).

A swap can hide behind compute only while the forward pass still runs: the most a policy can take off the device
without stalling is what the device-to-host link moves during the forward. From the reference run's detailed trace
(no swap, no recomputation) this takes each micro-batch's forward layer by layer: the bytes each layer saves join a
backlog, and during that layer's forward time (the device clock's, ``StepTrace.layer_times_s``) the link drains up to
``d2h_bytes_per_s`` x that time of it. What is left when the micro-batch's forward ends cannot move in its shadow. Bytes
saved outside the layers (the embedding's, before the first layer) join the backlog first; the head's (after the last
layer) get no forward time. The bound is optimistic in one way: a layer's bytes may start to move at its start."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from chameleon_dist.trace.step_trace import FORWARD, StepTrace


_BEFORE, _AFTER = -1, -2  # pseudo-layers of the ops outside the transformer layers


@dataclasses.dataclass(frozen=True)
class LinkBound:
    saved_bytes: int  # what autograd saved in the iteration (parameters excluded)
    movable_bytes: int  # of those, what the link can move in the forward passes' shadow
    forward_s: float  # the layers' forward device time in the iteration

    @property
    def share(self) -> float:
        return self.movable_bytes / self.saved_bytes if self.saved_bytes else 1.0


def link_bound(trace: StepTrace, d2h_bytes_per_s: float) -> LinkBound:
    """The bound for ``trace``'s iteration (see the module docstring)."""
    ops = trace.ops
    saved = {t.storage_id for t in trace.tensors if t.saved and not t.is_parameter}
    by_micro_batch: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # mb -> layer -> bytes
    order: dict[int, list[int]] = defaultdict(list)  # mb -> layers in forward order (-1 before the first)
    saved_bytes = 0
    for storage in trace.storages:
        if storage.storage_id not in saved or storage.created_at < 0:
            continue
        op = ops[storage.created_at]
        saved_bytes += storage.nbytes
        if op.phase != FORWARD:
            continue
        layers = order[op.micro_batch]
        if op.layer >= 0:
            layer = op.layer
        else:  # before the first layer (the embedding), or after the last one (the head): no layer time
            layer = _BEFORE if all(seen == _BEFORE for seen in layers) else _AFTER
        if layer not in by_micro_batch[op.micro_batch]:
            layers.append(layer)
        by_micro_batch[op.micro_batch][layer] += storage.nbytes
    micro_batches = max(1, len(by_micro_batch))
    movable_bytes = 0
    for micro_batch, bytes_by_layer in by_micro_batch.items():
        backlog = 0.0
        for layer in order[micro_batch]:
            backlog += bytes_by_layer[layer]
            layer_s = trace.layer_times_s.get(layer, 0.0) / micro_batches if layer >= 0 else 0.0
            moved = backlog if math.isinf(d2h_bytes_per_s) else min(backlog, d2h_bytes_per_s * layer_s)
            movable_bytes += moved
            backlog -= moved
    forward_s = sum(trace.layer_times_s.values())
    return LinkBound(saved_bytes, int(movable_bytes), forward_s)
