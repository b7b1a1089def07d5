"""How the ``PolicyController`` judges one completed iteration: an ordered table of named rules.

Each rule reads the iteration's ``IterationOutcome`` and what it needs of the controller (a
``JudgedState``) and returns a ``Judgement`` naming itself, or None to pass the iteration to the next
rule. ``judge`` applies ``RULES`` in order; the first rule that returns a judgement wins, and the last one
always does. The controller turns the judgement into the stage machine's ``Verdict`` (``rule`` carried
along into the iteration's report).

Three of the rules act before they answer: scaling the chosen policy for a grown shape, tightening it in
place and swapping everything in place (``JudgedState``'s actions). Each is asked only where it is in the
table, so a rule further down sees what a rule above it changed (an in-place tightening that found no
stricter policy sets ``no_stricter_policy``). The accounting every iteration gets (a trial recorded, the
swap-everything baseline noted) happens before the table, in ``PolicyController.record``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Protocol

from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.trace.stages import Stage
from chameleon_dist.units import format_bytes

__all__ = ["JudgedState", "Judgement", "RULES", "Rule", "SLIGHTLY_SHORT_SHARE", "judge"]

logger = logging.getLogger(__name__)

SLIGHTLY_SHORT_SHARE = 0.5
"""Near the floor (issue 27, ``NEAR_FLOOR_FACTOR``): a Stable policy whose passive swaps moved at most this share of the needed
reduction (no-swap peak - budget), where swapping everything fitted the capacity, is slightly short: it is
tightened in place (or swaps everything in place when no stricter policy is predicted) rather than profiled
again. More than that, the policy no longer describes the job."""


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What one rule decided about an iteration: the ``rule``'s name, the reason a Stable iteration went
    over what its policy must stay under and could not be absorbed ("" when it could, or did not), whether
    the completed attempt's passive swaps are ``absorbed`` and whether the chosen policy was ``tightened``
    in place."""

    rule: str
    over_budget_reason: str = ""
    absorbed: bool = False
    tightened: bool = False


class JudgedState(Protocol):
    """What the rules read of the controller, and the three actions some of them take (each answers
    whether it changed the chosen policy)."""

    @property
    def chosen(self) -> Policy | None: ...  # the policy Stable applies (None: swap every eligible tensor)

    @property
    def allowed_peak_bytes(self) -> int: ...  # what a policy must stay under

    @property
    def budget_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int | None: ...

    @property
    def needed_bytes(self) -> int: ...  # no-swap peak - budget of the latest generation's trace

    @property
    def no_stricter_policy(self) -> bool: ...  # the last in-place tightening found no policy predicted lower

    def swap_all_fits(self) -> bool: ...  # near the floor, and swapping everything fitted the capacity

    def expected_passive_swaps(self, policy: Policy, outcome: IterationOutcome) -> bool: ...

    def scale_for(self, outcome: IterationOutcome) -> bool: ...

    def tighten_in_place(self, policy: Policy, shortfall_bytes: int, reason: str,
                         peak_within_capacity: bool = False) -> bool: ...

    def swap_all_in_place(self, reason: str) -> bool: ...


Rule = Callable[[IterationOutcome, JudgedState], "Judgement | None"]


def _over_budget_reason(outcome: IterationOutcome, state: JudgedState) -> str:
    assert outcome.policy is not None
    return (f"peak {format_bytes(outcome.peak_device_bytes)} above memory_budget {format_bytes(state.budget_bytes)} "
            f"under policy {outcome.policy.name}")


