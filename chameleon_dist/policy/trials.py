"""GenPolicy trials: which policies are tried in what order, which trial held, and which one Stable keeps.

Pure functions over ``TrialResult`` lists; ``PolicyController`` (``policy/selection.py``) owns the state and
calls them. They live apart so that the rules a tight budget depends on are in one short place:

- **Order.** Policies predicted to fit are tried, fastest predicted first. When none is (a budget just
  under the peak on a slow link: the generator says the link cannot move enough in time), every policy
  is tried, the smallest predicted shortfall first: passive swap absorbs the remainder, and the trial
  measures whether that beats swapping every eligible tensor (rather than swapping everything for good
  after one such policy failed, 12-23x the unconstrained time to save a fraction of a percent of memory).
- **Held.** A trial holds when it completed without an out-of-memory retry and its peak stayed within what
  a policy must stay under. A policy predicted to fit must also need no passive swap (one that did
  missed, and the next policies aim lower by what it missed); a policy predicted short was tried knowing
  that passive swap takes the remainder, so its passive swaps are its expected cost, measured in its time.
- **Choice.** The fastest policy that held with headroom, compared on measured iteration time with the
  swap-everything executor's (measured in WarmUp), with a noise margin (``policy.ranking``): within it, the
  policy that swaps less wins and a close pair is tried again; swapping everything is the last resort, kept
  only when it was measured faster than every policy that held by more than the margin.
- **Feedback.** What a trial missed (its peak over its prediction, the bytes passive swap moved under a
  policy predicted to fit) makes the next policies aim that much lower; a trial that stalled for op times
  the trace had wrong rescales them (``trial_feedback``, ``compute_only``).
"""

from __future__ import annotations

import dataclasses

from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.policy.ranking import DEFAULT_TRIAL_MARGIN, rank, standings, to_repeat
from chameleon_dist.trace.step_trace import StepTrace

STALL_TOLERANCE = 0.02  # of the iteration: more unpredicted stall than this triggers a timing rescale
TIME_TOLERANCE = 0.25  # ... when the measured compute time is this far from the trace's

MIN_COMPUTE_SHARE = 1 / 20
"""The profiled iteration's compute time is taken as at least this share of its measured time, however
much of it the swap-everything executor stalled."""

