"""From a ``StepTrace`` and a memory budget to swap/recompute policies that the simulator says hold.

For each trial (a different trade-off: Eq. 2's size weight ``C``, a safety margin under the budget, with
or without recomputation):

1. the reduction list of the no-swap curve against the target; candidates scored with Eq. 2;
2. greedy selection in score order: a candidate is taken while some op inside its window still has
   bytes to remove; it removes its bytes there (host budget permitting);
3. placement: swap-outs in the producing layer when its spare copy time allows, else the next layer that
   has it; swap-ins in the layer before first use or the nearest earlier layer whose cumulative spare time
   covers the copy. When a swap-in cannot be hidden and recomputing the producer exactly is cheaper than
   the stall, the tensor is recomputed instead;
4. simulation; when the predicted peak is still above the target (copies finish later than the windows
   assumed), the simulated curve's excess drives another selection round.

Deterministic: the same trace and settings give the same policies.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from chameleon_dist.policy.candidates import Candidate, find_candidates, reduction_list, score_candidates
from chameleon_dist.policy.layers import LayerGroup, calibrated_group_times_s, logical_layers, op_times_s as spread
from chameleon_dist.policy.model import LayerLoad, Policy, PolicyEntry, save_key
from chameleon_dist.policy.simulator import RECOMPUTE, SWAP, Planned, SimResult, simulate
from chameleon_dist.trace.step_trace import StepTrace
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

MAX_ROUNDS = 12
ALL = -1.0  # the margin marking the "every candidate" variant


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    budget_bytes: int
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    min_swap_bytes: int = 0
    host_budget_bytes: int | None = None
    score_c: float = 2.0  # Eq. 2's size weight
    trials: int = 5
    allow_recompute: bool = True
    ops_per_group: int = 64
    reserve_bytes: int = 0  # aim this far under the budget (the runtime raises it after a policy missed)
    prefetch_slack: float = 1.5  # swap-ins start this many copy-times of compute before the use, when possible

    def __post_init__(self) -> None:
        problems = []
        if self.budget_bytes <= 0:
            problems.append(f"memory_budget must be positive, got {self.budget_bytes} bytes")
        if self.d2h_bytes_per_s <= 0 or self.h2d_bytes_per_s <= 0:
            problems.append("device.d2h_bytes_per_s and device.h2d_bytes_per_s must be positive")
        if self.trials < 1:
            problems.append(f"profiler.policy_trials must be >= 1, got {self.trials}")
        if self.reserve_bytes < 0:
            problems.append(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.host_budget_bytes is not None and self.host_budget_bytes < 0:
            problems.append("host_memory_budget must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))


@dataclasses.dataclass
class PolicySet:
    policies: list[Policy]  # feasible ones first, fastest first
    no_swap_peak_bytes: int
    budget_bytes: int

    @property
    def best(self) -> Policy | None:
        return self.policies[0] if self.policies else None

    @property
    def feasible(self) -> bool:
        return bool(self.policies) and self.policies[0].feasible


@dataclasses.dataclass
class _Context:
    trace: StepTrace
    settings: PolicySettings
    groups: list[LayerGroup]
    group_of: np.ndarray
    group_times_s: list[float]
    op_times_s: list[float]
    base_curve: list[int]
    candidates: list[Candidate]


def generate_policies(trace: StepTrace, settings: PolicySettings, op_times_s: list[float] | None = None) -> PolicySet:
    """Up to ``settings.trials`` distinct policies (plus "all", every candidate, when one of them does not
    fit), feasible ones first, then by predicted time."""
    groups, _ = logical_layers(trace, settings.ops_per_group)
    group_of = np.zeros(len(trace.ops), dtype=np.int64)
    for g in groups:
        group_of[g.start:g.end] = g.index
    if op_times_s is None:
        group_times = calibrated_group_times_s(trace, groups)
        per_op = spread(groups, group_times)
    else:
        if len(op_times_s) != len(trace.ops):
            raise ValueError(f"op_times_s has {len(op_times_s)} entries for {len(trace.ops)} ops")
        per_op = list(op_times_s)
        group_times = [sum(per_op[g.start:g.end]) for g in groups]
    ctx = _Context(trace, settings, groups, group_of, group_times, per_op, trace.no_swap_memory_curve(),
                   find_candidates(trace, settings.min_swap_bytes))
    c = settings.score_c
    recompute = settings.allow_recompute
    # (name, Eq. 2 size weight, margin, recompute): a margin aims that share of the needed reduction
    # (no-swap peak - budget) further under the budget; "all" takes every candidate (the fallback)
    variants = [
        ("balanced", c, 0.0, recompute),
        ("margin5", c, 0.05, recompute),
        ("coverage-first", c / 4, 0.0, recompute),
        ("size-first", c * 4, 0.0, recompute),
        ("swap-only-margin10" if recompute else "margin10", c, 0.10, False),
        ("all", c, ALL, False),
    ]
    policies: list[Policy] = []
    seen: set[tuple] = set()
    for name, weight, margin, allow in variants:
        if len(policies) >= settings.trials and name != "all":
            continue
        if name == "all" and policies and all(p.feasible for p in policies) and len(policies) >= settings.trials:
            break  # the fallback is only added when some trial does not fit
        policy = _generate(ctx, name, weight, margin, allow)
        key = tuple((e.save_ordinal, e.decision, e.swap_out_at, e.swap_in_at) for e in policy.entries)
        if key in seen:
            continue
        seen.add(key)
        policies.append(policy)
    policies.sort(key=lambda p: (not p.feasible, p.shortfall_bytes, p.predicted_iteration_s))
    no_swap_peak = max(ctx.base_curve, default=0)
    return PolicySet(policies, no_swap_peak, settings.budget_bytes)


def _generate(ctx: _Context, name: str, size_weight: float, margin: float, allow_recompute: bool) -> Policy:
    s = ctx.settings
    if margin == ALL:
        chosen = _within_host_budget(ctx.candidates, s.host_budget_bytes, len(ctx.base_curve))
        planned = _place(ctx, chosen, allow_recompute)
        sim = simulate(ctx.base_curve, ctx.op_times_s, planned, s.d2h_bytes_per_s, s.h2d_bytes_per_s)
        return _to_policy(ctx, name, size_weight, margin, allow_recompute, chosen, planned, sim, 0)
    needed = max(0, max(ctx.base_curve, default=0) - s.budget_bytes)
    target = int(s.budget_bytes - s.reserve_bytes - margin * needed)
    base = np.asarray(ctx.base_curve, dtype=np.int64)
    excess = base - target
    chosen: list[Candidate] = []
    chosen_ids: set[int] = set()
    host = np.zeros(len(base) + 1, dtype=np.int64)
    host_kept = 0
    over = base > target  # ops where something has to leave the device
    over_prefix = np.concatenate(([0], np.cumsum(over)))
    best: tuple[int, list[Candidate], list[Planned], SimResult] | None = None
    rejected: set[int] = set()
    for _ in range(MAX_ROUNDS):
        reductions = reduction_list(excess.tolist(), 0) if (excess > 0).any() else []
        added = 0
        if reductions:
            for cand in score_candidates(list(ctx.candidates), reductions, size_weight):
                if cand.storage_id in chosen_ids or cand.storage_id in rejected:
                    continue
                lo, hi = cand.last_forward_use + 1, cand.first_backward_use
                if excess[lo:hi].max(initial=0) <= 0:
                    continue
                if s.host_budget_bytes is not None and host[lo:hi].max(initial=0) + cand.nbytes > s.host_budget_bytes:
                    host_kept += cand.nbytes
                    continue
                host[lo:hi] += cand.nbytes
                excess[lo:hi] -= cand.nbytes
                chosen.append(cand)
                chosen_ids.add(cand.storage_id)
                added += 1
        if not added and best is not None:
            break
        planned = _place(ctx, chosen, allow_recompute)
        sim = simulate(ctx.base_curve, ctx.op_times_s, planned, s.d2h_bytes_per_s, s.h2d_bytes_per_s)
        # a swap whose device block is released too late to cover any op above the target only loads the
        # link and delays the others: drop it and simulate again
        useless = [
            k for k, (p, o) in enumerate(zip(planned, sim.outcomes))
            if p.decision == SWAP and (not o.released or over_prefix[p.swap_in_at if p.swap_in_at >= 0 else p.first_backward_use] - over_prefix[o.release_at + 1] <= 0)
        ]
        if useless:
            drop = {chosen[k].storage_id for k in useless}
            rejected |= drop
            for k in useless:
                lo, hi = chosen[k].last_forward_use + 1, chosen[k].first_backward_use
                host[lo:hi] -= chosen[k].nbytes
            chosen = [c for c in chosen if c.storage_id not in drop]
            chosen_ids -= drop
            planned = _place(ctx, chosen, allow_recompute)
            sim = simulate(ctx.base_curve, ctx.op_times_s, planned, s.d2h_bytes_per_s, s.h2d_bytes_per_s)
        if best is None or (sim.peak_bytes, sim.iteration_s) < (best[0], best[3].iteration_s):
            best = (sim.peak_bytes, list(chosen), planned, sim)
        if sim.peak_bytes <= target:
            break
        excess = np.asarray(sim.curve, dtype=np.int64) - target
    if best is None:
        best = (0, [], [], simulate(ctx.base_curve, ctx.op_times_s, [], s.d2h_bytes_per_s, s.h2d_bytes_per_s))
    _, chosen, planned, sim = best
    planned, sim = _delay_prefetches(ctx, planned, sim, target)
    return _to_policy(ctx, name, size_weight, margin, allow_recompute, chosen, planned, sim, host_kept)


def _delay_prefetches(ctx: _Context, planned: list[Planned], sim: SimResult, target: int) -> tuple[list[Planned], SimResult]:
    """When the peak is above the target inside prefetch windows (tensors brought back early because no
    layer close to their use had spare link time), start those swap-ins after the peak instead: a stall
    is the price of fitting. Kept only while it lowers the peak."""
    s = ctx.settings
    for _ in range(MAX_ROUNDS):
        if sim.peak_bytes <= target:
            break
        k = sim.peak_op
        early = [i for i, (p, o) in enumerate(zip(planned, sim.outcomes))
                 if p.decision == SWAP and o.released and 0 <= p.swap_in_at <= k < p.first_backward_use - 1]
        if not early:
            break
        trial = [dataclasses.replace(p) for p in planned]
        for i in early:
            trial[i].swap_in_at = k + 1
        trial_sim = simulate(ctx.base_curve, ctx.op_times_s, trial, s.d2h_bytes_per_s, s.h2d_bytes_per_s)
        if trial_sim.peak_bytes >= sim.peak_bytes:
            break
        planned, sim = trial, trial_sim
    return planned, sim


def _swap_floor(ctx: _Context) -> int:
    """The lowest peak any swap policy could reach: every candidate off the device for its whole window,
    copies instant."""
    base = np.asarray(ctx.base_curve, dtype=np.int64)
    off = np.zeros(len(base) + 1, dtype=np.int64)
    for c in ctx.candidates:
        off[c.last_forward_use + 1] += c.nbytes
        off[c.first_backward_use] -= c.nbytes
    return int((base - np.cumsum(off)[:-1]).max(initial=0))


def _within_host_budget(candidates: list[Candidate], host_budget_bytes: int | None, num_ops: int) -> list[Candidate]:
    host = np.zeros(num_ops + 1, dtype=np.int64)
    chosen = []
    for cand in candidates:
        lo, hi = cand.last_forward_use + 1, cand.first_backward_use
        if host_budget_bytes is not None and host[lo:hi].max(initial=0) + cand.nbytes > host_budget_bytes:
            continue
        host[lo:hi] += cand.nbytes
        chosen.append(cand)
    return chosen


def _place(ctx: _Context, chosen: list[Candidate], allow_recompute: bool) -> list[Planned]:
    """Trigger points from each layer's spare copy time (see the module docstring). ``chosen`` is put in
    save order, the order the executor issues the copies in (the simulator's links are FIFO)."""
    chosen.sort(key=lambda c: (c.save_op_index, c.storage_id))
    s, groups, group_of, times = ctx.settings, ctx.groups, ctx.group_of, ctx.group_times_s
    spare_out = list(times)
    spare_in = list(times)
    planned: dict[int, Planned] = {}
    for cand in sorted(chosen, key=lambda c: (c.save_op_index, c.storage_id)):
        copy_s = cand.nbytes / s.d2h_bytes_per_s
        save_op = max(cand.created_at, cand.save_op_index - 1)
        g = int(group_of[save_op])
        at = save_op
        while g < len(groups) and groups[g].start < cand.first_backward_use:
            if spare_out[g] >= copy_s:
                spare_out[g] -= copy_s
                at = save_op if g == group_of[save_op] else groups[g].start
                break
            g += 1
        planned[cand.storage_id] = Planned(cand.nbytes, SWAP, cand.last_forward_use, cand.first_backward_use, swap_out_at=at)
    for cand in sorted(chosen, key=lambda c: (c.first_backward_use, c.storage_id)):
        p = planned[cand.storage_id]
        copy_s = cand.nbytes / s.h2d_bytes_per_s
        use_group = int(group_of[cand.first_backward_use])
        lowest = int(group_of[min(len(group_of) - 1, cand.last_forward_use + 1)]) + 1
        covered, g = 0.0, use_group - 1
        while g >= lowest and g >= 0:
            covered += spare_in[g]
            if covered >= copy_s:
                break
            g -= 1
        g = max(g, lowest, 0) if use_group > 0 else use_group
        uncovered_s = max(0.0, copy_s - covered)
        recompute_s = ctx.op_times_s[cand.created_at]
        if allow_recompute and cand.recompute_exact and uncovered_s > recompute_s:
            planned[cand.storage_id] = Planned(cand.nbytes, RECOMPUTE, cand.last_forward_use, cand.first_backward_use,
                                               recompute_s=recompute_s)
            continue
        need = copy_s
        for h in range(g, use_group):
            take = min(need, spare_in[h])
            spare_in[h] -= take
            need -= take
        earliest = min(groups[g].start, cand.first_backward_use) if g < use_group else cand.first_backward_use
        # just in time: the latest op from which the compute before the use covers the copy (no earlier
        # than the layer found above, which had the spare link time)
        at, ahead_s = cand.first_backward_use, 0.0
        while at > earliest and ahead_s < copy_s * s.prefetch_slack:
            at -= 1
            ahead_s += ctx.op_times_s[at]
        p.swap_in_at = max(at, cand.last_forward_use + 1)
    return [planned[c.storage_id] for c in chosen]


def _to_policy(ctx, name, size_weight, margin, allow_recompute, chosen, planned, sim: SimResult, host_kept) -> Policy:
    trace, s = ctx.trace, ctx.settings
    ordinal: dict[int, int] = {}
    keys: list[str] = []
    for tensor_id, _ in trace.saves or [(t.tensor_id, -1) for t in trace.tensors if t.saved]:
        record = trace.tensors[tensor_id]
        if record.storage_id not in ordinal:
            ordinal[record.storage_id] = len(ordinal)
            keys.append(save_key(record.dtype, record.shape))
    per_layer_count: dict[tuple[int, int], int] = {}
    layer_ordinal: dict[int, int] = {}
    for storage_id in ordinal:  # ordinals among the saves of one (micro-batch, layer), in save order
        cand_group = ctx.groups[int(ctx.group_of[max(0, trace.storages[storage_id].created_at)])]
        key = (cand_group.micro_batch, cand_group.layer)
        layer_ordinal[storage_id] = per_layer_count.get(key, 0)
        per_layer_count[key] = layer_ordinal[storage_id] + 1
    loads: dict[int, LayerLoad] = {}
    for g, t in zip(ctx.groups, ctx.group_times_s):
        loads.setdefault(g.layer, LayerLoad(g.layer)).compute_s += t
    entries = []
    for cand, p, o in zip(chosen, planned, sim.outcomes):
        saving_op = max(0, cand.save_op_index - 1)
        group = ctx.groups[int(ctx.group_of[cand.created_at])]
        record = trace.tensors[cand.save_tensor_id]
        op = trace.ops[saving_op]
        position = op.inputs.index(cand.save_tensor_id) if cand.save_tensor_id in op.inputs else (
            -(op.outputs.index(cand.save_tensor_id) + 1) if cand.save_tensor_id in op.outputs else -99)
        load = loads.setdefault(group.layer, LayerLoad(group.layer))
        if p.decision == SWAP:
            load.swap_bytes += p.nbytes
            load.d2h_s += p.nbytes / s.d2h_bytes_per_s
            load.h2d_s += p.nbytes / s.h2d_bytes_per_s
        else:
            load.recompute_bytes += p.nbytes
        entries.append(PolicyEntry(
            p.decision, p.nbytes, group.micro_batch, group.layer, group.index, ordinal.get(cand.storage_id, -1),
            layer_ordinal.get(cand.storage_id, -1), cand.save_op_index, trace.op_names[op.name_id], position,
            record.dtype, tuple(record.shape), record.nbytes, p.swap_out_at, p.last_forward_use,
            o.release_at if o.released else -1, p.swap_in_at, p.first_backward_use, o.stall_s, p.recompute_s,
        ))
    entries.sort(key=lambda e: e.save_ordinal)
    feasible = sim.peak_bytes <= s.budget_bytes
    reason = ""
    if not feasible and not any(c.last_forward_use < sim.peak_op < c.first_backward_use for c in ctx.candidates):
        op = trace.ops[sim.peak_op]
        reason = (
            f"short by {format_bytes(sim.peak_bytes - s.budget_bytes)} at op {sim.peak_op} "
            f"({trace.op_names[op.name_id]}, {op.phase}), where no swappable saved activation is waiting for "
            "backward: swapping cannot lower this peak; raise memory_budget or shrink the model state/micro-batch"
        )
    elif not feasible and (floor := _swap_floor(ctx)) > s.budget_bytes:
        reason = (
            f"short by {format_bytes(sim.peak_bytes - s.budget_bytes)}: even with every candidate off the device "
            f"for its whole window the peak would be {format_bytes(floor)}, above the budget (what is live there is "
            "not swappable: model state, temporaries, activations in use, tensors below min_swap_bytes); raise "
            "memory_budget, lower min_swap_bytes, shrink the micro-batch or add recomputation"
        )
    elif not feasible:
        op = trace.ops[sim.peak_op]
        reason = (
            f"short by {format_bytes(sim.peak_bytes - s.budget_bytes)} at op {sim.peak_op} "
            f"({trace.op_names[op.name_id]}, {op.phase}): swapping could reach {format_bytes(floor)} "
            f"with instant copies, but the host link ({s.d2h_bytes_per_s / 1e9:.3g} GB/s out, "
            f"{s.h2d_bytes_per_s / 1e9:.3g} GB/s in) cannot move enough in time"
            + (f" and host_memory_budget kept {format_bytes(host_kept)} on the device" if host_kept else "")
            + "; raise memory_budget, shrink the micro-batch or add recomputation"
        )
    return Policy(
        name=name, budget_bytes=s.budget_bytes, feasible=feasible, predicted_peak_bytes=sim.peak_bytes,
        no_swap_peak_bytes=max(ctx.base_curve, default=0), predicted_stall_s=sim.stall_s,
        predicted_recompute_s=sim.recompute_s, predicted_iteration_s=sim.iteration_s, compute_s=sim.compute_s,
        entries=entries, layers=[loads[k] for k in sorted(loads)], num_ops=len(trace.ops),
        trace_iteration=trace.iteration,
        settings={"score_c": size_weight, "margin": margin, "reserve_bytes": s.reserve_bytes,
                  "allow_recompute": allow_recompute, "min_swap_bytes": s.min_swap_bytes,
                  "d2h_bytes_per_s": s.d2h_bytes_per_s, "h2d_bytes_per_s": s.h2d_bytes_per_s},
        save_keys=keys, host_kept_bytes=host_kept, reason=reason, emulated=trace.emulated,
    )
