"""The planner's swap verdict for one stage trace, monotone by construction in the device memory and the host link.

The runtime's policy generator (``chameleon_dist.policy``) is a heuristic: a larger budget or a faster link
can move its greedy choices and its predicted stall either way. The planner needs more: more device memory
or a faster host link must never give a slower or infeasible estimate for the same layout. This module
computes the estimate so that it cannot:

1. **Fixed orders.** The swap units are the saved storages of one forward op (one layer of one micro-batch,
   or the head); every storage the policy could swap (``policy.candidates.find_candidates``) belongs to one.
   They are ranked by their copy window (the stall-free time from the unit's last forward use to its first
   backward use; ties: more bytes, then trace order), longest first (copies easiest to hide) and, as a
   second order, shortest first (the least time in host memory, where the host budget binds). The op times
   come from the cost model, so neither order depends on the budget or the link rate.
2. **A fixed placement.** A storage's swap-out is issued at the end of its last forward use; its swap-in at
   the start of the op ``lead`` ops before its first backward use (never before it left), for each ``lead``
   in ``LEADS_OPS``. Neither depends on the budget or the rate.
3. **A conservative, monotone replay** (below) gives, for the first ``k`` units of an order, the peak
   ``peak(k, rate)``, the host bytes ``host(k)`` and the stall ``stall(k, rate)``.
4. **The shortest fitting prefix.** ``k*`` is the smallest ``k`` with ``peak(k) <= budget`` and
   ``host(k) <= host budget``: a linear scan, since ``peak(k)`` need not be monotone in ``k``; it starts where
   even instant copies first fit (a bound that falls with ``k``, found by bisection) and ends where the
   host budget runs out (host bytes grow with ``k``), so it skips only prefixes that cannot fit. The
   estimate is feasible when some (order, lead) pair has a ``k*``; its stall is the least ``stall(k*)`` over
   the pairs that fit.

Why it is monotone. (a) Budget: a larger budget admits every ``k`` a smaller one admitted, so its ``k*`` is
no longer: its copies are a subset of the smaller budget's. (b) Rate: ``peak(k, rate)`` never rises with the
rate (below), so a faster link's ``k*`` is no longer either, and ``host(k)`` does not depend on the rate.
(c) ``stall(k, rate)`` never rises when copies are removed or made faster (below). So for every (order, lead)
the fitting set only grows and its stall only falls; the least stall over a growing set of pairs only
falls, and feasibility, once reached, stays.

The replay. Times are the stall-free op times ``T``. The device-to-host link is FIFO in issue order:
``done_j = max(issue_j, done_{j-1}) + bytes_j / d2h``; a storage leaves the device at the end of the first op
that ends (stall-free) at or after ``done_j`` and comes back at its swap-in op (its block is re-allocated
when the swap-in is issued). Removing a copy or shortening any copy moves no ``done`` later (a FIFO's
completions are maxima of sums of the durations ahead), so every release moves earlier or stays and the
memory curve is pointwise no higher: ``peak`` is monotone in the rate for a fixed ``k``. Releases are judged on
the stall-free timeline: stalls only delay the ops, so the real release comes no later than this one (the
peak is an upper bound) and a stall can never move a release later and raise the peak (which the runtime's
simulator, releasing on the stalled timeline, can do). The host-to-device link is FIFO too; every chosen
storage is copied back (the runtime skips the copy of one that never left; counting it keeps the set of
copies independent of the rate), issued at the actual (stalled) start of its swap-in op, and the compute
waits at the first backward use until the copy is done. Every quantity there is a maximum of sums of op
times and copy durations, so removing a copy or making one faster never delays anything: ``stall`` is
monotone. Host bytes count a storage from the op after its last forward use to its first backward use, whatever
the rate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from chameleon_dist.policy.candidates import Candidate, find_candidates
from chameleon_dist.policy.model import Infeasibility
from chameleon_dist.trace.step_trace import StepTrace

LEADS_OPS = (1, 2, 4)  # swap-in issued this many ops before the first backward use
ORDERS_LONGEST_FIRST = (True, False)  # longest copy window first (hides copies), shortest first (least host RAM)
GB = 1e9


@dataclasses.dataclass(frozen=True)
class PrefixEstimate:
    feasible: bool
    stall_s: float
    peak_bytes: int
    swapped_bytes: int
    swapped_storages: int
    units: int  # swapped units (saved storages of one forward op)
    total_units: int
    lead_ops: int
    infeasibility: Infeasibility | None = None
    reason: str = ""
    host_bytes: int = 0  # most swapped bytes in host memory at once (the chosen prefix; 0 when none fits)

    def summary(self) -> str:
        if not self.swapped_storages:
            return "no swap needed"
        return (f"swap {self.swapped_storages} saved storages of {self.units} of {self.total_units} forward ops "
                f"({self.swapped_bytes / GB:.2f} GB), swap-in {self.lead_ops} ops ahead; predicted peak "
                f"{self.peak_bytes / GB:.2f} GB, stall {self.stall_s:.3f} s")


@dataclasses.dataclass(frozen=True)
class _Inputs:
    base: np.ndarray  # no-swap live bytes after each op
    op_s: np.ndarray
    end_s: np.ndarray  # stall-free end of each op
    nbytes: np.ndarray  # candidates in issue order (last forward use, then storage id)
    last_fwd: np.ndarray
    first_bwd: np.ndarray
    rank: np.ndarray  # the candidate's unit position in the fixed order


def _inputs(trace: StepTrace, op_times_s: list[float], min_swap_bytes: int) -> tuple[list[_Inputs], int]:
    """The trace's candidates in issue order, once per fixed order of the units (``ORDERS_LONGEST_FIRST``)."""
    candidates: list[Candidate] = find_candidates(trace, min_swap_bytes, judge_recompute=False)  # (swap only)
    op_s = np.asarray(op_times_s, dtype=np.float64)
    end_s = np.cumsum(op_s)
    start_s = end_s - op_s
    units: dict[int, list[Candidate]] = {}
    for c in candidates:
        units.setdefault(c.created_at, []).append(c)

    def key(item: tuple[int, list[Candidate]]) -> tuple[float, int, int]:
        op, members = item
        window_s = min(start_s[c.first_backward_use] - end_s[c.last_forward_use] for c in members)
        return (-window_s if longest_first else window_s, -sum(c.nbytes for c in members), op)

    ordered = sorted(candidates, key=lambda c: (c.last_forward_use, c.storage_id))
    inputs = []
    for longest_first in ORDERS_LONGEST_FIRST:
        position = {op: i for i, (op, _) in enumerate(sorted(units.items(), key=key))}
        rank = np.array([position[c.created_at] for c in ordered], dtype=np.int64)
        if inputs:
            inputs.append(dataclasses.replace(inputs[0], rank=rank))
            continue
        inputs.append(_Inputs(
            base=np.asarray(trace.no_swap_memory_curve(), dtype=np.int64), op_s=op_s, end_s=end_s,
            nbytes=np.array([c.nbytes for c in ordered], dtype=np.int64),
            last_fwd=np.array([c.last_forward_use for c in ordered], dtype=np.int64),
            first_bwd=np.array([c.first_backward_use for c in ordered], dtype=np.int64), rank=rank))
    return inputs, len(units)


