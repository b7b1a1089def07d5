"""Replays an iteration with a set of swap and recompute decisions and predicts peak memory and time.

The compute stream runs the trace's ops in order, each taking its estimated duration. Two FIFO copy links
(device-to-host, host-to-device) move ``nbytes / bandwidth`` seconds per copy:

- a swap-out is issued at the end of its planned op and starts when the link is free;
- its device memory is released at the end of the first op that is at or after both its last forward
  use and its issue point *and* ends after the copy completed (never earlier: the block would be reused
  while the copy still reads it);
- a swap-in is issued at the start of its planned op and re-allocates the device memory there; when the
  first backward use comes before the copy finished, compute waits (stall). A swap-in whose swap-out was
  not released yet copies nothing: the data never left the device;
- a recomputed tensor is freed after its last forward use and rebuilt just before its first backward
  use, costing its producer's time; the producer's other outputs (``transient_bytes``) are on the device
  during that op too (the rebuild allocates them, then drops them).

Memory is the trace's no-swap curve minus the bytes that are off the device after each op.
"""

from __future__ import annotations

import dataclasses
import heapq

from chameleon_dist.policy.model import Decision


@dataclasses.dataclass(slots=True)
class Planned:
    """One decision as the simulator needs it (op indices into the trace)."""

    nbytes: int
    decision: Decision  # SWAP or RECOMPUTE (KEEP needs no plan)
    last_forward_use: int
    first_backward_use: int
    swap_out_at: int = -1  # swap-out issued at the end of this op (SWAP)
    swap_in_at: int = -1  # swap-in issued at the start of this op (SWAP); -1: on demand at first use
    recompute_s: float = 0.0  # RECOMPUTE: the producer's time
    transient_bytes: int = 0  # RECOMPUTE: the producer's other outputs, alive during the rebuild only


@dataclasses.dataclass(slots=True)
class Outcome:
    """What happened to one decision in the simulation."""

    released: bool = False
    kept: bool = False  # its swap-in came before the release: the data never left the device
    release_at: int = -1  # device memory released at the end of this op
    out_done_s: float = 0.0
    in_start_s: float = 0.0
    in_done_s: float = 0.0
    stall_s: float = 0.0


@dataclasses.dataclass
class SimResult:
    peak_bytes: int
    peak_op: int
    stall_s: float
    recompute_s: float
    iteration_s: float
    compute_s: float
    outcomes: list[Outcome]
    curve: list[int]
    op_end_s: list[float]


def simulate(
    base_curve: list[int],
    op_times_s: list[float],
    planned: list[Planned],
    d2h_bytes_per_s: float,
    h2d_bytes_per_s: float,
) -> SimResult:
    if len(base_curve) != len(op_times_s):
        raise ValueError(f"curve has {len(base_curve)} ops but timing has {len(op_times_s)}")
    if d2h_bytes_per_s <= 0 or h2d_bytes_per_s <= 0:
        raise ValueError("d2h_bytes_per_s and h2d_bytes_per_s must be positive")
    n = len(base_curve)
    outcomes = [Outcome() for _ in planned]
    out_at: dict[int, list[int]] = {}
    in_at: dict[int, list[int]] = {}
    use_at: dict[int, list[int]] = {}
    ready_at: dict[int, list[int]] = {}
    for k, p in enumerate(planned):
        if p.decision == Decision.SWAP:
            out_at.setdefault(p.swap_out_at, []).append(k)
            ready_at.setdefault(max(p.last_forward_use, p.swap_out_at), []).append(k)
            trigger = p.swap_in_at if 0 <= p.swap_in_at <= p.first_backward_use else p.first_backward_use
            in_at.setdefault(trigger, []).append(k)
        elif p.decision == Decision.RECOMPUTE:
            outcomes[k].released = True
            outcomes[k].release_at = p.last_forward_use
        use_at.setdefault(p.first_backward_use, []).append(k)
    delta = [0] * (n + 1)
    transient = [0] * n  # bytes on the device during one op only (a rebuild's other outputs)
    t = stall = recompute = 0.0
    d2h_free = h2d_free = 0.0
    pending: list[tuple[float, int]] = []
    op_end_s = [0.0] * n
    for i in range(n):
        for k in in_at.get(i, ()):
            p, o = planned[k], outcomes[k]
            if not o.released:  # the data never left: nothing to copy; drop the pending release
                o.kept = True
                continue
            o.in_start_s = max(t, h2d_free)
            o.in_done_s = h2d_free = o.in_start_s + p.nbytes / h2d_bytes_per_s
            delta[o.release_at + 1] -= p.nbytes
            delta[i] += p.nbytes
        for k in use_at.get(i, ()):
            p, o = planned[k], outcomes[k]
            if p.decision == Decision.RECOMPUTE:
                t += p.recompute_s
                recompute += p.recompute_s
                delta[o.release_at + 1] -= p.nbytes
                delta[i] += p.nbytes
                transient[i] += p.transient_bytes
            elif o.released and o.in_done_s > t:
                o.stall_s = o.in_done_s - t
                stall += o.stall_s
                t = o.in_done_s
        t += op_times_s[i]
        op_end_s[i] = t
        for k in out_at.get(i, ()):
            o = outcomes[k]
            start = max(t, d2h_free)
            o.out_done_s = d2h_free = start + planned[k].nbytes / d2h_bytes_per_s
        for k in ready_at.get(i, ()):
            heapq.heappush(pending, (outcomes[k].out_done_s, k))
        while pending and pending[0][0] <= t:
            _, k = heapq.heappop(pending)
            o = outcomes[k]
            if not o.kept and not o.released and planned[k].first_backward_use > i:
                o.released, o.release_at = True, i
    curve, running = [], 0
    peak, peak_op = -1, -1
    for i in range(n):
        running += delta[i]
        live = base_curve[i] + running + transient[i]
        curve.append(live)
        if live > peak:
            peak, peak_op = live, i
    compute = sum(op_times_s)
    return SimResult(max(peak, 0), peak_op, stall, recompute, t, compute, outcomes, curve, op_end_s)
