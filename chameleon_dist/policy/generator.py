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
   assumed), the simulated curve's excess drives another selection round;
5. the round with the lowest peak becomes a ``Policy`` (policy/assemble.py).

Deterministic: the same trace and settings give the same policies.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from chameleon_dist.policy.assemble import to_policy
from chameleon_dist.policy.candidates import Candidate, find_candidates, reduction_list, score_candidates
from chameleon_dist.policy.inputs import Context, PolicySettings, Variant, variants
from chameleon_dist.policy.layers import calibrated_group_times_s, logical_layers, op_times_s as spread
from chameleon_dist.policy.model import Decision, Policy
from chameleon_dist.policy.simulator import Outcome, Planned, SimResult
from chameleon_dist.trace.step_trace import StepTrace

logger = logging.getLogger(__name__)

MAX_ROUNDS = 12


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
class _Best:
    """A selection with its placement and simulation: ``chosen[k]`` became ``planned[k]`` and ended as
    ``sim.outcomes[k]``."""

    chosen: list[Candidate]
    planned: list[Planned]
    sim: SimResult

    def beaten_by(self, sim: SimResult) -> bool:
        """Lower peak first, then faster."""
        return (sim.peak_bytes, sim.iteration_s) < (self.sim.peak_bytes, self.sim.iteration_s)


@dataclasses.dataclass
class _Selection:
    """The greedy selection's running state for one variant (module docstring, steps 2 and 4)."""

    excess_bytes: np.ndarray  # per op, bytes still above the target once the chosen candidates are off
    host_bytes: np.ndarray  # per op, host bytes the chosen candidates hold
    chosen: list[Candidate] = dataclasses.field(default_factory=list)
    chosen_ids: set[int] = dataclasses.field(default_factory=set)
    rejected_ids: set[int] = dataclasses.field(default_factory=set)  # dropped as useless: never taken again
    host_kept_bytes: int = 0  # candidates skipped because the host budget was full


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
    ctx = Context(
        trace=trace, settings=settings, groups=groups, group_of=group_of, group_times_s=group_times,
        op_times_s=per_op, base_curve=trace.no_swap_memory_curve(),
        candidates=find_candidates(trace, settings.min_swap_bytes),
    )
    policies: list[Policy] = []
    seen: set[tuple] = set()
    for variant in variants(settings):
        enough = len(policies) >= settings.trials
        if enough and not variant.take_every_candidate:
            continue
        if variant.take_every_candidate and enough and all(p.feasible for p in policies):
            break  # the fallback is only added when some trial does not fit
        policy = _generate(ctx, variant)
        key = tuple((e.save_ordinal, e.decision, e.swap_out_at, e.swap_in_at) for e in policy.entries)
        if key in seen:
            continue
        seen.add(key)
        policies.append(policy)
    policies.sort(key=lambda p: (not p.feasible, p.shortfall_bytes, p.predicted_iteration_s))
    no_swap_peak = max(ctx.base_curve, default=0)
    return PolicySet(policies, no_swap_peak, settings.budget_bytes)


def _generate(ctx: Context, variant: Variant) -> Policy:
    if variant.take_every_candidate:
        chosen = _within_host_budget(ctx.candidates, ctx.settings.host_budget_bytes, len(ctx.base_curve))
        planned = _place(ctx, chosen, variant)
        # (what the host budget leaves out here is not counted in ``host_kept_bytes``)
        return to_policy(ctx, variant, chosen=chosen, planned=planned, sim=ctx.simulate(planned), host_kept_bytes=0)
    s = ctx.settings
    needed_bytes = max(0, max(ctx.base_curve, default=0) - s.budget_bytes)
    target_bytes = int(s.budget_bytes - s.reserve_bytes - variant.margin * needed_bytes)
    best, host_kept_bytes = _select(ctx, variant, target_bytes)
    planned, sim = _delay_prefetches(ctx, best.planned, best.sim, target_bytes)
    return to_policy(ctx, variant, chosen=best.chosen, planned=planned, sim=sim, host_kept_bytes=host_kept_bytes)


def _select(ctx: Context, variant: Variant, target_bytes: int) -> tuple[_Best, int]:
    """Selection rounds until the simulated peak reaches the target, nothing more can be added, or
    ``MAX_ROUNDS``; returns the lowest-peak round and the bytes the host budget kept on the device."""
    base = np.asarray(ctx.base_curve, dtype=np.int64)
    sel = _Selection(excess_bytes=base - target_bytes, host_bytes=np.zeros(len(base) + 1, dtype=np.int64))
    over = base > target_bytes  # ops where something has to leave the device
    over_prefix = np.concatenate(([0], np.cumsum(over)))
    best: _Best | None = None
    for _ in range(MAX_ROUNDS):
        added = _add_candidates(ctx, sel, variant.size_weight)
        if not added and best is not None:
            break
        planned = _place(ctx, sel.chosen, variant)
        sim = ctx.simulate(planned)
        if _drop_useless(sel, planned, sim.outcomes, over_prefix):
            planned = _place(ctx, sel.chosen, variant)
            sim = ctx.simulate(planned)
        if best is None or best.beaten_by(sim):
            best = _Best(list(sel.chosen), planned, sim)
        if sim.peak_bytes <= target_bytes:
            break
        sel.excess_bytes = np.asarray(sim.curve, dtype=np.int64) - target_bytes
    assert best is not None  # the first round always simulates
    return best, sel.host_kept_bytes