def _swap_in_ops(data: _Inputs, lead: int) -> np.ndarray:
    return np.maximum(data.first_bwd - lead, data.last_fwd + 1)


def _peak(data: _Inputs, chosen: np.ndarray, swap_in: np.ndarray, d2h_bytes_per_s: float) -> tuple[int, int]:
    """Peak bytes and its op with the ``chosen`` candidates swapped (see the module docstring)."""
    n = len(data.base)
    nbytes = data.nbytes[chosen]
    issue_s = data.end_s[data.last_fwd[chosen]]
    copy_s = nbytes / d2h_bytes_per_s
    ahead_s = np.cumsum(copy_s)
    done_s = np.maximum.accumulate(issue_s - (ahead_s - copy_s)) + ahead_s
    release = np.searchsorted(data.end_s, done_s, side="left")
    back = swap_in[chosen]
    off = release + 1 < back
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, release[off] + 1, nbytes[off])
    np.add.at(delta, back[off], -nbytes[off])
    curve = data.base - np.cumsum(delta)[:n]
    op = int(np.argmax(curve))
    return int(curve[op]), op


def _host_peak(data: _Inputs, chosen: np.ndarray, swap_in: np.ndarray) -> int:
    """Host bytes at once: a storage from the op after its last forward use to its first backward use (the
    policy generator's accounting of ``host_budget_bytes``), whatever the rates."""
    delta = np.zeros(len(data.base) + 2, dtype=np.int64)
    np.add.at(delta, data.last_fwd[chosen] + 1, data.nbytes[chosen])
    np.add.at(delta, data.first_bwd[chosen], -data.nbytes[chosen])
    return int(np.cumsum(delta).max(initial=0))


