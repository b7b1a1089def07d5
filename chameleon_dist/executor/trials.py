"""GenPolicy bookkeeping: generate candidate policies from the latest trace, try one per iteration, keep
the fastest that held the memory budget (the paper generates n=5 and keeps the best)."""

from __future__ import annotations

import dataclasses
import logging
import time

from chameleon_dist.policy.generator import PolicySettings, generate_policies
from chameleon_dist.policy.model import Policy
from chameleon_dist.trace.step_trace import StepTrace
from chameleon_dist.units import format_bytes

logger = logging.getLogger(__name__)

STALL_TOLERANCE = 0.02  # of the iteration: more unpredicted stall than this triggers a timing rescale
TIME_TOLERANCE = 0.25  # ... when the measured compute time is this far from the trace's

STRICTER_SHARE = 0.1
"""After a passive swap under a policy, the next policies aim this share of the needed reduction (no-swap
peak - budget) further under the budget."""


@dataclasses.dataclass
class TrialResult:
    policy: Policy
    iteration_s: float
    peak_bytes: int
    held: bool  # within the budget, no passive swap, no out-of-memory retry


class PolicyTrials:
    def __init__(self) -> None:
        self.candidates: list[Policy] = []
        self.results: list[TrialResult] = []
        self.current: Policy | None = None  # the policy Stable applies
        self.version = 0
        self.reserve_bytes = 0  # how far under the budget the next policies aim
        self.time_scale = 1.0  # measured compute time / the trace's, learned from the trials
        self._infeasible_failed = False  # a policy predicted not to fit was tried and did not hold
        self._needed_bytes = 0  # no-swap peak - budget of the latest trace
        self.generation_s = 0.0
        self.regenerate = False

    def generate(self, trace: StepTrace, settings: PolicySettings) -> list[Policy]:
        settings = dataclasses.replace(settings, reserve_bytes=self.reserve_bytes)
        start = time.perf_counter()
        result = generate_policies(trace, settings)
        self._needed_bytes = max(0, result.no_swap_peak_bytes - settings.budget_bytes)
        self.generation_s = time.perf_counter() - start
        # a policy the simulator already says does not fit is not worth a trial: the swap-everything executor
        # (with passive swap behind it) is the safer bet then
        # a policy the simulator says does not fit is tried only when none does (the smallest shortfalls
        # first): the trial shows whether it beats the swap-everything executor behind it
        feasible = [p for p in result.policies if p.feasible]
        if not feasible and any(r.held for r in self.results):
            # feedback made the model stricter than reality: keep trying what already held
            logger.info("regenerated policies are predicted not to fit; keeping the ones that held")
            self.regenerate = False
            return self.candidates
        self.candidates = feasible or ([] if self._infeasible_failed else list(result.policies))
        self.regenerate = False
        best = result.best
        logger.info(
            "generated %d policies (%d predicted to fit) from iteration %d in %.3f s; best: %s",
            len(result.policies), len(self.candidates), trace.iteration, self.generation_s,
            best.summary().splitlines()[0] if best else "none",
        )
        if best is not None and not best.feasible:
            logger.warning("no policy is predicted to fit the memory budget (%s); %s", best.reason,
                           "swapping every eligible tensor (such a policy already failed)" if self._infeasible_failed
                           else "trying the closest ones")
        return self.candidates

    def start(self) -> None:
        """A new GenPolicy stage: forget the previous trials."""
        self.results = []

    def trial_policy(self) -> Policy | None:
        """The next candidate not tried yet since the last generation (cycling when all were)."""
        if not self.candidates:
            return None
        tried = {id(r.policy) for r in self.results}
        fresh = [p for p in self.candidates if id(p) not in tried]
        return fresh[0] if fresh else self.candidates[len(self.results) % len(self.candidates)]

    def record(
        self, policy: Policy, iteration_s: float, peak_bytes: int, held: bool, budget_bytes: int, stall_s: float = 0.0
    ) -> None:
        """One trial's outcome, fed back into the next generation (``regenerate`` asks for it):

        - a policy that went over the budget makes the next ones aim lower by as much as it missed;
        - a policy that stalled more than predicted because the trace's op times were off (the profiled
          iteration ran with the detailed recorder, whose cost is not the job's) rescales the op times
          by the compute time this iteration actually took."""
        self.results.append(TrialResult(policy, iteration_s, peak_bytes, held))
        compute_s = max(iteration_s - stall_s, 1e-9)
        ratio = compute_s / max(policy.compute_s, 1e-9)
        stalled = policy.predicted_stall_s + STALL_TOLERANCE * iteration_s < stall_s < iteration_s / 2
        if stalled and abs(ratio - 1) > TIME_TOLERANCE:  # (a link-bound trial says little about compute)
            self.time_scale *= ratio
            self.regenerate = True
            logger.info("policy %s stalled %.1f ms (predicted %.1f): op times rescaled by %.2f",
                        policy.name, stall_s * 1e3, policy.predicted_stall_s * 1e3, ratio)
        if peak_bytes > budget_bytes and peak_bytes > policy.predicted_peak_bytes:
            miss = peak_bytes - max(policy.predicted_peak_bytes, 1)
            self.reserve_bytes = min(budget_bytes, self.reserve_bytes + miss)
            self.regenerate = True
            logger.info("policy %s peaked %s above its prediction: next policies aim %s under the budget",
                        policy.name, format_bytes(miss), format_bytes(self.reserve_bytes))

    def choose(self) -> Policy | None:
        """The fastest policy that held (per policy: its best trial); None when none did."""
        held = [r for r in self.results if r.held]
        if not self.results:
            self.current = None
            return None
        if not held:
            logger.warning(
                "none of %d policy trials held the memory budget; swapping every eligible tensor until the "
                "next policy (lower memory_budget or min_swap_bytes if this repeats)", len(self.results),
            )
            self.current = None
            return None
        best = min(held, key=lambda r: r.iteration_s)
        self.current = best.policy
        self.version += 1
        logger.info(
            "policy %s chosen (v%d): %.1f ms/iteration, peak %s", best.policy.name, self.version,
            best.iteration_s * 1e3, format_bytes(best.peak_bytes),
        )
        return self.current

    def tighten(self, failed: Policy | None = None) -> None:
        if failed is not None and not failed.feasible:
            self._infeasible_failed = True
        self.reserve_bytes += max(1, int(STRICTER_SHARE * self._needed_bytes))
        logger.info("the policy did not hold: the next policies aim %s under the budget", format_bytes(self.reserve_bytes))