PASSIVE_SWAP_SLACK = 2.0
"""A Stable iteration under a policy predicted short may passive-swap up to this many times the bytes its
trials passive-swapped before the runtime profiles again. Passive swap moves whole tensors (best fit
first), so one more tensor of the size its trials moved doubles a one-tensor volume; more than that says
the policy no longer describes the job."""


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """One GenPolicy trial: a policy, what it measured, and whether it held (``trial_held``)."""

    policy: Policy
    iteration_s: float
    peak_bytes: int
    held: bool
    passive_swap_bytes: int = 0  # what passive swap moved in the attempt that completed


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``choose`` keeps: ``best`` (None: swap every eligible tensor), the headroom it was judged with,
    whether ``best`` had that headroom, and whether swapping everything was measured faster than every
    policy that held (then ``best`` is None although some held)."""

    best: TrialResult | None
    headroom_bytes: int
    roomy: bool
    swap_all_faster: bool
    repeat: Policy | None = None  # a close pair's policy to try again before settling (``policy.ranking.to_repeat``)


@dataclasses.dataclass(frozen=True)
class TrialFeedback:
    """What one trial tells the next generation (``trial_feedback``): ``time_ratio``, the measured compute
    time over the policy's when the trace's op times were off (None: they were not), ``miss_bytes``, how
    much lower the next policies aim (0: no miss), with ``miss`` saying why in words, and
    ``explore_bytes``, how much lower the next policies of this GenPolicy stage only aim (a policy
    predicted short that held with passive swaps)."""

    time_ratio: float | None
    miss_bytes: int
    miss: str
    explore_bytes: int = 0


def compute_only(trace: StepTrace, stall_s: float, time_scale: float) -> StepTrace:
    """``trace`` with every time scaled to compute only, which is what the trials' policies are generated
    from: the profiled iteration's ``stall_s`` were the swap-everything executor's waits, and
    ``time_scale`` is what earlier trials measured of the trace's op times (``trial_feedback``). Measured
    layer times are compute only already (``LayerTimes.resolve`` leaves out the waits on copies inside each
    layer): they take ``time_scale`` alone. (Shrinking them by the iteration's stall share too made Llama2-7B's
    forward look a third of its length to the generator, which then found no policy to fit.)"""
    compute_s = max(trace.iteration_s - stall_s, trace.iteration_s * MIN_COMPUTE_SHARE)
    scale = compute_s * time_scale / max(trace.iteration_s, 1e-12)
    return dataclasses.replace(
        trace, iteration_s=trace.iteration_s * scale,
        layer_times_s={layer: t * time_scale for layer, t in trace.layer_times_s.items()},
    )


def trial_feedback(outcome: IterationOutcome, budget_bytes: int, unknown_miss_bytes: int, grew: bool) -> TrialFeedback:
    """What ``outcome``, a trial of ``outcome.policy``, feeds back into the next generation:

    - a policy that went over the budget, or one predicted to fit that needed passive swaps, makes the
      next ones aim lower by as much as it missed (the peak over its prediction; the bytes passive swap
      moved, ``unknown_miss_bytes`` when those are not known): the simulator's error narrows the next
      attempt, and the trials go on. Not when the iteration ``grew`` (saved more than the traced one: the
      miss is the shape's);
    - a policy predicted short that held with passive swaps missed nothing it promised, but passive swap
      copies synchronously at the peak and fetches back on demand, where a planned swap overlaps compute:
      the next policies of the same stage aim lower by the bytes passive swap moved (``explore_bytes``),
      so the trials also measure policies that plan what passive swap had to do (the generator still
      predicts them short; the measured time decides);
    - a policy that stalled more than predicted because the trace's op times were off (the profiled
      iteration ran with the detailed recorder, whose cost is not the job's) rescales the op times by the
      compute time this iteration actually took. A link-bound trial (stalled half its time or more) says
      little about compute and rescales nothing."""
    policy, iteration_s, stall_s = outcome.policy, outcome.iteration_s, outcome.stall_s
    assert policy is not None  # a trial applies a policy
    ratio = max(iteration_s - stall_s, 1e-9) / max(policy.compute_s, 1e-9)
    stalled = policy.predicted_stall_s + STALL_TOLERANCE * iteration_s < stall_s < iteration_s / 2
    time_ratio = ratio if stalled and abs(ratio - 1) > TIME_TOLERANCE else None
    if grew:
        return TrialFeedback(time_ratio, 0, "")
    if outcome.peak_device_bytes > budget_bytes and outcome.peak_device_bytes > policy.predicted_peak_bytes:
        return TrialFeedback(time_ratio, outcome.peak_device_bytes - max(policy.predicted_peak_bytes, 1),
                             "peaked above its prediction by")
    if outcome.passive_swaps and not outcome.oom_retries and policy.feasible:
        return TrialFeedback(time_ratio, max(1, outcome.passive_swap_bytes or unknown_miss_bytes),
                             "was predicted to fit but passive swap moved")
    if outcome.passive_swaps and not outcome.oom_retries and outcome.peak_device_bytes <= budget_bytes:
        return TrialFeedback(time_ratio, 0, "held predicted short; passive swap moved", outcome.passive_swap_bytes)
    return TrialFeedback(time_ratio, 0, "")


def trial_order(policies: list[Policy]) -> list[Policy]:
    """The candidates a GenPolicy stage tries, in order: those predicted to fit (the generator's order,
    fastest first), else all of them, smallest predicted shortfall first (then fastest)."""
    feasible = [p for p in policies if p.feasible]
    return feasible or sorted(policies, key=lambda p: (p.shortfall_bytes, p.predicted_iteration_s))


def policy_key(policy: Policy) -> tuple:
    """What makes two policies the same plan (the generator's own duplicate test): a regeneration that
    comes back with a policy already tried has nothing new to measure."""
    return tuple((e.save_ordinal, e.decision, e.swap_out_at, e.swap_in_at) for e in policy.entries)


def next_trial(candidates: list[Policy], results: list[TrialResult]) -> Policy | None:
    """The next candidate whose plan was not tried yet in this GenPolicy stage (cycling when all were)."""
    if not candidates:
        return None
    tried = {policy_key(r.policy) for r in results}
    fresh = [p for p in candidates if policy_key(p) not in tried]
    return fresh[0] if fresh else candidates[len(results) % len(candidates)]


def trial_held(policy: Policy, peak_bytes: int, allowed_peak_bytes: int, passive_swaps: int, oom_retries: int) -> bool:
    """Whether a trial of ``policy`` held (module docstring): no out-of-memory retry, the peak within
    ``allowed_peak_bytes``, and no passive swap unless the policy was predicted short."""
    if oom_retries or peak_bytes > allowed_peak_bytes:
        return False
    return not passive_swaps or not policy.feasible


def fastest_fitting_else_lowest(policies: list[Policy]) -> Policy:
    """The policy applied without trials (scaling for a new shape, tightening in place): the fastest
    predicted to fit, else the one predicted lowest."""
    feasible = [p for p in policies if p.feasible]
    if feasible:
        return min(feasible, key=lambda p: p.predicted_iteration_s)
    return min(policies, key=lambda p: p.predicted_peak_bytes)


def peak_variation_bytes(results: list[TrialResult]) -> int:
    """How much the peak of one policy moved between its trials (timing jitter, routing, shapes): the
    largest spread over the policies tried more than once, 0 when none was. (Not the spread of prediction
    errors across policies: a policy predicted far off, such as swapping everything on a slow link, would
    make every fast one look short of room.)"""
    peaks: dict[int, list[int]] = {}
    for r in results:
        peaks.setdefault(id(r.policy), []).append(r.peak_bytes)
    return max((max(p) - min(p) for p in peaks.values() if len(p) > 1), default=0)


def choose(results: list[TrialResult], allowed_peak_bytes: int, swap_all_iteration_s: float | None,
           margin: float = DEFAULT_TRIAL_MARGIN) -> Choice:
    """What to keep from ``results`` (``policy.ranking``): per policy, its fastest trial and highest peak, held
    only when every trial held; among those with headroom (the peak plus ``peak_variation_bytes`` within
    ``allowed_peak_bytes``; every held one when none has it), the one that swaps least within ``margin`` of
    the fastest; none when none held or when ``swap_all_iteration_s`` (the swap-everything executor's measured
    iteration time, None when not measured on this sequence) is faster than every policy that held by more
    than ``margin``. ``Choice.repeat`` names the policy to try again when the ranking is contested."""
    headroom_bytes = peak_variation_bytes(results)
    ranked = rank(standings(results), allowed_peak_bytes, headroom_bytes, swap_all_iteration_s, margin)
    best = ranked.best
    kept = TrialResult(best.policy, best.iteration_s, best.peak_bytes, True, best.passive_swap_bytes) if best else None
    return Choice(kept, headroom_bytes, roomy=ranked.roomy, swap_all_faster=ranked.swap_all_faster,
                  repeat=to_repeat(ranked))


def expected_passive_swap_bytes(results: list[TrialResult], policy: Policy) -> int:
    """The passive-swap bytes ``policy``'s held trials measured (the most of them): what a policy predicted
    short costs by design. 0 for a policy predicted to fit (none of its trials held with passive swaps)
    and for a policy without trials (scaled or tightened in place)."""
    return max((r.passive_swap_bytes for r in results if r.held and r.policy is policy), default=0)


def passive_swaps_expected(results: list[TrialResult], policy: Policy, passive_swap_bytes: int) -> bool:
    """Whether ``passive_swap_bytes`` (an iteration's under ``policy``) is what its trials measured, within
    ``PASSIVE_SWAP_SLACK``: then they are the remainder passive swap was chosen to absorb, not a failure."""
    expected_bytes = expected_passive_swap_bytes(results, policy)
    return expected_bytes > 0 and 0 < passive_swap_bytes <= PASSIVE_SWAP_SLACK * expected_bytes