def _stall(data: _Inputs, chosen: np.ndarray, swap_in: np.ndarray, h2d_bytes_per_s: float) -> float:
    """Compute's wait for swap-ins: FIFO copies issued at the (stalled) start of their swap-in op."""
    back = swap_in[chosen]
    uses = data.first_bwd[chosen]
    copy_s = data.nbytes[chosen] / h2d_bytes_per_s
    order = np.lexsort((uses, back))
    start_s = data.end_s - data.op_s
    events = sorted([(int(back[j]), 0, j) for j in order] + [(int(uses[j]), 1, j) for j in range(len(uses))])
    done_s = np.zeros(len(uses))
    link_free_s = stall_s = 0.0
    for op, kind, j in events:
        now_s = start_s[op] + stall_s
        if kind == 0:
            done_s[j] = link_free_s = max(now_s, link_free_s) + copy_s[j]
        elif done_s[j] > now_s:
            stall_s += done_s[j] - now_s
    return float(stall_s)


@dataclasses.dataclass(frozen=True)
class _Fit:
    lead: int
    k: int  # units swapped; -1: none fits
    peak_bytes: int
    peak_op: int
    host_limited: bool


def _instant_peak(data: _Inputs, chosen: np.ndarray, swap_in: np.ndarray) -> int:
    """The peak with instant copies: a lower bound of ``_peak`` that never rises with more units."""
    n = len(data.base)
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, data.last_fwd[chosen] + 1, data.nbytes[chosen])
    np.add.at(delta, swap_in[chosen], -data.nbytes[chosen])
    return int((data.base - np.cumsum(delta)[:n]).max(initial=0))


def _first(low: int, high: int, holds) -> int:
    """The smallest ``k`` in ``[low, high]`` where the monotone predicate ``holds`` (``high + 1``: none)."""
    while low <= high:
        mid = (low + high) // 2
        if holds(mid):
            high = mid - 1
        else:
            low = mid + 1
    return low


def _shortest_fit(data: _Inputs, total_units: int, lead: int, budget_bytes: int, host_budget_bytes: int | None,
                  d2h_bytes_per_s: float) -> _Fit:
    """The smallest ``k`` whose replay fits device and host. The scan skips only the ``k`` that cannot fit:
    below ``k0`` even instant copies exceed the budget (that bound falls with ``k``), above ``k_host`` the
    host budget is exceeded (host bytes grow with ``k``)."""
    swap_in = _swap_in_ops(data, lead)
    base_peak = int(data.base.max(initial=0))
    if base_peak <= budget_bytes:
        return _Fit(lead, 0, base_peak, int(np.argmax(data.base)), False)

    def chosen(k: int) -> np.ndarray:
        return np.flatnonzero(data.rank < k)

    k0 = _first(1, total_units, lambda k: _instant_peak(data, chosen(k), swap_in) <= budget_bytes)
    k_host = total_units
    if host_budget_bytes is not None:
        k_host = _first(1, total_units, lambda k: _host_peak(data, chosen(k), swap_in) > host_budget_bytes) - 1
    for k in range(k0, k_host + 1):
        peak, op = _peak(data, chosen(k), swap_in, d2h_bytes_per_s)
        if peak <= budget_bytes:
            return _Fit(lead, k, peak, op, False)
    last = max(1, min(total_units, k_host))
    peak, op = _peak(data, chosen(last), swap_in, d2h_bytes_per_s)
    return _Fit(lead, -1, peak, op, k_host < total_units)


