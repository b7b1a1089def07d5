"""Logical layers of a ``StepTrace`` and how long each one takes.

A logical layer is a contiguous run of ops with the same phase, micro-batch and layer label. Forward ops
are labelled from what the trace knows, best source first:

1. the transformer-layer index of the module that ran the op (``OpRecord.layer``);
2. the repeating attention pattern: one layer per occurrence of the attention anchor op (softmax or
   scaled-dot-product attention), cut at the same offset from each anchor;
3. equal op counts (the paper's cut behind Eq. 1), ``ops_per_group`` ops per layer.

Backward ops carry no module (module hooks do not run in backward), so each takes the label of the
forward layer whose saved tensor it reads; ops that read none inherit the label of the op before them.

Timing (paper's Eq. 1): ``T_group = T_iter / N_iter * N_group``. When the trace carries measured forward
times per transformer layer (``StepTrace.layer_times_s``), those calibrate it: the forward groups of a
measured layer share its measured time by op count, its backward groups are scaled by the same
measured/Eq. 1 factor, and the unmeasured rest is rescaled so the groups still add up to ``T_iter``.
"""

from __future__ import annotations

import dataclasses
import statistics

from chameleon_dist.trace.step_trace import BACKWARD, FORWARD, StepTrace

DEFAULT_OPS_PER_GROUP = 64
ANCHOR_NAMES = ("_softmax", "scaled_dot_product", "flash_attention", "efficient_attention")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerGroup:
    """Ops ``[start, end)`` of one logical layer."""

    index: int
    start: int
    end: int
    phase: str
    micro_batch: int
    layer: int  # the label (transformer layer, anchor ordinal or chunk ordinal); -1 outside fwd/bwd

    @property
    def num_ops(self) -> int:
        return self.end - self.start


def forward_labels(trace: StepTrace, ops_per_group: int = DEFAULT_OPS_PER_GROUP) -> tuple[list[int], str]:
    """A layer label per op (-1 for non-forward ops) and the rule that produced them."""
    ops = trace.ops
    forward = [i for i, op in enumerate(ops) if op.phase == FORWARD]
    labels = [-1] * len(ops)
    if not forward:
        return labels, "none"
    known = sum(1 for i in forward if ops[i].layer >= 0)
    if known >= len(forward) // 2:
        current = -1
        for i in forward:  # ops outside any layer (embedding, head) join the layer next to them
            if ops[i].layer >= 0:
                current = ops[i].layer
            labels[i] = current
        first = next((labels[i] for i in forward if labels[i] >= 0), 0)
        for i in forward:
            if labels[i] >= 0:
                break
            labels[i] = first
        return labels, "module"
    anchor_ids = {k for k, name in enumerate(trace.op_names) if any(a in name for a in ANCHOR_NAMES)}
    by_mb: dict[int, list[int]] = {}
    for i in forward:
        by_mb.setdefault(ops[i].micro_batch, []).append(i)
    anchored = all(sum(ops[i].name_id in anchor_ids for i in run) >= 2 for run in by_mb.values())
    if anchored:
        for run in by_mb.values():
            anchors = [pos for pos, i in enumerate(run) if ops[i].name_id in anchor_ids]
            offset = anchors[0] // 2 if len(anchors) == 1 else min(anchors[0], (anchors[1] - anchors[0]) // 2)
            label = 0
            next_cut = [a - offset for a in anchors[1:]]
            for pos, i in enumerate(run):
                while next_cut and pos >= next_cut[0]:
                    next_cut.pop(0)
                    label += 1
                labels[i] = label
        return labels, "attention"
    for run in by_mb.values():
        for pos, i in enumerate(run):
            labels[i] = pos // max(1, ops_per_group)
    return labels, "equal"


def logical_layers(trace: StepTrace, ops_per_group: int = DEFAULT_OPS_PER_GROUP) -> tuple[list[LayerGroup], str]:
    """The trace cut into logical layers (covering every op once, in order) and the labelling rule."""
    ops = trace.ops
    labels, rule = forward_labels(trace, ops_per_group)
    producer_label: dict[int, int] = {}  # storage id -> forward label of the op that saved a tensor of it
    save_at = {tensor_id: op_index for tensor_id, op_index in trace.saves}
    for i, op in enumerate(ops):
        if op.phase == FORWARD:
            for t in op.outputs:
                producer_label.setdefault(trace.tensors[t].storage_id, labels[i])
            for t in op.inputs:
                if trace.tensors[t].saved:
                    producer_label.setdefault(trace.tensors[t].storage_id, labels[i])
    for tensor_id, op_index in save_at.items():  # the saving op's layer wins over the producer's
        if 0 < op_index <= len(ops) and labels[op_index - 1] >= 0:
            producer_label[trace.tensors[tensor_id].storage_id] = labels[op_index - 1]
    previous = -1
    for i, op in enumerate(ops):
        if op.phase != BACKWARD:
            previous = -1 if op.phase != FORWARD else previous
            continue
        found = [producer_label[s] for s in (trace.tensors[t].storage_id for t in op.inputs) if s in producer_label]
        if found:
            previous = max(found)
        labels[i] = previous
    chunk = max(1, ops_per_group)
    groups: list[LayerGroup] = []
    start = 0
    for i in range(1, len(ops) + 1):
        if i < len(ops):
            a, b = ops[i - 1], ops[i]
            same = (a.phase, a.micro_batch, labels[i - 1]) == (b.phase, b.micro_batch, labels[i])
            if same and (labels[i] >= 0 or i - start < chunk):
                continue
        op = ops[start]
        groups.append(LayerGroup(len(groups), start, i, op.phase, op.micro_batch, labels[start]))
        start = i
    return groups, rule


