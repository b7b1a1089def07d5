"""``InPlace``: what the chosen policy may do without new trials, and what the judgement rules read.

It is the ``PolicyController``'s ``policy.judgement.JudgedState``: the controller's parts seen together
(the chosen policy, the swap-everything baseline, the generation's basis, the trials, what was learned),
with the three changes a Stable iteration may make in place: scaling the chosen policy for a grown shape,
tightening it from the same trace, and swapping everything instead.
"""

from __future__ import annotations

import dataclasses
import logging

from chameleon_dist.policy.controller_state import (
    ChosenPolicy,
    GenerationBasis,
    Learned,
    ProfiledIteration,
    SwapAllBaseline,
    TrialRound,
)
from chameleon_dist.policy.inputs import PolicySettings
from chameleon_dist.policy.model import Policy
from chameleon_dist.policy.outcome import IterationOutcome
from chameleon_dist.policy.tightening import GROWTH_TOLERANCE, MAX_IN_PLACE_TIGHTENINGS, policies_for, stricter_than
from chameleon_dist.policy.trials import fastest_fitting_else_lowest, passive_swaps_expected
from chameleon_dist.units import format_bytes

__all__ = ["InPlace"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class InPlace:
    """The controller's parts as the judgement reads them, and the in-place changes of the chosen policy
    (each answers whether it changed it)."""

    settings: PolicySettings
    capacity_bytes: int | None
    stable: ChosenPolicy
    baseline: SwapAllBaseline
    basis: GenerationBasis
    round: TrialRound
    profiled: ProfiledIteration
    learned: Learned

    # ---- what the rules read ----------------------------------------------------------------
    @property
    def chosen(self) -> Policy | None:
        return self.stable.chosen

    @property
    def budget_bytes(self) -> int:
        return self.settings.budget_bytes

    @property
    def allowed_peak_bytes(self) -> int:
        """What a policy must stay under: the budget, or, where no swap can meet it (a peak in the
        optimizer step, a link too slow), the peak of the swap-everything executor it replaces."""
        return max(self.settings.budget_bytes, self.baseline.peak_bytes)

    @property
    def needed_bytes(self) -> int:
        return self.basis.needed_bytes

    @property
    def no_stricter_policy(self) -> bool:
        return self.stable.no_stricter_policy

    def swap_all_fits(self) -> bool:
        """Near the floor: swapping everything fitted the capacity (``SwapAllBaseline.fits_near_floor``)."""
        return self.baseline.fits_near_floor(self.capacity_bytes)

    def expected_passive_swaps(self, policy: Policy, outcome: IterationOutcome) -> bool:
        """``outcome``'s passive swaps (without an out-of-memory retry) under the chosen ``policy`` are what
        its trials measured (``policy.trials.passive_swaps_expected``): a policy predicted short, kept with
        passive swap for the remainder."""
        return (policy is self.stable.chosen and bool(outcome.passive_swaps) and not outcome.oom_retries
                and passive_swaps_expected(self.round.results, policy, outcome.passive_swap_bytes))

    def growth(self, outcome: IterationOutcome) -> float:
        """The bytes ``outcome``'s iteration saved for backward over those of the latest generation's
        trace (1.0 when either is unknown)."""
        trace = self.basis.trace
        traced = self.profiled.saved_bytes.get(trace.iteration, 0) * self.basis.generated_for if trace else 0
        return outcome.saved_bytes / traced if traced and outcome.saved_bytes else 1.0

    def settings_now(self) -> PolicySettings:
        """What the latest generation worked with (the settings, its ``min_swap_bytes``), aiming the reserve
        now under the budget, plus what this GenPolicy stage explores (or the chosen policy explored)."""
        reserve_bytes = min(self.settings.budget_bytes, self.learned.reserve_bytes + self.round.explore_bytes)
        return dataclasses.replace(self.settings, min_swap_bytes=self.basis.min_swap_bytes, reserve_bytes=reserve_bytes)

    # ---- what the rules change --------------------------------------------------------------
    def scale_for(self, outcome: IterationOutcome) -> bool:
        """The chosen policy failed on an iteration that saved more than the traced one: a policy from the
        trace grown to the new size (``policy.scaling.grown``), applied without trials (the fastest
        predicted to fit, else the one predicted lowest). False when the iteration did not grow beyond what
        the policy is made for (then the runtime profiles again)."""
        growth = self.growth(outcome)
        if growth <= self.stable.scaled_for * (1 + GROWTH_TOLERANCE):
            return False
        policies = policies_for(self.basis.trace, growth, self.settings_now())
        if not policies:
            return False
        self.stable.replace(fastest_fitting_else_lowest(policies))  # (the grown trace is a model: worth a try)
        self.stable.scaled_for = growth
        logger.info("iteration %d saved %.2fx the traced bytes (a new shape) and its policy did not hold: policy "
                    "%s made for the trace grown alike chosen (v%d)", outcome.iteration, growth,
                    self.stable.chosen.name, self.stable.version)
        return True

    def swap_all_in_place(self, reason: str) -> bool:
        """No stricter policy is predicted for a chosen policy slightly short, but swapping every eligible
        tensor fitted the capacity in WarmUp (the floor fits): swap everything in Stable, in place, rather
        than profile again (the next stricter choice; the trace is the same). False when the floor does not
        fit or there is no policy to leave."""
        if self.stable.chosen is None or not self.swap_all_fits():
            return False
        logger.info("%s; no stricter policy is predicted, and swapping every eligible tensor peaked at %s within "
                    "the capacity: swapping everything in place (v%d)", reason,
                    format_bytes(self.baseline.peak_bytes), self.stable.version + 1)
        self.stable.replace(None)
        self.stable.in_place_left = 0
        return True

    def tighten_in_place(self, policy: Policy, shortfall_bytes: int, reason: str,
                         peak_within_capacity: bool = False) -> bool:
        """A Stable overshoot within the capacity: a stricter policy from the same trace, without trials.
        False when it cannot be absorbed (over the capacity, out of tightenings, no policy predicted to
        fit or at least lower than ``policy``). ``peak_within_capacity``: the shortfall is what passive swap
        moved in an iteration that completed within the capacity (not a peak over it)."""
        within_capacity = (peak_within_capacity or self.capacity_bytes is None
                           or self.allowed_peak_bytes + shortfall_bytes <= self.capacity_bytes)
        stable = self.stable
        stable.no_stricter_policy = False
        if not within_capacity or stable.in_place_left <= 0 or self.basis.trace is None or policy is not stable.chosen:
            return False
        step_bytes = max(1, 2 ** (MAX_IN_PLACE_TIGHTENINGS - stable.in_place_left) * shortfall_bytes)
        stricter, reserve_bytes = stricter_than(policy, self.basis.trace, stable.scaled_for, self.settings_now(),
                                                step_bytes)
        self.learned.reserve_bytes = reserve_bytes - self.round.explore_bytes
        if not stricter:
            stable.no_stricter_policy = True
            logger.info("%s; no stricter policy is predicted", reason)
            return False
        stable.in_place_left -= 1
        stable.replace(fastest_fitting_else_lowest(stricter))
        logger.info("%s (within the capacity): policy %s chosen in place (v%d), aiming %s under the budget",
                    reason, stable.chosen.name, stable.version, format_bytes(self.learned.reserve_bytes))
        return True