def _add_candidates(ctx: Context, sel: _Selection, size_weight: float) -> int:
    """One greedy round in Eq. 2 score order: a candidate is taken while some op inside its window still
    has bytes to remove, and removes its bytes there (host budget permitting). Returns how many it took."""
    excess, host, host_budget = sel.excess_bytes, sel.host_bytes, ctx.settings.host_budget_bytes
    reductions = reduction_list(excess.tolist(), 0) if (excess > 0).any() else []
    if not reductions:
        return 0
    added = 0
    for cand in score_candidates(list(ctx.candidates), reductions, size_weight):
        if cand.storage_id in sel.chosen_ids or cand.storage_id in sel.rejected_ids:
            continue
        lo, hi = cand.last_forward_use + 1, cand.first_backward_use
        if excess[lo:hi].max(initial=0) <= 0:
            continue
        if host_budget is not None and host[lo:hi].max(initial=0) + cand.nbytes > host_budget:
            sel.host_kept_bytes += cand.nbytes
            continue
        host[lo:hi] += cand.nbytes
        excess[lo:hi] -= cand.nbytes
        sel.chosen.append(cand)
        sel.chosen_ids.add(cand.storage_id)
        added += 1
    return added


def _drop_useless(sel: _Selection, planned: list[Planned], outcomes: list[Outcome], over_prefix: np.ndarray) -> bool:
    """A swap whose device block is released too late to cover any op above the target only loads the link
    and delays the others: drop it (for good) from the selection. ``sel.chosen`` must be in ``planned``'s
    order (``_place`` sorts it). Returns whether anything was dropped."""
    useless = [
        k for k, (p, o) in enumerate(zip(planned, outcomes))
        if p.decision == Decision.SWAP and (
            not o.released
            or over_prefix[p.swap_in_at if p.swap_in_at >= 0 else p.first_backward_use] - over_prefix[o.release_at + 1] <= 0
        )
    ]
    if not useless:
        return False
    drop = {sel.chosen[k].storage_id for k in useless}
    sel.rejected_ids |= drop
    for k in useless:
        lo, hi = sel.chosen[k].last_forward_use + 1, sel.chosen[k].first_backward_use
        sel.host_bytes[lo:hi] -= sel.chosen[k].nbytes
    sel.chosen = [c for c in sel.chosen if c.storage_id not in drop]
    sel.chosen_ids -= drop
    return True


def _delay_prefetches(ctx: Context, planned: list[Planned], sim: SimResult, target_bytes: int) -> tuple[list[Planned], SimResult]:
    """When the peak is above the target inside prefetch windows (tensors brought back early because no
    layer close to their use had spare link time), start those swap-ins after the peak instead: a stall
    is the price of fitting. Kept only while it lowers the peak."""
    for _ in range(MAX_ROUNDS):
        if sim.peak_bytes <= target_bytes:
            break
        k = sim.peak_op
        early = [i for i, (p, o) in enumerate(zip(planned, sim.outcomes))
                 if p.decision == Decision.SWAP and o.released and 0 <= p.swap_in_at <= k < p.first_backward_use - 1]
        if not early:
            break
        trial = [dataclasses.replace(p) for p in planned]
        for i in early:
            trial[i].swap_in_at = k + 1
        trial_sim = ctx.simulate(trial)
        if trial_sim.peak_bytes >= sim.peak_bytes:
            break
        planned, sim = trial, trial_sim
    return planned, sim


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