def estimate_prefix(trace: StepTrace, op_times_s: list[float], budget_bytes: int, d2h_bytes_per_s: float,
                    h2d_bytes_per_s: float, host_budget_bytes: int | None = None,
                    min_swap_bytes: int = 0) -> PrefixEstimate:
    """The monotone swap estimate of one stage trace (module docstring)."""
    orders, total_units = _inputs(trace, op_times_s, min_swap_bytes)
    fits = [(data, _shortest_fit(data, total_units, lead, budget_bytes, host_budget_bytes, d2h_bytes_per_s))
            for data in orders for lead in LEADS_OPS]
    best: tuple[float, _Inputs, _Fit, np.ndarray] | None = None
    for data, fit in fits:
        if fit.k < 0:
            continue
        chosen = np.flatnonzero(data.rank < fit.k)
        stall = _stall(data, chosen, _swap_in_ops(data, fit.lead), h2d_bytes_per_s) if fit.k else 0.0
        if best is None or stall < best[0]:
            best = (stall, data, fit, chosen)
    if best is not None:
        stall, data, fit, chosen = best
        return PrefixEstimate(True, stall, fit.peak_bytes, int(data.nbytes[chosen].sum()), len(chosen), fit.k,
                              total_units, fit.lead, host_bytes=_host_peak(data, chosen, _swap_in_ops(data, fit.lead)))
    data, first = next(((d, f) for d, f in fits if f.host_limited), fits[0])
    cause, reason = _why_not(data, first, budget_bytes, host_budget_bytes, d2h_bytes_per_s, h2d_bytes_per_s)
    return PrefixEstimate(False, 0.0, first.peak_bytes, int(data.nbytes.sum()), len(data.nbytes), total_units,
                          total_units, first.lead, cause, reason)


def _floor_bytes(data: _Inputs) -> int:
    """Every candidate off the device for its whole window, copies instant: no policy gets lower."""
    n = len(data.base)
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, data.last_fwd + 1, data.nbytes)
    np.add.at(delta, data.first_bwd, -data.nbytes)
    return int((data.base - np.cumsum(delta)[:n]).max(initial=0))


def _why_not(data: _Inputs, fit: _Fit, budget_bytes: int, host_budget_bytes: int | None, d2h_bytes_per_s: float,
             h2d_bytes_per_s: float) -> tuple[Infeasibility, str]:
    short = f"predicted peak {fit.peak_bytes / GB:.2f} GB, budget {budget_bytes / GB:.2f} GB"
    if fit.host_limited:
        return Infeasibility.HOST_BUDGET, (
            f"{short}: the copies that would fit the device need more host memory than host_memory_budget "
            f"({(host_budget_bytes or 0) / GB:.2f} GB per device); raise host memory or host_swap_fraction")
    waiting = (data.last_fwd < fit.peak_op) & (fit.peak_op < data.first_bwd)
    if not waiting.any():
        return Infeasibility.NO_SWAPPABLE_AT_PEAK, (
            f"{short}: at op {fit.peak_op} no swappable saved activation is waiting for backward; swapping "
            "cannot lower this peak")
    floor = _floor_bytes(data)
    if floor > budget_bytes:
        return Infeasibility.SWAP_FLOOR_ABOVE_BUDGET, (
            f"{short}: even with every candidate off the device for its whole window and instant copies the "
            f"peak would be {floor / GB:.2f} GB")
    return Infeasibility.LINK_TOO_SLOW, (
        f"{short}: instant copies could reach {floor / GB:.2f} GB, but the host link "
        f"({d2h_bytes_per_s / GB:.3g} GB/s out, {h2d_bytes_per_s / GB:.3g} GB/s in) cannot move enough in time")


__all__ = ["LEADS_OPS", "PrefixEstimate", "estimate_prefix"]