def trial(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """A GenPolicy trial: its passive swaps, and its running out of memory, were fed back to the next trials
    (``PolicyController.record``'s accounting): profiling the same program again would find the same ones."""
    if outcome.stage == Stage.GEN_POLICY and outcome.policy is not None:
        return Judgement("trial", absorbed=bool(outcome.passive_swaps))
    return None


def not_stable_under_the_chosen(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Outside Stable, or swapping everything, or a policy other than the chosen one: nothing to judge
    (the passive swaps count as they are; WarmUp's restart nothing)."""
    if outcome.stage != Stage.STABLE or outcome.policy is None or outcome.policy is not state.chosen:
        return Judgement("not_stable_under_the_chosen")
    return None


def scaled_for_a_grown_shape(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """The chosen policy did not hold (passive swaps, a peak over what it must stay under) on an iteration
    that saved more than its trace, without a retry: a policy for the trace grown alike was applied."""
    failed = outcome.passive_swaps or outcome.peak_device_bytes > state.allowed_peak_bytes
    if failed and not outcome.oom_retries and state.scale_for(outcome):
        return Judgement("scaled_for_a_grown_shape", absorbed=bool(outcome.passive_swaps))
    return None


def predicted_short(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Within what it must stay under, the passive swaps of a policy predicted short are about what its
    trials measured: the remainder it was chosen to leave to passive swap."""
    assert outcome.policy is not None
    if outcome.peak_device_bytes <= state.allowed_peak_bytes and state.expected_passive_swaps(outcome.policy, outcome):
        return Judgement("predicted_short", absorbed=True)
    return None


def slightly_short_near_floor(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Near the floor, a policy slightly short (passive swaps that moved at most ``SLIGHTLY_SHORT_SHARE`` of
    the needed reduction, no retry) where swapping everything fits: tightened in place by what passive swap
    moved (and the peak over what it must stay under), else swapping everything in place. Passes when
    neither could be done."""
    policy = outcome.policy
    assert policy is not None
    if not (outcome.passive_swaps and not outcome.oom_retries and state.swap_all_fits()
            and 0 < outcome.passive_swap_bytes <= SLIGHTLY_SHORT_SHARE * state.needed_bytes):
        return None
    shortfall_bytes = max(outcome.passive_swap_bytes, outcome.peak_device_bytes - state.allowed_peak_bytes, 1)
    reason = f"{outcome.passive_swaps} passive swap(s) ({format_bytes(outcome.passive_swap_bytes)}) under policy {policy.name}"
    if state.tighten_in_place(policy, shortfall_bytes, reason, peak_within_capacity=True) or state.swap_all_in_place(reason):
        return Judgement("slightly_short_near_floor", absorbed=True, tightened=True)
    return None


def over_budget_with_passive_swaps(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Over what the policy must stay under, with passive swaps: it no longer holds (no in-place remedy)."""
    if outcome.peak_device_bytes > state.allowed_peak_bytes and outcome.passive_swaps:
        return Judgement("over_budget_with_passive_swaps", over_budget_reason=_over_budget_reason(outcome, state))
    return None


def over_budget_tightened_in_place(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Over what the policy must stay under: a stricter policy from the same trace in place, or, when none
    is predicted, swapping everything in place (near the floor). Passes when neither could be done."""
    allowed = state.allowed_peak_bytes
    if outcome.peak_device_bytes <= allowed:
        return None
    assert outcome.policy is not None
    reason = _over_budget_reason(outcome, state)
    if (state.tighten_in_place(outcome.policy, outcome.peak_device_bytes - allowed, reason)
            or (state.no_stricter_policy and state.swap_all_in_place(reason))):
        return Judgement("over_budget_tightened_in_place", tightened=True)
    return None


def over_budget_within_capacity(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Over what the policy must stay under, but within the capacity with nothing passively swapped:
    variance (routing, lengths) the in-place tightenings did not remove, not a new program, so profiling
    again would find the same: the policy is kept."""
    capacity_bytes, peak_bytes = state.capacity_bytes, outcome.peak_device_bytes
    if peak_bytes > state.allowed_peak_bytes and capacity_bytes is not None and peak_bytes <= capacity_bytes:
        assert outcome.policy is not None
        logger.info("%s, within the capacity %s and with no passive swap: policy %s kept",
                    _over_budget_reason(outcome, state), format_bytes(capacity_bytes), outcome.policy.name)
        return Judgement("over_budget_within_capacity")
    return None


def over_budget(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Over what the policy must stay under, and nothing above absorbed it: the runtime profiles again."""
    if outcome.peak_device_bytes > state.allowed_peak_bytes:
        return Judgement("over_budget", over_budget_reason=_over_budget_reason(outcome, state))
    return None


def passive_swaps_not_absorbed(outcome: IterationOutcome, state: JudgedState) -> Judgement | None:
    """Within what it must stay under, but with passive swaps no rule above absorbs (in the completed
    attempt or a failed one): ``PolicyController.record`` counts them, and they send the runtime back."""
    if outcome.passive_swaps or outcome.failed_attempt_passive_swaps:
        return Judgement("passive_swaps_not_absorbed")
    return None


def held(outcome: IterationOutcome, state: JudgedState) -> Judgement:
    """The chosen policy held: within what it must stay under, no passive swap (the last rule: it always
    answers)."""
    return Judgement("held")


RULES: tuple[Rule, ...] = (
    trial,
    not_stable_under_the_chosen,
    scaled_for_a_grown_shape,
    predicted_short,
    slightly_short_near_floor,
    over_budget_with_passive_swaps,
    over_budget_tightened_in_place,
    over_budget_within_capacity,
    over_budget,
    passive_swaps_not_absorbed,
    held,
)
"""The rules in the order they are asked (the first that answers wins)."""


def judge(outcome: IterationOutcome, state: JudgedState, rules: tuple[Rule, ...] = RULES) -> Judgement:
    """The judgement of the first of ``rules`` that answers for ``outcome``."""
    for rule in rules:
        judgement = rule(outcome, state)
        if judgement is not None:
            return judgement
    raise AssertionError("the last rule always answers")
