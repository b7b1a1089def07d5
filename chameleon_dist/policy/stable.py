"""``StableDecisions``: which policy Stable applies, chosen after the trials or changed in place.

It sees the ``PolicyController``'s parts together (the chosen policy, the swap-everything baseline, the
generation's basis, the trials, what was learned) and is the ``policy.judgement.JudgedState`` the rules
read. It makes the choice when the trials are done (``choose_after_trials``: the fastest that held, one
untried, or swapping everything) and the three changes a Stable iteration may make in place: scaling the
chosen policy for a grown shape, tightening it from the same trace, and swapping everything instead.
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
from chameleon_dist.policy.ranking import TrialRanking
from chameleon_dist.policy.tightening import GROWTH_TOLERANCE, MAX_IN_PLACE_TIGHTENINGS, policies_for, stricter_than
from chameleon_dist.policy.trials import choose, fastest_fitting_else_lowest, passive_swaps_expected
from chameleon_dist.units import format_bytes

__all__ = ["StableDecisions"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StableDecisions:
    """The controller's parts as the judgement reads them, the choice after the trials, and the in-place
    changes of the chosen policy (each answers whether it changed it)."""

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

    # ---- the choice after the trials -------------------------------------------------------
    def choose_after_trials(self, ranking: TrialRanking) -> None:
        """The trials are done: keep what ``policy.trials.choose`` says, the fastest policy that held with
        headroom (how much one policy's peak moved between its trials), the fastest that held when none has
        it, one untried (``choose_untried``) or none (swap every eligible tensor) when none held, none when
        swapping everything was measured faster than every policy that held."""
        stable, results, swap_all_s = self.stable, self.round.results, self.baseline.iteration_s
        stable.chosen = None
        if not results:
            return
        choice = choose(results, self.allowed_peak_bytes, swap_all_s, ranking.margin)
        if choice.best is None and not choice.swap_all_faster and self.choose_untried():
            return
        if choice.best is None:
            logger.warning("%s; swapping every eligible tensor until the next policy", (
                f"swapping everything was measured faster ({swap_all_s * 1e3:.1f} ms/iteration) than "
                f"every policy that held" if choice.swap_all_faster else f"none of {len(results)} policy trials "
                "held the memory budget" + (", none is predicted to fit, and swapping everything held in WarmUp without "
                                            "passive swap" if self.baseline.held_alone else "")
                + " (lower memory_budget or min_swap_bytes if this repeats)"))
            return
        best = choice.best
        # policies without trials (in place, grown shapes) start from what the chosen one aimed for
        self.round.explore_bytes = max(0, int(best.policy.settings.get("reserve_bytes", 0)) - self.learned.reserve_bytes)
        stable.headroom_bytes = choice.headroom_bytes
        stable.choose(best.policy)
        logger.info(
            "policy %s chosen (v%d): %.1f ms/iteration, peak %s (headroom %s%s)%s", best.policy.name, stable.version,
            best.iteration_s * 1e3, format_bytes(best.peak_bytes), format_bytes(stable.headroom_bytes),
            "" if choice.roomy else "; no trial had it",
            f"; predicted short, passive swap takes {format_bytes(best.passive_swap_bytes)}"
            if best.passive_swap_bytes else "",
        )

    def choose_untried(self) -> bool:
        """None of the trials held: rather than swap everything, apply (untried) the policy the trials'
        feedback made stricter: the fastest predicted to fit, else the one predicted lowest. If it does not
        hold either, Stable's own checks send the runtime back to WarmUp. False when there is no trace, or
        when none is predicted to fit and swapping everything held in WarmUp without passive swap (issue 27:
        a policy predicted short that no trial confirmed would lean on passive swap every iteration)."""
        if self.basis.trace is None:
            return False
        policies = policies_for(self.basis.trace, 1.0, self.settings_now())
        if not policies or (self.baseline.held_alone and not any(p.feasible for p in policies)):
            return False  # (none predicted to fit, where swapping everything held: that is kept instead)
        self.stable.choose(fastest_fitting_else_lowest(policies))
        logger.warning("none of %d policy trials held the memory budget; policy %s, stricter by their feedback "
                       "(aiming %s under the budget), chosen untried (v%d)", len(self.round.results),
                       self.stable.chosen.name, format_bytes(self.learned.reserve_bytes), self.stable.version)
        return True

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
