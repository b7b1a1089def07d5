"""Ranking GenPolicy trials whose times are measured (issue 37 item 6).

A trial is one iteration, and a measured iteration time carries noise: on a GPU the host's launch jitter, other
processes, clocks; on the emulated device with measured host time the same, from this CPU. Ranking such trials
by their bare times picks whichever happened to run in a quiet moment, and a Stable policy that differs from
one run to the next. So trials are ranked with a margin (``TrialRanking.margin``, ``profiler.trial_margin``, a
fraction of the fastest time):

- **Per policy**, its fastest held trial stands for it (noise only adds): its time and its peak; a trial that
  did not hold counts for nothing (its time is not the policy's).
- **Within the margin of the fastest**, the policy that swaps less wins (fewer swapped bytes, then fewer
  recomputed, then the faster): it moves less over the link and leaves more of it to the others, for what
  noise cannot tell apart. A policy clearly faster (more than the margin) wins however much it swaps.
- **Swapping everything** (the last resort, measured in WarmUp) is kept only when clearly faster than every
  policy that held; within the margin a policy swaps less, so the policy wins.
- **A close pair is tried again.** When the two rules disagree (the fastest is not the one that swaps least
  within the margin, or swapping everything was a little faster), the pair is unsettled: the policy kept so far
  and the fastest are tried again (the one with fewer trials first, the kept one on a tie: its repeat also
  measures how much its peak moves, the headroom it is judged with), up to ``TrialRanking.max_repeats``
  extra GenPolicy iterations (``profiler.trial_repeats``).

With a fixed host cost per op (``device.host_op_s``) the emulated device's times repeat exactly: the runtime
ranks with no margin and no repeats there (the fastest wins, as measured; ``runtime.py``).

Headroom (``peak_variation_bytes``, ``policy.trials``) is applied before the margin: the pool ranked is the
policies whose peak plus headroom stays under what a policy must stay under, or every held one when none does.
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.policy.model import Decision, Policy

DEFAULT_TRIAL_MARGIN = 0.03
DEFAULT_TRIAL_REPEATS = 2


@dataclasses.dataclass(frozen=True)
class TrialRanking:
    """How the controller ranks trials: ``margin``, the fraction of the fastest trial's time within which trials
    count as equally fast (``profiler.trial_margin``), and ``max_repeats``, how many extra GenPolicy iterations
    may try a close pair again (``profiler.trial_repeats``)."""

    margin: float = DEFAULT_TRIAL_MARGIN
    max_repeats: int = DEFAULT_TRIAL_REPEATS

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.margin < 1:
            problems.append(f"profiler.trial_margin must be in [0, 1), got {self.margin}")
        if self.max_repeats < 0:
            problems.append(f"profiler.trial_repeats must be >= 0, got {self.max_repeats}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclasses.dataclass(frozen=True)
class Standing:
    """One policy's trials, summarised: its fastest held trial's time and peak (its fastest trial's when none
    held), how many trials it had, whether any held, and the most bytes passive swap moved in one that held."""

    policy: Policy
    iteration_s: float
    peak_bytes: int
    trials: int
    held: bool
    passive_swap_bytes: int

    @property
    def swap_bytes(self) -> int:
        return self.policy.saved_bytes(Decision.SWAP)

    @property
    def recompute_bytes(self) -> int:
        return self.policy.saved_bytes(Decision.RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class Ranked:
    """What ``rank`` found: ``best`` (None: none held, or swapping everything was clearly faster), ``fastest``
    of the pool, ``close`` (the pool's policies within the margin of the fastest, best first), whether the pool
    had headroom (``roomy``), whether swapping everything was clearly faster (``swap_all_faster``) and whether
    the ranking is unsettled (``contested``: a close pair the rules disagree on)."""

    best: Standing | None
    fastest: Standing | None
    close: tuple[Standing, ...]
    roomy: bool
    swap_all_faster: bool
    contested: bool


def standings(results) -> list[Standing]:
    """``results`` (``TrialResult``s) per policy, in the order the policies were first tried."""
    by_policy: dict[int, list] = {}
    for r in results:
        by_policy.setdefault(id(r.policy), []).append(r)
    out = []
    for trials in by_policy.values():
        held = [r for r in trials if r.held]
        fastest = min(held or trials, key=lambda r: r.iteration_s)
        out.append(Standing(
            policy=trials[0].policy,
            iteration_s=fastest.iteration_s,
            peak_bytes=fastest.peak_bytes,
            trials=len(trials),
            held=bool(held),
            passive_swap_bytes=max((r.passive_swap_bytes for r in held), default=0),
        ))
    return out


def within(margin: float, fastest_s: float, iteration_s: float) -> bool:
    """Whether ``iteration_s`` is as fast as ``fastest_s`` within ``margin`` (a fraction of ``fastest_s``)."""
    return iteration_s <= fastest_s * (1 + margin)


def rank(policies: list[Standing], allowed_peak_bytes: int, headroom_bytes: int,
         swap_all_iteration_s: float | None, margin: float) -> Ranked:
    """The ranking rule of the module docstring over ``policies`` (``standings``); ``swap_all_iteration_s``:
    the swap-everything executor's measured time on this sequence (None: not measured)."""
    held = [s for s in policies if s.held]
    if not held:
        return Ranked(None, None, (), roomy=False, swap_all_faster=False, contested=False)
    roomy = [s for s in held if s.peak_bytes + headroom_bytes <= allowed_peak_bytes]
    pool = roomy or held
    fastest = min(pool, key=lambda s: s.iteration_s)
    close = tuple(sorted((s for s in pool if within(margin, fastest.iteration_s, s.iteration_s)),
                         key=lambda s: (s.swap_bytes, s.recompute_bytes, s.iteration_s)))
    best = close[0]
    if swap_all_iteration_s is not None and not within(margin, swap_all_iteration_s, min(s.iteration_s for s in held)):
        return Ranked(None, fastest, close, roomy=bool(roomy), swap_all_faster=True, contested=False)
    swap_all_close = swap_all_iteration_s is not None and swap_all_iteration_s < best.iteration_s
    contested = best is not fastest or swap_all_close
    return Ranked(best, fastest, close, roomy=bool(roomy), swap_all_faster=False, contested=contested)


def to_repeat(ranked: Ranked) -> Policy | None:
    """The policy a contested ranking tries again: of the kept one and the fastest, the one with fewer trials
    (the kept one on a tie). None when the ranking is settled."""
    if not ranked.contested or ranked.best is None or ranked.fastest is None:
        return None
    pair = [ranked.best, ranked.fastest]  # (the same policy twice when only swapping everything was close)
    return min(pair, key=lambda s: s.trials).policy
