"""A traced iteration as it would be on a larger (or smaller) shape: ``grown(trace, growth)``.

A sequence length or batch size change runs the same ops on tensors of other sizes. Before the runtime
profiles such a shape again, the policy controller generates policies from the trace it has, grown:

- every storage the iteration allocated and freed again (activations, saved tensors, temporaries of
  forward and backward) is ``growth`` times larger, and the live bytes of every op in its lifetime with it;
  a storage swapped in the traced iteration also while its restored copy was live (up to its last read);
- what was there before the iteration (model state) and what outlives it (parameter gradients,
  optimizer state created in its first step) keeps its size;
- op times grow alike (more tokens, more compute).

It is a model, not a measurement: attention grows faster than linearly in the sequence length and
temporaries of fixed size do not grow at all, so a policy made from it is checked in the next iteration
like any other (a passive swap or a second overshoot makes the runtime profile the new shape).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from chameleon_dist.trace.step_trace import StepTrace


def grown(trace: StepTrace, growth: float, by_layer: Mapping[int, float] | None = None) -> StepTrace:
    """``trace`` with what scales with the shape ``growth`` times larger (see the module docstring); with
    ``by_layer``, a storage created by an op of a layer it names grows that layer's factor instead (what the
    layers that vary saved at most, ``policy.variance``), and op times grow by the layers' factors weighted
    by their measured times."""
    by_layer = by_layer or {}
    if growth == 1.0 and not by_layer:
        return trace
    n = len(trace.ops)
    delta = np.zeros(n + 1, dtype=np.int64)
    last_read = _last_reads(trace)
    restored = {swap.storage_id: swap.restored_at for swap in trace.swaps if swap.restored_at >= 0}
    storages, scaled = [], {}  # storage id -> its growth
    for s in trace.storages:
        if s.is_parameter or s.created_at < 0 or s.freed_at < 0:
            storages.append(s)
            continue
        factor = by_layer.get(trace.ops[s.created_at].layer, growth)
        nbytes = int(round(s.nbytes * factor))
        extra = nbytes - s.nbytes
        delta[s.created_at] += extra
        delta[min(s.freed_at, n)] -= extra
        restored_at = restored.get(s.storage_id, -1)
        if restored_at >= 0:
            # its restored copy (measured live bytes) grows too, from when the original had died: a
            # restore that reused the original (its swap-out had not landed) made no copy
            start, end = max(restored_at, s.freed_at), last_read.get(s.storage_id, -1) + 1
            if start < end:
                delta[start] += extra
                delta[end] -= extra
        storages.append(dataclasses.replace(s, nbytes=nbytes))
        scaled[s.storage_id] = factor
    extra_live = np.cumsum(delta)[:-1]
    ops = [dataclasses.replace(op, live_bytes=int(op.live_bytes + extra)) for op, extra in zip(trace.ops, extra_live)]
    tensors = [dataclasses.replace(t, nbytes=int(round(t.nbytes * scaled[t.storage_id]))) if t.storage_id in scaled
               else t for t in trace.tensors]
    swaps = [dataclasses.replace(w, nbytes=storages[w.storage_id].nbytes) for w in trace.swaps]
    layer_times_s = {layer: t * by_layer.get(layer, growth) for layer, t in trace.layer_times_s.items()}
    measured_s = sum(trace.layer_times_s.values())
    time_growth = sum(layer_times_s.values()) / measured_s if by_layer and measured_s > 0 else growth
    return dataclasses.replace(
        trace, ops=ops, tensors=tensors, storages=storages, swaps=swaps, iteration_s=trace.iteration_s * time_growth,
        layer_times_s=layer_times_s,
    )


def _last_reads(trace: StepTrace) -> dict[int, int]:
    """Storage id -> the last op that read it."""
    last: dict[int, int] = {}
    tensors = trace.tensors
    for index, op in enumerate(trace.ops):
        for t in op.inputs:
            last[tensors[t].storage_id] = index
    return last