def eq1_group_times_s(trace: StepTrace, groups: list[LayerGroup]) -> list[float]:
    """Paper's Eq. 1: every op takes ``T_iter / N_iter``."""
    per_op_s = trace.iteration_s / max(1, len(trace.ops))
    return [per_op_s * g.num_ops for g in groups]


def calibrated_group_times_s(trace: StepTrace, groups: list[LayerGroup]) -> list[float]:
    """Eq. 1 calibrated with the trace's measured forward layer times (Eq. 1 alone when there are none).

    Per op: a forward op of a measured transformer layer (``OpRecord.layer``) gets its layer's measured
    time divided by the layer's forward ops; the backward ops of a logical layer are scaled by the same
    measured / Eq. 1 factor; everything else keeps Eq. 1 and is rescaled so the total stays ``T_iter``."""
    if not trace.layer_times_s:
        return eq1_group_times_s(trace, groups)
    ops = trace.ops
    per_op_s = trace.iteration_s / max(1, len(ops))
    counts: dict[int, int] = {}
    for op in ops:
        if op.phase == FORWARD and op.layer in trace.layer_times_s:
            counts[op.layer] = counts.get(op.layer, 0) + 1
    factor = {layer: trace.layer_times_s[layer] / (per_op_s * n) for layer, n in counts.items() if per_op_s > 0}
    fixed = [False] * len(ops)
    times = [per_op_s] * len(ops)
    for g in groups:
        for i in range(g.start, g.end):
            op = ops[i]
            if op.phase == FORWARD and op.layer in factor:
                times[i] = trace.layer_times_s[op.layer] / counts[op.layer]
                fixed[i] = True
            elif g.phase == BACKWARD and g.layer in factor:
                times[i] = per_op_s * factor[g.layer]
    fixed_s = sum(t for t, f in zip(times, fixed) if f)
    rest_s = sum(t for t, f in zip(times, fixed) if not f)
    scale = max(0.0, trace.iteration_s - fixed_s) / rest_s if rest_s > 0 else 1.0
    times = [t if f else t * scale for t, f in zip(times, fixed)]
    return [sum(times[g.start:g.end]) for g in groups]


def op_times_s(groups: list[LayerGroup], group_times_s: list[float]) -> list[float]:
    """Per-op durations: each group's time spread evenly over its ops."""
    out: list[float] = []
    for g, t in zip(groups, group_times_s):
        out.extend([t / g.num_ops] * g.num_ops)
    return out


@dataclasses.dataclass(frozen=True)
class Eq1Error:
    """How far Eq. 1's forward layer times are from the measured ones."""

    layers: int
    measured_cv: float  # coefficient of variation of the measured forward layer times
    mean_abs_error: float  # mean |Eq.1 - measured| / measured over layers
    max_abs_error: float


def eq1_error(trace: StepTrace, groups: list[LayerGroup]) -> Eq1Error | None:
    """Eq. 1 against the trace's measured forward layer times (None when it has none)."""
    if not trace.layer_times_s:
        return None
    per_op_s = trace.iteration_s / max(1, len(trace.ops))
    eq1: dict[int, float] = {}
    for op in trace.ops:  # a layer's own forward ops (module-labelled), as the measurement covers
        if op.phase == FORWARD and op.layer in trace.layer_times_s:
            eq1[op.layer] = eq1.get(op.layer, 0.0) + per_op_s
    measured = [trace.layer_times_s[layer] for layer in sorted(eq1)]
    if not measured:
        return None
    # Eq. 1 spreads T_iter over all ops; the measured times cover forward layers only, so compare shares of
    # the forward layer total (the scale Eq. 1 gets wrong for the whole iteration would otherwise dominate)
    eq1_total, measured_total = sum(eq1.values()), sum(measured)
    errors = [
        abs(eq1[layer] / eq1_total - m / measured_total) / (m / measured_total)
        for layer, m in zip(sorted(eq1), measured)
        if m > 0
    ]
    mean = statistics.fmean(measured)
    cv = statistics.pstdev(measured) / mean if mean > 0 and len(measured) > 1 else 0.0
    return Eq1Error(len(measured), cv, statistics.fmean(errors), max(errors))
