"""From a simulated selection to the ``Policy`` the executor applies.

The generator decides *what* leaves the device and *when*; this module writes it down the way the executor
and the controller need it: each entry's matching features (save ordinals, see NOTE [Save-site
matching] in executor/matching.py; the saving op and the tensor's argument position), its triggers and
predictions, the bytes and copy seconds per logical layer, and, when the predicted peak stays above the
budget, why (``Policy.infeasibility`` for code, ``Policy.reason`` for people).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from chameleon_dist.policy.candidates import Candidate
from chameleon_dist.policy.inputs import Context, Variant
from chameleon_dist.policy.model import (
    NEITHER_INPUT_NOR_OUTPUT,
    Decision,
    Infeasibility,
    LayerLoad,
    Policy,
    PolicyEntry,
    save_key,
)
from chameleon_dist.policy.simulator import Outcome, Planned, SimResult
from chameleon_dist.trace.step_trace import OpRecord
from chameleon_dist.units import format_bytes


@dataclasses.dataclass
class _SaveOrder:
    """Where each saved storage of the traced iteration stands in the save order."""

    save_ordinal: dict[int, int]  # storage id -> See NOTE [Save-site matching] in executor/matching.py
    save_keys: list[str]  # "dtype[shape]" by save ordinal
    save_sites: list[str]  # the executor's site by save ordinal ("" where the trace has none)
    layer_save_ordinal: dict[int, int]  # storage id -> ordinal among the saves of its (micro-batch, layer)


def to_policy(
    ctx: Context,
    variant: Variant,
    *,
    chosen: list[Candidate],
    planned: list[Planned],
    sim: SimResult,
    host_kept_bytes: int,
) -> Policy:
    """``chosen[k]`` was placed as ``planned[k]`` and ended as ``sim.outcomes[k]``."""
    trace, s = ctx.trace, ctx.settings
    order = _save_order(ctx)
    loads: dict[int, LayerLoad] = {}
    for g, t in zip(ctx.groups, ctx.group_times_s):
        loads.setdefault(g.layer, LayerLoad(g.layer)).compute_s += t
    entries = []
    for cand, p, o in zip(chosen, planned, sim.outcomes):
        layer = ctx.groups[int(ctx.group_of[cand.created_at])].layer
        load = loads.setdefault(layer, LayerLoad(layer))
        if p.decision == Decision.SWAP:
            load.swap_bytes += p.nbytes
            load.d2h_s += p.nbytes / s.d2h_bytes_per_s
            load.h2d_s += p.nbytes / s.h2d_bytes_per_s
        else:
            load.recompute_bytes += p.nbytes
        entries.append(_entry(ctx, order, cand, p, o))
    entries.sort(key=lambda e: e.save_ordinal)
    feasible = sim.peak_bytes <= s.budget_bytes
    infeasibility, reason = (None, "") if feasible else _why_infeasible(ctx, sim, host_kept_bytes)
    return Policy(
        name=variant.name, budget_bytes=s.budget_bytes, feasible=feasible, predicted_peak_bytes=sim.peak_bytes,
        no_swap_peak_bytes=max(ctx.base_curve, default=0), predicted_stall_s=sim.stall_s,
        predicted_recompute_s=sim.recompute_s, predicted_iteration_s=sim.iteration_s, compute_s=sim.compute_s,
        entries=entries, layers=[loads[k] for k in sorted(loads)], num_ops=len(trace.ops),
        trace_iteration=trace.iteration,
        settings={"score_c": variant.size_weight, "margin": variant.recorded_margin, "reserve_bytes": s.reserve_bytes,
                  "allow_recompute": variant.allow_recompute, "min_swap_bytes": s.min_swap_bytes,
                  "d2h_bytes_per_s": s.d2h_bytes_per_s, "h2d_bytes_per_s": s.h2d_bytes_per_s},
        save_keys=order.save_keys, save_sites=order.save_sites if all(order.save_sites) else [],
        host_kept_bytes=host_kept_bytes, reason=reason, infeasibility=infeasibility,
        emulated=trace.emulated,
    )


def _save_order(ctx: Context) -> _SaveOrder:
    trace = ctx.trace
    order = _SaveOrder({}, [], [], {})
    saves = trace.saves or [(t.tensor_id, -1) for t in trace.tensors if t.saved]
    sites = trace.save_sites if len(trace.save_sites) == len(saves) else [""] * len(saves)
    for (tensor_id, _), site in zip(saves, sites):
        record = trace.tensors[tensor_id]
        if record.storage_id not in order.save_ordinal:
            order.save_ordinal[record.storage_id] = len(order.save_ordinal)
            order.save_keys.append(save_key(record.dtype, record.shape))
            order.save_sites.append(site)
    per_layer_count: dict[tuple[int, int], int] = {}
    for storage_id in order.save_ordinal:  # in save order
        group = ctx.groups[int(ctx.group_of[max(0, trace.storages[storage_id].created_at)])]
        key = (group.micro_batch, group.layer)
        order.layer_save_ordinal[storage_id] = per_layer_count.get(key, 0)
        per_layer_count[key] = order.layer_save_ordinal[storage_id] + 1
    return order


def _entry(ctx: Context, order: _SaveOrder, cand: Candidate, p: Planned, o: Outcome) -> PolicyEntry:
    trace = ctx.trace
    group = ctx.groups[int(ctx.group_of[cand.created_at])]
    record = trace.tensors[cand.save_tensor_id]
    saving_op = trace.ops[max(0, cand.save_op_index - 1)]
    return PolicyEntry(
        decision=p.decision, nbytes=p.nbytes,
        micro_batch=group.micro_batch, layer=group.layer, group=group.index,
        save_ordinal=order.save_ordinal.get(cand.storage_id, -1),
        layer_save_ordinal=order.layer_save_ordinal.get(cand.storage_id, -1),
        save_op_index=cand.save_op_index, calling_op=trace.op_names[saving_op.name_id],
        arg_position=_arg_position(saving_op, cand.save_tensor_id),
        dtype=record.dtype, shape=tuple(record.shape), tensor_nbytes=record.nbytes,
        swap_out_at=p.swap_out_at, last_forward_use=p.last_forward_use,
        release_at=o.release_at if o.released else -1, swap_in_at=p.swap_in_at,
        first_backward_use=p.first_backward_use, predicted_stall_s=o.stall_s, recompute_s=p.recompute_s,
    )


def _arg_position(op: OpRecord, tensor_id: int) -> int:
    """See ``PolicyEntry.arg_position``."""
    if tensor_id in op.inputs:
        return op.inputs.index(tensor_id)
    if tensor_id in op.outputs:
        return -(op.outputs.index(tensor_id) + 1)
    return NEITHER_INPUT_NOR_OUTPUT


def _why_infeasible(ctx: Context, sim: SimResult, host_kept_bytes: int) -> tuple[Infeasibility, str]:
    """The cause, checked from the most fundamental (swapping cannot help at all) to the most tunable."""
    trace, s = ctx.trace, ctx.settings
    short = (f"{format_bytes(sim.peak_bytes - s.budget_bytes)} (predicted peak {format_bytes(sim.peak_bytes)}, "
             f"budget {format_bytes(s.budget_bytes)})")
    op = trace.ops[sim.peak_op]
    if not any(c.last_forward_use < sim.peak_op < c.first_backward_use for c in ctx.candidates):
        return Infeasibility.NO_SWAPPABLE_AT_PEAK, (
            f"short by {short} at op {sim.peak_op} "
            f"({trace.op_names[op.name_id]}, {op.phase}), where no swappable saved activation is waiting for "
            "backward: swapping cannot lower this peak; raise memory_budget or shrink the model state/micro-batch"
        )
    floor_bytes = _swap_floor_bytes(ctx)
    if floor_bytes > s.budget_bytes:
        return Infeasibility.SWAP_FLOOR_ABOVE_BUDGET, (
            f"short by {short}: even with every candidate off the device for its whole window and instant "
            f"copies the peak would be {format_bytes(floor_bytes)}, above the budget (what is live there is "
            "not swappable: model state, temporaries, activations in use, tensors below min_swap_bytes); raise "
            "memory_budget, lower min_swap_bytes, shrink the micro-batch or add recomputation"
        )
    return Infeasibility.HOST_BUDGET if host_kept_bytes else Infeasibility.LINK_TOO_SLOW, (
        f"short by {short} at op {sim.peak_op} "
        f"({trace.op_names[op.name_id]}, {op.phase}): swapping could reach {format_bytes(floor_bytes)} "
        f"with instant copies, but the host link ({s.d2h_bytes_per_s / 1e9:.3g} GB/s out, "
        f"{s.h2d_bytes_per_s / 1e9:.3g} GB/s in) cannot move enough in time"
        + (f" and host_memory_budget kept {format_bytes(host_kept_bytes)} on the device" if host_kept_bytes else "")
        + "; raise memory_budget, shrink the micro-batch or add recomputation"
    )


def _swap_floor_bytes(ctx: Context) -> int:
    """The lowest peak any swap policy could reach: every candidate off the device for its whole window,
    copies instant."""
    base = np.asarray(ctx.base_curve, dtype=np.int64)
    off = np.zeros(len(base) + 1, dtype=np.int64)
    for c in ctx.candidates:
        off[c.last_forward_use + 1] += c.nbytes
        off[c.first_backward_use] -= c.nbytes
    return int((base - np.cumsum(off)[:-1]).max(initial=0))