def _place(ctx: Context, chosen: list[Candidate], variant: Variant) -> list[Planned]:
    """Trigger points from each layer's spare copy time (see the module docstring), and which candidates
    are recomputed instead (``_recomputed``). ``chosen`` is put in save order, the order the executor
    issues the copies in (the simulator's links are FIFO)."""
    chosen.sort(key=lambda c: (c.save_op_index, c.storage_id))
    s, groups, group_of, times = ctx.settings, ctx.groups, ctx.group_of, ctx.group_times_s
    recompute = _recomputed(ctx, chosen, variant)
    spare_out = list(times)
    spare_in = list(times)
    planned: dict[int, Planned] = {}
    for cand in chosen:
        copy_s = cand.nbytes / s.d2h_bytes_per_s
        if cand.storage_id in recompute:
            continue
        save_op = _save_op(cand)
        g = int(group_of[save_op])
        at, hidden = save_op, False
        while g < len(groups) and groups[g].start < cand.first_backward_use:
            if spare_out[g] >= copy_s:
                spare_out[g] -= copy_s
                at, hidden = (save_op if g == group_of[save_op] else groups[g].start), True
                break
            g += 1
        if not hidden and variant.allow_recompute and cand.recompute_exact and \
                ctx.op_times_s[cand.created_at] < copy_s:
            recompute.add(cand.storage_id)  # no layer has the copy time: rebuilding is cheaper than waiting
            continue
        planned[cand.storage_id] = Planned(
            nbytes=cand.nbytes, decision=Decision.SWAP, last_forward_use=cand.last_forward_use,
            first_backward_use=cand.first_backward_use, swap_out_at=at,
        )
    # an input of a recomputed tensor is needed (back on the device) when that tensor is rebuilt
    needed_at = {c.storage_id: c.first_backward_use for c in chosen}
    for cand in sorted(chosen, key=lambda c: (c.first_backward_use, c.storage_id)):
        use = needed_at[cand.storage_id]
        copy_s = cand.nbytes / s.h2d_bytes_per_s
        use_group = int(group_of[use])
        lowest = int(group_of[min(len(group_of) - 1, cand.last_forward_use + 1)]) + 1
        covered, g = 0.0, use_group - 1  # the layers before the use whose spare link time hides the copy
        while g >= lowest and g >= 0:
            covered += spare_in[g]
            if covered >= copy_s:
                break
            g -= 1
        if cand.storage_id in recompute or (
            variant.allow_recompute and cand.recompute_exact and copy_s - covered > ctx.op_times_s[cand.created_at]
        ):
            recompute.add(cand.storage_id)
            planned[cand.storage_id] = Planned(
                nbytes=cand.nbytes, decision=Decision.RECOMPUTE, last_forward_use=cand.last_forward_use,
                first_backward_use=use, recompute_s=ctx.op_times_s[cand.created_at],
                transient_bytes=_rebuild_transient_bytes(ctx.trace, cand),
            )
            for storage_id in cand.recompute_inputs:
                if storage_id in needed_at:
                    needed_at[storage_id] = min(needed_at[storage_id], use)
            continue
        p = planned[cand.storage_id]
        p.first_backward_use = use
        if p.swap_out_at >= use:  # a recomputed tensor needs it earlier than the copy-out was placed for
            p.swap_out_at = _save_op(cand)
        g = max(g, lowest, 0) if use_group > 0 else use_group
        need = copy_s
        for h in range(g, use_group):
            take = min(need, spare_in[h])
            spare_in[h] -= take
            need -= take
        earliest = min(groups[g].start, use) if g < use_group else use
        # just in time: the latest op from which the compute before the use covers the copy (no earlier
        # than the layer found above, which had the spare link time)
        at, ahead_s = use, 0.0
        while at > earliest and ahead_s < copy_s * s.prefetch_slack:
            at -= 1
            ahead_s += ctx.op_times_s[at]
        p.swap_in_at = max(at, cand.last_forward_use + 1, p.swap_out_at + 1)  # (never back before it left)
    return [planned[c.storage_id] for c in chosen]


def _save_op(cand: Candidate) -> int:
    """The op at whose end a swap-out of ``cand`` can be issued first."""
    return max(cand.created_at, cand.save_op_index - 1)


def _recomputed(ctx: Context, chosen: list[Candidate], variant: Variant) -> set[int]:
    """Candidates recomputed before any copy time is placed: with ``prefer_recompute``, every exact one whose
    rebuild takes less than its copy; else, when the chosen copies need more link time (either direction)
    than the whole iteration gives, the exact ones cheapest to rebuild per byte until the rest fits."""
    if not variant.allow_recompute:
        return set()
    s, times = ctx.settings, ctx.op_times_s
    exact = [c for c in chosen if c.recompute_exact]
    if variant.prefer_recompute:
        return {c.storage_id for c in exact if times[c.created_at] < c.nbytes / s.d2h_bytes_per_s}
    supply_s = sum(times)
    rate = min(s.d2h_bytes_per_s, s.h2d_bytes_per_s)
    demand_s = sum(c.nbytes for c in chosen) / rate
    recompute: set[int] = set()
    for c in sorted(exact, key=lambda c: (times[c.created_at] / c.nbytes, c.storage_id)):
        if demand_s <= supply_s:
            break
        recompute.add(c.storage_id)
        demand_s -= c.nbytes / rate
    return recompute


def _rebuild_transient_bytes(trace: StepTrace, cand: Candidate) -> int:
    """The bytes a rebuild of ``cand`` allocates besides ``cand`` itself: its producer's other outputs (a
    replay computes every output; the executor keeps one and drops the rest), on the device during the
    rebuild."""
    own = {cand.storage_id}
    other: dict[int, int] = {}
    for t in trace.ops[cand.created_at].outputs:
        storage_id = trace.tensors[t].storage_id
        if storage_id not in own:
            other[storage_id] = trace.storages[storage_id].nbytes
    return sum(other.values())
